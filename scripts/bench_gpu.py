"""GPU benchmark: raw vLLM `LLM.generate` over pages pre-rendered in memory vs `vlbatch run`
end to end (PDF files on disk -> Parquet), identical engine settings, each in its own
process with a fresh engine (no shared prefix or result cache).

    python scripts/bench_gpu.py job  --model DIR --pages-dir DIR --work DIR [--tasks 1]
    python scripts/bench_gpu.py raw    --job WORK/job.yaml --json OUT.json
    python scripts/bench_gpu.py vlbatch --job WORK/job.yaml --json OUT.json

`job` writes the job file (W1: A4 at 150 dpi capped at 1280*32*32 pixels, 256 output tokens
forced, greedy, load_format dummy). pages_per_s of both runs from the engine being ready to the last answer (raw: building
prompts, vLLM's input processing and generation; vlbatch: the same plus rendering, hashing
and writing Parquet as it goes); vlbatch also reports its rate over the whole run less
engine start (reading and probing the PDFs, planning), and engine start itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PROCESS_START = time.monotonic()  # whole-process times count from here (imports included)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TASKS = [("markdown", "Convert this page to Markdown."),
         ("summary", "Summarise this page in three sentences."),
         ("fields", 'Return JSON {"title": ..., "date": ..., "total": ...} for this page.'),
         ("tables", "List every table on this page as CSV.")]


# --answers schema: issue 18's invoice fields (structured outputs); --answers free: the same
# prompt without them. Neither forces the output length (a grammar ends where it ends).
INVOICE_PROMPT = "Extract the invoice's vendor, total, date, currency and whether it is paid."
INVOICE_FIELDS = {"vendor": "string", "total": "number", "date": "date", "paid": "boolean",
                  "currency": ["EUR", "USD", "GBP", "other"]}


def bench_tasks(args) -> list[dict]:
    if args.answers == "forced":
        return [{"name": n, "prompt": p, "max_tokens": args.max_tokens, "ignore_eos": True,
                 "temperature": 0.0} for n, p in TASKS[:args.tasks]]
    task = {"name": "invoice", "prompt": INVOICE_PROMPT, "max_tokens": 256, "temperature": 0.0}
    return [{**task, "fields": INVOICE_FIELDS} if args.answers == "schema" else task]


class CpuSampler:
    """Once a second: the machine's busy CPU cores (/proc/stat) and the three processes that
    used most CPU in that second, by name. Shows whether something competes with vLLM's
    engine start (Linux only; no samples elsewhere)."""

    def __init__(self) -> None:
        import threading

        self.samples: list[tuple] = []  # (s since process start, busy cores, [[name, pid, cores]])
        self.epoch = time.time() - (time.monotonic() - PROCESS_START)  # process start, wall clock
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def _machine_busy_ticks() -> int | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields) - fields[3] - fields[4]  # less idle and iowait

    @staticmethod
    def _process_ticks() -> dict[tuple[int, str], int]:
        ticks = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
            except OSError:  # the process ended
                continue
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text[text.rindex(")") + 2:].split()
            ticks[(int(stat.parent.name), name)] = int(fields[11]) + int(fields[12])  # utime+stime
        return ticks

    def _run(self) -> None:
        import os

        hz = os.sysconf("SC_CLK_TCK")
        before, procs_before, then = self._machine_busy_ticks(), self._process_ticks(), time.monotonic()
        while before is not None:
            time.sleep(1.0)
            now, procs, at = self._machine_busy_ticks(), self._process_ticks(), time.monotonic()
            if now is None:
                return
            seconds = (at - then) * hz
            top = sorted(((t - procs_before.get(k, 0), k) for k, t in procs.items()), reverse=True)[:3]
            self.samples.append((round(at - PROCESS_START, 1), round((now - before) / seconds, 2),
                                 [[name, pid, round(d / seconds, 2)] for d, (pid, name) in top if d]))
            before, procs_before, then = now, procs, at


class GpuSampler:
    """GPU busy (NVML, through nvidia-smi) every 200 ms: (s since process start, percent)."""

    def __init__(self) -> None:
        import shutil
        import subprocess
        import threading

        self.samples: list[tuple[float, int]] = []
        if shutil.which("nvidia-smi") is None:
            return
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu",
                                      "--format=csv,noheader,nounits", "-lms", "200"],
                                     stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.samples.append((round(time.monotonic() - PROCESS_START, 2), int(line.split(",")[0])))
            except ValueError:
                continue

    def busy(self, start_s: float, end_s: float) -> float | None:
        """Mean GPU busy percent between two times (s since process start)."""
        inside = [u for t, u in self.samples if start_s <= t <= end_s]
        return round(sum(inside) / len(inside), 1) if inside else None


def _setting(text: str) -> tuple[str, object]:
    import yaml

    key, _, value = text.partition("=")
    return key, yaml.safe_load(value)


def write_job(args) -> None:
    import yaml

    job = {
        "name": f"bench-w{'1' if args.tasks == 1 else '3'}",
        "inputs": [str(Path(args.pages_dir).resolve() / "*.pdf")],
        "output": str(Path(args.work).resolve() / "out"),
        "cache": str(Path(args.work).resolve() / "cache"),
        "model": str(Path(args.model).resolve()),
        "result_cache": False,
        "tasks": bench_tasks(args),
        "render": {"dpi": 150, "max_pixels": 1280 * 32 * 32},
        "engine": {"load_format": "dummy", "max_model_len": 4096,
                   **({"max_in_flight": args.max_in_flight} if args.max_in_flight else {}),
                   **dict(_setting(kv) for kv in args.engine)},
        **dict(_setting(kv) for kv in args.set),
    }
    Path(args.work).mkdir(parents=True, exist_ok=True)
    (Path(args.work) / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    print(Path(args.work) / "job.yaml")


def run_raw(args) -> dict:
    from vllm import LLM, SamplingParams

    from vlbatch.engine.prompts import PromptBuilder
    from vlbatch.engine.vllm_engine import engine_kwargs
    from vlbatch.job import load_job
    from vlbatch.pipeline import ingest
    from vlbatch.pipeline.discover import discover
    from vlbatch.pipeline.workers import WorkerPool, default_workers

    job = load_job(args.job)
    r = job.render
    sources = discover(job.inputs, job.base_dir)
    started = time.monotonic()
    with WorkerPool(default_workers(0), 120) as pool:
        probes = [p for _, p in pool.imap(ingest.probe, sources, lambda s: (s.abs_path, r.dpi, None))]
        units = [(s.abs_path, p.kind, pg.page) for s, p in zip(sources, probes) for pg in p.pages]
        units = units[:args.limit] if args.limit else units
        images = [page.image() for _, page in pool.imap(ingest.render, units, lambda u: (*u, r))]
    render_s = time.monotonic() - started
    prompts = PromptBuilder(job.model_path())
    t0 = time.monotonic()
    # --vllm-defaults: vLLM as a user writes it (dummy weights aside): one image a prompt,
    # the pixel budget, the job's max_model_len, vLLM's defaults otherwise; else the
    # arguments vlbatch passes
    kwargs = ({"model": job.model_path(), "load_format": "dummy", "seed": 0,
               "limit_mm_per_prompt": {"image": 1, "video": 0},
               "mm_processor_kwargs": {"max_pixels": r.max_pixels},
               # as the job's: on an 80 GB card vLLM refuses the model's own 262,144 (its
               # KV cache does not fit) and says to lower it
               "max_model_len": job.engine.max_model_len}
              if args.vllm_defaults else engine_kwargs(job))
    llm = LLM(**kwargs)
    engine_start_s = time.monotonic() - t0

    def requests_for(pages) -> tuple[list, list]:
        requests, params = [], []
        for image in pages:  # a page's tasks together, as vlbatch keeps them
            for task in job.tasks:
                requests.append({"prompt": prompts.chat_prompt(task.prompt),
                                 "multi_modal_data": {"image": image}})
                params.append(SamplingParams(max_tokens=task.max_tokens,
                                             temperature=task.temperature,
                                             ignore_eos=task.ignore_eos))
        return requests, params

    first_request = profile_first_request(llm, requests_for(images[-1:]), args.json)
    if args.warmup:  # in the same engine, on other pixels than the measured pages
        from PIL import ImageOps

        llm.generate(*requests_for([ImageOps.invert(i) for i in images[:args.warmup]]),
                     use_tqdm=False)
    requests, params = requests_for(images)
    t0 = time.monotonic()
    outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.monotonic() - t0
    gen_window = (t0 - PROCESS_START, t0 - PROCESS_START + seconds)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"mode": "raw-vllm-defaults" if args.vllm_defaults else "raw", "pages": len(images),
            "engine_kwargs": {k: str(v) for k, v in kwargs.items()},
            "wall_s_excluding_render": round(engine_start_s + seconds, 1), "requests": len(outputs),
            "render_s": round(render_s, 1), "engine_start_s": round(engine_start_s, 1),
            "generate_s": round(seconds, 2), "pages_per_s": round(len(images) / seconds, 2),
            "requests_per_s": round(len(outputs) / seconds, 2),
            "prompt_tokens_per_request": round(prompt_tokens / len(outputs), 1),
            "output_tokens": out_tokens, "window_s": gen_window,
            "warmup_pages": args.warmup, "first_request_processing_s": first_request}


def profile_first_request(llm, requests, json_path) -> float:
    """vLLM's input processing of one request, not added (outside the timed window), under
    cProfile: what the offline front-end does at its first request. The 20 costliest calls
    go beside the JSON."""
    import cProfile
    import io
    import pstats

    engine = llm.llm_engine
    profile = cProfile.Profile()
    t0 = time.monotonic()
    profile.enable()
    engine.input_processor.process_inputs("first", requests[0][0], requests[1][0],
                                          supported_tasks=engine.get_supported_tasks())
    profile.disable()
    seconds = time.monotonic() - t0
    if json_path is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
        json_path.with_suffix(".first-request.txt").write_text(text.getvalue())
    return round(seconds, 2)


def run_vlbatch(args) -> dict:
    from vlbatch.job import load_job
    from vlbatch.run import run_job

    job = load_job(args.job)
    if args.fresh:  # no answers, pages or index from an earlier run of this job
        import shutil

        for folder in (job.output, job.cache):
            shutil.rmtree(folder, ignore_errors=True)
    started = time.monotonic()
    last = [started]

    last_row = [started]  # when the sink wrote the newest row: the generation window's end

    def progress(stats) -> None:  # a line every 10 s: where a slow or stuck run is
        last_row[0] = time.monotonic()
        if time.monotonic() - last[0] >= 10:
            last[0] = time.monotonic()
            print(f"progress {last[0] - started:.0f} s: {stats.pages_finished}/{stats.pages_todo} "
                  f"pages, {stats.generated} generated, engine start {stats.engine_start_s}",
                  flush=True)

    import logging

    engine_log = logging.getLogger("vlbatch")  # the engine's start and warm-up lines
    engine_log.setLevel(logging.DEBUG)
    handler = logging.StreamHandler()
    handler.addFilter(lambda record: any(part in record.msg for part in (
        "warm-up", "started in", "input threads", "without their page's pixels",
        "feed start")))
    engine_log.addHandler(handler)
    stats = run_job(job, progress=progress, limit=args.limit or None)
    wall_s = time.monotonic() - started
    # not the process's end: the engine's shutdown (seconds, GPU idle) is not generation
    ended = last_row[0] - PROCESS_START
    run_s = stats.seconds - (stats.engine_start_s or 0)
    return {"mode": f"vlbatch-{job.executor}", "pages": stats.pages_finished,
            "ray": job.ray.model_dump() if job.executor == "ray" else None, "requests": stats.generated,
            "engine": job.engine.model_dump(mode="json"), "timings": stats.timings,
            "wall_s": round(wall_s, 1), "pages_per_s_wall": round(stats.pages_finished / wall_s, 2),
            "rows_ok": stats.rows_ok, "rows_error": stats.rows_error,
            "engine_start_s": stats.engine_start_s, "total_s": stats.seconds,
            "run_s_excluding_engine_start": round(run_s, 2),
            "pages_per_s_excluding_engine_start": round(stats.pages_finished / run_s, 2),
            "generation_s": stats.generation_s,
            "pages_per_s": round(stats.pages_finished / stats.generation_s, 2),
            "requests_per_s": round(stats.generated / stats.generation_s, 2),
            "prompt_tokens_per_request": round(stats.prompt_tokens / max(stats.generated, 1), 1),
            "prompt_tokens_cached": stats.prompt_tokens_cached,  # vLLM's prefix cache served
            "output_tokens": stats.output_tokens,
            "output_tokens_per_s": round(stats.output_tokens / stats.generation_s, 1),
            "retried": stats.retried, "bad_answers": stats.bad_answers,
            "fields_rows": stats.fields_rows,
            "window_s": (round(ended - (stats.generation_s or 0), 2), round(ended, 2)),
            "errors": error_reasons(job.output)}


def error_reasons(output: Path) -> dict[str, int]:
    """Error rows in the run's Parquet, counted by reason."""
    import polars as pl

    files = sorted((Path(output) / "results").glob("**/*.parquet"))
    if not files:
        return {}
    rows = pl.concat([pl.read_parquet(f, columns=["error"]) for f in files], how="diagonal")
    counts = rows.filter(pl.col("error").is_not_null()).group_by("error").len()
    return {row["error"][:300]: row["len"] for row in counts.iter_rows(named=True)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["job", "raw", "vlbatch"])
    parser.add_argument("--model")
    parser.add_argument("--pages-dir")
    parser.add_argument("--work")
    parser.add_argument("--tasks", type=int, default=1)
    parser.add_argument("--answers", choices=["forced", "free", "schema"], default="forced",
                        help="forced: TASKS, 256 tokens each; free/schema: one invoice task "
                        "without/with its fields")
    parser.add_argument("--max-in-flight", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="tokens each forced answer has (job mode)")
    parser.add_argument("--engine", action="append", default=[],
                        help="job: an engine setting KEY=VALUE (YAML value), repeatable")
    parser.add_argument("--set", action="append", default=[],
                        help="job: a top-level job field KEY=VALUE (YAML value), e.g. "
                             "executor=ray or 'ray={workers: 2}'")
    parser.add_argument("--vllm-defaults", action="store_true",
                        help="raw: LLM(model) with vLLM's defaults, not vlbatch's arguments")
    parser.add_argument("--job")
    parser.add_argument("--limit", type=int, default=0,
                        help="raw, vlbatch: the first N pages only (a warm-up run)")
    parser.add_argument("--fresh", action="store_true",
                        help="vlbatch: delete the job's output and cache folders first")
    parser.add_argument("--warmup", type=int, default=0,
                        help="raw: generate this many other pages first in the same engine")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--debug", action="store_true",
                        help="vlbatch's debug log (with executor: ray, the actors' logs too)")
    args = parser.parse_args()
    if args.debug:
        import logging

        logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("vlbatch").setLevel(logging.DEBUG)
    if args.mode == "job":
        write_job(args)
        return
    cpu, gpu = CpuSampler(), GpuSampler()
    result = run_raw(args) if args.mode == "raw" else run_vlbatch(args)
    if result.get("window_s"):
        start, end = result["window_s"]
        result["gpu_busy_pct"] = gpu.busy(start + 2, end - 1)  # steady state: ends trimmed
        result["gpu_busy_pct_window"] = gpu.busy(start, end)
    result["gpu_busy"] = gpu.samples[::5]
    result["process_start"] = time.strftime("%H:%M:%S", time.gmtime(cpu.epoch))  # UTC, as vLLM logs
    result["cpu_busy_cores"] = cpu.samples
    result["process_s"] = round(time.monotonic() - PROCESS_START, 1)
    result["date"] = time.strftime("%Y-%m-%d %H:%M")
    print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
