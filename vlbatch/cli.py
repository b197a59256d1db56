"""The command line. The only place that prints errors and chooses exit codes (DESIGN.md):
0 ran, 2 usage/job-file error, 3 could not run, 4 error budget exceeded, 75 output locked,
128 + N stopped by signal N (143 SIGTERM, 130 SIGINT, 129 SIGHUP)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.logging import RichHandler

from vlbatch import LIBRARY_CHATTER_ENV
from vlbatch.errors import ErrorBudgetExceeded, JobCannotRunError, RunInterrupted, VlbatchError

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  help="Folders of PDFs and images -> Parquet tables of VLM answers (vLLM).")
# without a terminal (cron, a pipe): one line per message, tables not cut to 80 columns
err_console = Console(stderr=True, soft_wrap=True)
out_console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 240)


def _setup_logging(debug: bool) -> None:
    if err_console.is_terminal:
        handler: logging.Handler = RichHandler(console=err_console, show_path=debug,
                                               rich_tracebacks=debug)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:  # cron, a pipe: one line per event, an ISO time, no colours
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s",
                                               "%Y-%m-%dT%H:%M:%S%z"))
    if debug:  # everything, the engine's loggers included
        logging.basicConfig(level=logging.DEBUG, handlers=[handler], force=True)
    else:  # vlbatch's own log only; other libraries' warnings are not the user's business
        ours = logging.getLogger("vlbatch")
        ours.handlers[:] = [handler]
        ours.setLevel(logging.INFO)
        ours.propagate = False
        logging.getLogger().setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        os.environ.setdefault("TORCH_LOGS", "-torch")  # torch's Python loggers: errors only
    # quiet the engine's own chatter unless debugging (read when vLLM is imported)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if debug else "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "info" if debug else "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # read by the render workers (MuPDF's messages) and the engine (weight-loading bars)
    os.environ[LIBRARY_CHATTER_ENV] = "1" if debug else "0"


@contextmanager
def _signals_stop_the_run():
    """SIGTERM, SIGINT and SIGHUP (kill, Ctrl-C, systemctl stop, a closed terminal) stop
    the run where the main thread is: it stops feeding, writes the finished rows and the
    manifest ('interrupted') and exits 128 + the signal. A second signal exits at once."""
    caught: list[int] = []

    def stop(signum, frame):
        if caught:
            os._exit(128 + signum)
        caught.append(signum)
        raise RunInterrupted(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _fail(error: BaseException, debug: bool) -> None:
    if debug:
        err_console.print_exception()
    if isinstance(error, RunInterrupted):  # rows and manifest are on disk, synced
        err_console.print(f"vlbatch: {error}", markup=False, highlight=False)
        sys.stdout.flush()
        sys.stderr.flush()
        # at once: the engine's native threads may abort a normal interpreter exit
        # ("terminate called without an active exception") and lose the exit code
        os._exit(error.exit_code)
    if isinstance(error, VlbatchError):
        err_console.print(f"vlbatch: {error}", markup=False, highlight=False)
        raise typer.Exit(error.exit_code)
    err_console.print(f"vlbatch: internal error: {type(error).__name__}: {error}",
                      markup=False, highlight=False)
    raise typer.Exit(1)


@app.command()
def run(
    job_file: Path = typer.Argument(..., help="The job YAML."),
    output: Optional[str] = typer.Option(None, "--output", help="Output folder (overrides the job's)."),
    cache_dir: Optional[str] = typer.Option(None, "--cache-dir", help="Cache folder (overrides the job's)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1,
                                        help="Only the first N pages (sorted paths, page order)."),
    retry_errors: bool = typer.Option(False, "--retry-errors",
                                      help="Generate again the rows that ended in error."),
    verify: bool = typer.Option(False, "--verify", help="Hash every input again, whatever "
                                "its size and times say (a night otherwise hashes only new "
                                "files and files whose size, mtime, ctime or inode changed)."),
    debug: bool = typer.Option(False, "--debug", help="Tracebacks and the engine's logs."),
    metrics_file: Optional[str] = typer.Option(None, "--metrics-file", help="Write the run's "
                                               "outcome in Prometheus text format (overrides "
                                               "the job's metrics_file)."),
) -> None:
    """Run a job: every page x task of its inputs ends up as a row in OUTPUT/results."""
    _setup_logging(debug)
    from vlbatch.job import load_job
    from vlbatch.report import ProgressReporter, summary_table
    from vlbatch.run import run_job

    started: list = []  # the run's stats, once it has them
    metrics = {"path": Path(metrics_file).resolve() if metrics_file else None,
               "job": job_file.stem}
    try:
        job = load_job(job_file, output=output, cache=cache_dir)
        metrics["path"] = metrics["path"] or job.metrics_file
        metrics["job"] = job.name
        with _signals_stop_the_run(), ProgressReporter(err_console) as progress:
            try:
                stats = run_job(job, limit=limit, retry_errors=retry_errors, verify=verify,
                                progress=progress,
                                on_start=lambda s: (started.append(s), progress.watch(s)))
            finally:
                if started:
                    progress(started[0], force=True)
    except (Exception, KeyboardInterrupt, RunInterrupted) as e:  # noqa: BLE001 - errors end here
        if isinstance(e, ErrorBudgetExceeded) and started:  # the run ran: say what it did
            out_console.print(summary_table(started[0]))
        _write_metrics(metrics, e, started[0] if started else None)
        _fail(e, debug)
        return
    _write_metrics(metrics, None, stats)
    out_console.print(summary_table(stats))
    out_console.print(f"answers: {job.output / 'results'}  (pl.scan_delta(path), README: "
                      f"\"The output folder\")")
    for task in job.tasks:
        if task.answer_schema is not None:
            out_console.print(f"typed fields of {task.name}: {job.output / 'fields' / task.name}")
    report = job.output / "_runs" / f"{stats.run_id}.html"
    if report.is_file():
        out_console.print(f"report: {report}")


def _write_metrics(metrics: dict, error: BaseException | None, stats) -> None:
    """The outcome for monitoring, if asked for; a failure to write it is said, not fatal."""
    if metrics["path"] is None:
        return
    from vlbatch.errors import JobFileError
    from vlbatch.metrics import metrics_text, write_metrics

    if error is None:
        code, status = 0, "finished"
    else:
        code = getattr(error, "exit_code", 1)
        status = {ErrorBudgetExceeded: "error_budget_exceeded", RunInterrupted: "interrupted",
                  JobFileError: "job_file_error"}.get(type(error), "failed")
    try:
        write_metrics(metrics["path"], metrics_text(metrics["job"], code, status, stats))
    except OSError as e:
        err_console.print(f"vlbatch: cannot write the metrics file {metrics['path']}: {e}",
                          markup=False, highlight=False)


@app.command()
def inspect(
    output: Path = typer.Argument(..., help="An output folder of vlbatch run."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
) -> None:
    """Runs, rows by task and status, top error reasons and throughput of an output folder."""
    from rich.table import Table

    from vlbatch.output.inspect import inspect_output

    try:
        report = inspect_output(output)
    except Exception as e:  # noqa: BLE001
        _fail(e, False)
        return
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return
    runs = Table(title=f"runs in {output}", title_justify="left")
    for column in ("run_id", "status", "pages", "generated", "cache_hits", "rows_ok",
                   "rows_error", "seconds", "pages_per_s"):
        runs.add_column(column, justify="left" if column in ("run_id", "status") else "right")
    for run in report["runs"]:
        runs.add_row(*(str(run.get(c.header, "")) for c in runs.columns))
    out_console.print(runs)
    if report["versions"]:
        versions = Table(title=f"versions of {output}/results (newest first; read one with "
                               f"pl.scan_delta(path, version=N))", title_justify="left")
        for column in ("version", "operation", "action", "run_id", "rows", "added", "updated",
                       "deleted"):
            versions.add_column(column, justify="right" if column in ("version", "rows", "added",
                                                                     "updated", "deleted") else "left")
        for v in report["versions"][:30]:
            versions.add_row(*("" if v.get(c.header) is None else str(v.get(c.header))
                               for c in versions.columns))
        out_console.print(versions)
    current = report["current"]
    if current:
        out_console.print(f"current rows: {current['rows']} ({current['ok']} ok, {current['error']} "
                          f"error, {current['transient']} of them transient: the next run "
                          f"retries those) over {current['pages']} pages of "
                          f"{current['sources']} sources (version {current['version']}); "
                          f"{report['rows_written']} rows written in all")
        tasks = Table(title="current rows by task", title_justify="left")
        for column in ("task", "status", "error kind", "rows"):
            tasks.add_column(column)
        for row in report["by_task"]:
            tasks.add_row(row["task"], row["status"], row["error_kind"] or "", str(row["rows"]))
        out_console.print(tasks)
    for table in report["fields"]:
        columns = ", ".join(f"{name} {kind}" for name, kind in table["columns"].items())
        out_console.print(f"fields/{table['task']}: {table['rows']} current rows; {columns}")
    if report["top_errors"]:
        errors = Table(title="top error reasons", title_justify="left")
        errors.add_column("rows", justify="right")
        errors.add_column("kind")
        errors.add_column("error")
        for row in report["top_errors"]:
            errors.add_row(str(row["rows"]), row["error_kind"] or "", row["error"])
        out_console.print(errors)


@app.command()
def compact(
    output: Path = typer.Argument(..., help="An output folder of vlbatch run."),
    retain_days: float = typer.Option(7.0, "--retain-days", min=0,
                                      help="Keep the files of every version this many days "
                                           "old or newer (their history stays readable)."),
) -> None:
    """Compact each table's small files into large ones and vacuum the files no version
    within --retain-days reads, under the output's lock: readers see the version before
    or after, the same rows."""
    from rich.table import Table

    from vlbatch.output.compact import compact_output

    try:
        tables = compact_output(output, retain_days=retain_days)
    except Exception as e:  # noqa: BLE001
        _fail(e, False)
        return
    summary = Table(title=f"compacted {output}", title_justify="left")
    for column in ("table", "files before", "files after", "rows", "files vacuumed", "version"):
        summary.add_column(column, justify="left" if column == "table" else "right")
    for t in tables:
        summary.add_row(t.table, str(t.files_before), str(t.files_after), str(t.rows),
                        str(t.files_vacuumed), str(t.version))
    out_console.print(summary)


@app.command()
def report(
    output: Path = typer.Argument(..., help="An output folder of vlbatch run."),
    run_id: Optional[str] = typer.Option(None, "--run", help="The run (default: the newest)."),
) -> None:
    """Write a run's HTML report, OUTPUT/_runs/<run_id>.html (runs write their own at the
    end; this makes it again, or for runs from before reports)."""
    _setup_logging(False)
    from vlbatch.run_report import write_report

    try:
        path = write_report(output, run_id)
    except Exception as e:  # noqa: BLE001
        _fail(e, False)
        return
    out_console.print(f"report: {path}")


@app.command()
def plan(
    job_file: Path = typer.Argument(..., help="The job YAML."),
    output: Optional[str] = typer.Option(None, "--output", help="Output folder (overrides the job's)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1,
                                        help="Only the first N pages, as `run --limit`."),
    retry_errors: bool = typer.Option(False, "--retry-errors", help="As `run --retry-errors`."),
    verify: bool = typer.Option(False, "--verify", help="As `run --verify`."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
) -> None:
    """Validate a job and show what `vlbatch run` would do now (inputs, pages, pages already
    done, requests, estimated tokens and time), without starting the engine or writing."""
    _setup_logging(False)
    from dataclasses import asdict

    from rich.table import Table

    from vlbatch.dry_run import plan_job, plan_rows
    from vlbatch.job import load_job
    from vlbatch.run import default_prompts

    try:
        job = load_job(job_file, output=output)
        the_plan = plan_job(job, limit=limit, retry_errors=retry_errors,
                            prompts_factory=default_prompts, verify=verify)
    except Exception as e:  # noqa: BLE001
        _fail(e, False)
        return
    if as_json:
        print(json.dumps(asdict(the_plan), indent=2))
        return
    table = Table(title=f"plan of {job.name} into {job.output}", title_justify="left",
                  show_header=False)
    table.add_column("")
    table.add_column("", overflow="fold")
    for what, figure in plan_rows(the_plan):
        table.add_row(what, figure)
    out_console.print(table)


@app.command()
def migrate(
    output: Path = typer.Argument(..., help="An output folder of an earlier vlbatch version."),
) -> None:
    """Convert an output folder of Parquet parts (vlbatch before its tables) into Delta Lake
    tables, every row kept (each earlier run one version). A run does this by itself."""
    from vlbatch.output.folder import OutputFolder
    from vlbatch.output.migrate import migrate_output, needs_migration

    try:
        if not (output / "results").is_dir():
            raise JobCannotRunError(f"{output} is not a vlbatch output folder (no results/)")
        folder = OutputFolder(output)
        with folder.lock():
            done = migrate_output(folder) if needs_migration(folder) else {}
            folder.check_tables()
    except Exception as e:  # noqa: BLE001
        _fail(e, False)
        return
    if not done:
        out_console.print(f"{output}: nothing to migrate (its tables are Delta Lake tables)")
    for path, versions in done.items():
        out_console.print(f"{path}: migrated into a table of {versions} versions")


@app.command("schema")
def job_schema() -> None:
    """Print the job file's JSON Schema (for editors' YAML completion and checks)."""
    from vlbatch.job import job_json_schema

    print(json.dumps(job_json_schema(), indent=2))


def _version(value: bool) -> None:
    if value:
        from vlbatch import __version__

        out_console.print(f"vlbatch {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version,
                                          is_eager=True, help="Print the version and exit.")) -> None:
    """Folders of PDFs and images -> Parquet tables of VLM answers (vLLM)."""


cache_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="The cache folder of a job (results, rendered pages).")
app.add_typer(cache_app, name="cache")


def _cache_tenants(job_file: Optional[Path], cache_dir: Optional[str],
                   namespace: Optional[str], every: bool) -> tuple[Path, list[str]]:
    """The cache folder and the namespaces a cache command acts on: a job's own namespace
    (or --namespace); every namespace only when asked (--all), or to count with --cache-dir."""
    from vlbatch.errors import JobFileError
    from vlbatch.job import load_job
    from vlbatch.pipeline.cache import namespaces

    if job_file:
        job = load_job(job_file)
        folder, own = (Path(cache_dir).resolve() if cache_dir else job.cache), job.cache_namespace
    elif cache_dir:
        folder, own = Path(cache_dir).resolve(), None
    else:
        raise JobFileError("name a job file or --cache-dir")
    if not folder.is_dir():
        from vlbatch.errors import JobCannotRunError

        raise JobCannotRunError(f"no cache folder at {folder}")
    if every:
        return folder, namespaces(folder)
    if namespace or own:
        return folder, [namespace or own]
    raise JobFileError("with --cache-dir, name a --namespace or say --all")


@cache_app.command("stats")
def cache_stats_command(
    job_file: Optional[Path] = typer.Argument(None, help="A job file: its cache folder."),
    cache_dir: Optional[str] = typer.Option(None, "--cache-dir", help="A cache folder."),
    namespace: Optional[str] = typer.Option(None, "--namespace", help="One tenant's cache."),
    every: bool = typer.Option(False, "--all", help="Every namespace in the folder."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Entries and size of the result and feature caches, per namespace."""
    from rich.table import Table

    from vlbatch.pipeline.cache import cache_stats

    try:
        folder, tenants = _cache_tenants(job_file, cache_dir, namespace, every)
        rows = cache_stats(folder, tenants)
    except Exception as e:  # noqa: BLE001
        _fail(e, False)
        return
    if as_json:
        print(json.dumps({"cache": str(folder), "caches": rows}, indent=2))
        return
    table = Table(title=f"cache {folder}", title_justify="left")
    for column in ("namespace", "cache", "entries", "MiB", "kinds"):
        table.add_column(column, justify="right" if column in ("entries", "MiB") else "left")
    for row in rows:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(row["kinds"].items()))
        table.add_row(row["namespace"], row["cache"], str(row["entries"]),
                      f"{row['bytes'] / 2**20:.1f}", kinds)
    out_console.print(table)


@cache_app.command("clear")
def cache_clear_command(
    job_file: Optional[Path] = typer.Argument(None, help="A job file: its namespace's cache."),
    cache_dir: Optional[str] = typer.Option(None, "--cache-dir", help="A cache folder."),
    namespace: Optional[str] = typer.Option(None, "--namespace", help="One tenant's cache."),
    every: bool = typer.Option(False, "--all", help="Every namespace in the folder."),
    which: str = typer.Option("all", "--only", help="results, features or all."),
) -> None:
    """Remove cached answers and/or rendered pages of one namespace (the job's, or
    --namespace), or of every namespace with --all; the next run recomputes them."""
    from vlbatch.errors import JobFileError
    from vlbatch.pipeline.cache import clear_cache

    try:
        if which not in ("all", "results", "features"):
            raise JobFileError(f"--only takes results, features or all, not {which!r}")
        folder, tenants = _cache_tenants(job_file, cache_dir, namespace, every)
        removed = clear_cache(folder, tenants, which)
    except Exception as e:  # noqa: BLE001
        _fail(e, False)
        return
    out_console.print(f"removed {removed} entries from {folder} ({which}; namespaces: "
                      f"{', '.join(tenants) or 'none'})")


@app.command("make-tiny-model")
def make_tiny_model(path: Path = typer.Argument(Path("models/tiny-qwen3-vl"),
                                                help="Folder to write the model to.")) -> None:
    """Write a tiny Qwen3-VL with random weights (offline, deterministic) for trying jobs
    and for tests. Its answers are noise."""
    _setup_logging(False)
    from vlbatch.models.tiny import build_tiny_model

    try:
        out = build_tiny_model(path)
    except Exception as e:  # noqa: BLE001
        _fail(e, False)
        return
    out_console.print(f"tiny random Qwen3-VL in {out}")


def main() -> None:
    try:
        app()
    except SystemExit:
        raise
    except BaseException as e:  # anything that escaped a command
        err_console.print(f"vlbatch: {type(e).__name__}: {e}", markup=False)
        sys.exit(1)


if __name__ == "__main__":
    main()
