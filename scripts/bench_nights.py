"""Nights over a growing archive (issue 33): N generated one-page PDFs of ~40 KB (a text line
that differs and an embedded photo-like JPEG), then, each night its own process as cron
starts `vlbatch run` (`run.run_job` with a stand-in engine that answers at once):

    first       every file new
    nothing     nothing new
    new1        1% new files
    changed1    1% of the files rewritten in place (new bytes)
    deleted1    1% of the files deleted

Prints each night's wall time (process start to exit), peak RSS of its process tree, whether
the engine started, the rows generated, and what the night saw change (the manifest's
`inputs`).

    python scripts/bench_nights.py [--files 10000] [--work DIR] [--dpi 100] [--max-pixels 262144]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _photo(seed: int, size: int = 38_000) -> bytes:
    """A JPEG of noise of about `size` bytes (photos do not compress)."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    side = 150
    while True:
        buf = io.BytesIO()
        Image.fromarray(rng.randint(0, 255, (side, side, 3), dtype=np.uint8)).save(
            buf, "JPEG", quality=80)
        if buf.tell() >= size:
            return buf.getvalue()
        side += 10


def make_pdf(path: Path, number: int, photo: bytes) -> None:
    import pymupdf

    doc = pymupdf.open()
    page = doc.new_page(width=595, height=842)
    page.insert_text((72, 90), f"Delivery note {number:08d}", fontsize=18)
    page.insert_text((72, 120), f"Customer {number * 7919 % 100000:05d}, parcel {number % 97}",
                     fontsize=11)
    page.insert_image(pymupdf.Rect(72, 160, 372, 460), stream=photo)
    doc.save(path)
    doc.close()


def make_archive(folder: Path, n: int) -> None:
    done = folder / f"_made-{n}"
    if done.exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    photo = _photo(0)
    for i in range(n):
        make_pdf(folder / f"note-{i:07d}.pdf", i, photo)
    done.write_text("")


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def night(work: Path, name: str) -> dict:
    """One night in its own process; its wall time, peak RSS and what its manifest says."""
    runs = work / "out" / "_runs"
    before = set(runs.glob("*.json")) if runs.exists() else set()
    started = time.monotonic()
    child = subprocess.Popen([sys.executable, __file__, "--night", str(work)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], _tree_rss(child.pid))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = child.communicate()
    wall = time.monotonic() - started
    stop.set()
    sampler.join()
    if child.returncode != 0:
        raise SystemExit(f"night {name} failed ({child.returncode}): {err[-3000:]}")
    manifest_path = next(iter(set(runs.glob("*.json")) - before))
    manifest = json.loads(manifest_path.read_text())
    s = manifest["summary"]
    return {"night": name, "wall_s": round(wall, 2), "run_s": s["seconds"],
            "peak_rss_mib": round(peak[0] / 2**20), "engine_started": s["engine_start_s"] is not None,
            "generated": s["generated"], "rows_ok": s["rows_ok"],
            "rows_retired": s.get("rows_retired"), "timings": s["timings"],
            "inputs": manifest["inputs"]["counts"]}


def run_one_night(work: Path) -> None:
    """In the child: what `vlbatch run job.yaml` does, with the stand-in engine."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    from stand_ins import InstantEngine, WordCount

    from vlbatch.job import load_job
    from vlbatch.run import run_job

    run_job(load_job(work / "job.yaml"), engine_factory=lambda j, p: InstantEngine(),
            prompts_factory=lambda j: WordCount())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=10000)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlbatch-nights"))
    parser.add_argument("--dpi", type=int, default=100)
    parser.add_argument("--max-pixels", type=int, default=256 * 32 * 32)
    parser.add_argument("--night", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.night:
        run_one_night(args.night)
        return
    import yaml

    work = args.work.resolve() / str(args.files)
    docs = work / "docs"
    started = time.monotonic()
    make_archive(docs, args.files)
    made_s = time.monotonic() - started
    for folder in ("out", "cache", "live"):
        shutil.rmtree(work / folder, ignore_errors=True)
    live = work / "live"  # the archive the nights see: hard links, changed night by night
    live.mkdir()
    for path in docs.glob("*.pdf"):
        os.link(path, live / path.name)
    job = {"name": "nights", "inputs": ["live/*.pdf"], "output": "out", "cache": "cache",
           "model": "stand-in", "tasks": [{"name": "a", "prompt": "Read this page."}],
           "render": {"dpi": args.dpi, "max_pixels": args.max_pixels,
                      "min_pixels": min(args.max_pixels, 64 * 32 * 32)}}
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    rng = random.Random(0)
    share = max(1, args.files // 100)
    nights = [night(work, "first")]
    time.sleep(2.1)  # files made within 2 s of their hashing are hashed once more (RACY_NS)
    nights.append(night(work, "nothing"))
    photo = _photo(1)
    for i in range(share):
        make_pdf(live / f"note-new-{i:07d}.pdf", args.files + i, photo)
    nights.append(night(work, "new1"))
    names = sorted(p.name for p in live.glob("note-0*.pdf"))
    for name in rng.sample(names, share):
        (live / name).unlink()  # a new file under the old name (the archive's copy is kept)
        make_pdf(live / name, 10**7 + rng.randrange(10**6), photo)
    nights.append(night(work, "changed1"))
    for name in rng.sample(sorted(p.name for p in live.glob("*.pdf")), share):
        (live / name).unlink()
    nights.append(night(work, "deleted1"))
    first = nights[0]["wall_s"]
    for n in nights:
        n["of_first"] = round(n["wall_s"] / first, 3)
        n["ms_a_file_over_3s"] = round(max(0.0, n["wall_s"] - 3) * 1000 / args.files, 3)
    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "files": args.files,
                      "dpi": args.dpi, "max_pixels": args.max_pixels,
                      "pdf_kib": round(sum(p.stat().st_size for p in list(docs.glob("*.pdf"))[:100])
                                       / 100 / 1024, 1),
                      "archive_made_s": round(made_s, 1), "nights": nights}, indent=1))


if __name__ == "__main__":
    main()
