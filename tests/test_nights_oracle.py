"""Nights against a fresh run: after any sequence of changes to an archive and its job, the
output's current results, pages and typed rows are what one run over the final state, into
a new output folder with an empty cache, writes. Each night one random change: a file deleted, added, copied,
moved, rewritten, cut short, grown, broken, two files swapped, touched; a prompt changed
(or back), a task added, taken out or renamed, its answer length or its fields' type
changed, the render resolution changed, a glob narrowed or widened, the cache folder
deleted, the tables compacted.
The engine is scripted (an answer is a function of the page's pixels and the prompt), so
the two runs' answers are comparable; it is not the subject here."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pymupdf
import pytest

import oddfiles
from conftest import ROOT, job_fields
from fakes import ScriptedEngine, fake_prompts
from vlbatch.job import load_job
from vlbatch.run import run_job

KEY = ["source", "page", "task"]
COLUMNS = [*KEY, "output", "status"]
CHANGES = ["delete", "add", "copy", "move", "rewrite", "cut", "grow", "break", "swap", "touch",
           "prompt", "task+", "task-", "glob", "compact", "dpi", "tokens", "fieldtype",
           "rename", "wipe"]


def answer(request):
    task = request.task
    pixels = hashlib.md5(request.image.tobytes()).hexdigest()[:10]
    text = (f"{task.name}|{request.text}|{pixels}|{request.image.width}x{request.image.height}"
            f"|{task.max_tokens}")
    if not task.fields:
        return text, "stop"
    paid = int(pixels, 16) % 2 == 0
    typed = paid if json.loads(task.fields)["paid"] == "boolean" else ("yes" if paid else "no")
    return json.dumps({"paid": typed}), "stop"


def night(job_path: Path) -> None:
    engine = ScriptedEngine(answer)
    run_job(load_job(job_path), engine_factory=lambda j, p: engine, prompts_factory=fake_prompts)


def current(out: Path) -> dict[str, pl.DataFrame]:
    """The output's current results, pages and typed rows, in the columns both runs share."""
    tables = {"results": pl.read_delta(str(out / "results")).select(COLUMNS),
              "pages": pl.read_delta(str(out / "pages")).select(
                  "source", "page", "width", "height", "content_hash")}
    for typed in sorted((out / "fields").glob("*")):  # a table emptied by retirement is none
        rows = pl.read_delta(str(typed))
        if rows.height:
            tables[f"fields/{typed.name}"] = rows.select(*KEY, "paid")
    return {name: t.sort(t.columns, nulls_last=True) for name, t in tables.items()}


class Archive:
    """The archive's files and job, and one random change a night."""

    def __init__(self, root: Path, rng: random.Random):
        self.docs, self.rng, self.made = root / "docs", rng, 0
        (self.docs / "sub").mkdir(parents=True)
        for name in ["a.pdf", "b.pdf", "c.pdf", "sub/d.pdf"]:
            self.new_pdf(self.docs / name)
        shutil.copy(ROOT / "data" / "samples" / "chart.jpg", self.docs / "e.jpg")
        self.job = job_fields("fake-model", ["docs/*", "docs/sub/*"])
        self.job["tasks"][0]["prompt"] = "P0"

    def new_pdf(self, path: Path, pages: int | None = None) -> None:
        self.made += 1  # every document its own text: no two pages alike but copies
        oddfiles.pdf(path, pages=pages or self.rng.randint(1, 3), text=f"document {self.made}")

    def files(self) -> list[Path]:
        return sorted(p for p in self.docs.rglob("*") if p.is_file())

    def change(self, kind: str) -> str:
        rng, files = self.rng, self.files()
        pdfs = [p for p in files if p.suffix == ".pdf"]
        if kind == "delete" and files:
            victim = rng.choice(files)
            victim.unlink()
            return f"delete {victim.name}"
        if kind == "add":
            self.new_pdf(self.docs / rng.choice(["", "sub"]) / f"new{self.made}.pdf")
            return "add"
        if kind == "copy" and files:
            original = rng.choice(files)
            shutil.copy(original, original.with_name(f"copy{self.made}{original.suffix}"))
            self.made += 1
            return f"copy {original.name}"
        if kind == "move" and files:
            moved = rng.choice(files)
            to = (self.docs / "sub" if moved.parent == self.docs else self.docs) / moved.name
            if not to.exists():
                shutil.move(moved, to)
            return f"move {moved.name}"
        if kind in ("rewrite", "grow") and pdfs:
            target = rng.choice(pdfs)
            self.new_pdf(target, 4 if kind == "grow" else None)
            return f"{kind} {target.name}"
        if kind == "cut" and pdfs:  # the same document, its first page only
            target = rng.choice(pdfs)
            try:
                with pymupdf.open(target) as doc:
                    doc.select([0])
                    data = doc.tobytes()
            except Exception:  # noqa: BLE001 - broken by an earlier night
                return "cut: unreadable"
            target.write_bytes(data)
            return f"cut {target.name}"
        if kind == "break" and files:
            target = rng.choice(files)
            oddfiles.random_bytes(target, 1000 + self.made)
            self.made += 1
            return f"break {target.name}"
        if kind == "swap" and len(pdfs) >= 2:
            x, y = rng.sample(pdfs, 2)
            parked = x.with_suffix(".swap")
            os.rename(x, parked), os.rename(y, x), os.rename(parked, y)
            return f"swap {x.name} {y.name}"
        if kind == "touch" and files:
            target = rng.choice(files)
            os.utime(target)
            return f"touch {target.name}"
        tasks = self.job["tasks"]
        if kind == "prompt":
            tasks[0]["prompt"] = rng.choice(["P0", "P1", "P2"])
            return f"prompt {tasks[0]['prompt']}"
        if kind == "task+" and len(tasks) == 2:
            tasks.append({"name": "flags", "prompt": "Paid?", "max_tokens": 20,
                          "fields": {"paid": "boolean"}})
            return "task+"
        if kind == "task-" and len(tasks) > 1:
            tasks.pop(rng.randrange(1, len(tasks)))
            return "task-"
        if kind == "rename" and len(tasks) == 3:
            tasks[2]["name"] = "checks" if tasks[2]["name"] == "flags" else "flags"
            return f"rename {tasks[2]['name']}"
        if kind == "fieldtype" and len(tasks) == 3:
            now = tasks[2]["fields"]["paid"]
            tasks[2]["fields"] = {"paid": "string" if now == "boolean" else "boolean"}
            return f"fieldtype {tasks[2]['fields']['paid']}"
        if kind == "tokens":
            tasks[0]["max_tokens"] = rng.choice([8, 9, 10])
            return f"tokens {tasks[0]['max_tokens']}"
        if kind == "dpi":
            self.job["render"]["dpi"] = rng.choice([60, 72, 90])
            return f"dpi {self.job['render']['dpi']}"
        if kind == "glob":
            wide = len(self.job["inputs"]) == 2
            self.job["inputs"] = ["docs/*"] if wide else ["docs/*", "docs/sub/*"]
            return f"glob {self.job['inputs']}"
        return kind


@pytest.mark.parametrize("seed", [5, 17, 27])
def test_every_night_the_current_rows_are_a_fresh_runs(tmp_path, write_job, seed):
    rng = random.Random(seed)
    archive, done = Archive(tmp_path, rng), []
    for n in range(8):
        night(write_job(archive.job))
        fresh = dict(archive.job, output=f"fresh-{n}", cache=f"fresh-cache-{n}")
        night(write_job(fresh, name="fresh.yaml"))
        got, want = current(tmp_path / "out"), current(tmp_path / f"fresh-{n}")
        assert got.keys() == want.keys(), (n + 1, done)
        for name in got:
            mine, theirs = got[name], want[name]
            if not mine.equals(theirs):
                on = mine.columns
                pytest.fail(f"{name}, night {n + 1}, after {done}:\nonly in the nightly "
                            f"output:\n{mine.join(theirs, on=on, how='anti', nulls_equal=True)}"
                            f"\nonly in the fresh run's:\n"
                            f"{theirs.join(mine, on=on, how='anti', nulls_equal=True)}")
        done.append(archive.change(rng.choice(CHANGES)))
        if done[-1] == "wipe":  # the cache folder lost: the output alone says what is done
            shutil.rmtree(tmp_path / "cache", ignore_errors=True)
        if done[-1] == "compact":
            compacted = subprocess.run([sys.executable, "-m", "vlbatch", "compact",
                                        str(tmp_path / "out")], capture_output=True, text=True,
                                       timeout=300)
            assert compacted.returncode == 0, compacted.stderr
