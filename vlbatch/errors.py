"""The project's own exceptions. Library code raises these; only the CLI prints and exits.

Each carries the exit code that DESIGN.md's table gives it.
"""


class VlbatchError(Exception):
    """Base class: a failure that stops a command, with a one-line reason."""

    exit_code = 1


class JobFileError(VlbatchError):
    """Usage or job-file error (bad YAML, unknown or missing field): nothing was run."""

    exit_code = 2


class JobCannotRunError(VlbatchError):
    """No inputs matched, output or cache not writable, or the engine failed to start."""

    exit_code = 3


class ErrorBudgetExceeded(VlbatchError):
    """The job ran, but more pages failed than the job's max_error_rate allows."""

    exit_code = 4


class EngineStayedDown(VlbatchError):
    """The engine died mid-run, and the one started in its place died too (or did not
    start): rendering stopped, the pages left got transient error rows (the next run
    retries them), and cron sees a failure."""

    exit_code = 5


class OutputLocked(VlbatchError):
    """Another live run holds this output folder's lock (EX_TEMPFAIL: try later)."""

    exit_code = 75


class RunInterrupted(BaseException):
    """A signal (SIGTERM, SIGINT, SIGHUP) stopped the run. Finished rows are written and the
    manifest says 'interrupted'; the next run does the rest. A BaseException, as
    KeyboardInterrupt is, so no `except Exception` on the way turns it into another error.
    Exit code 128 + the signal's number (143, 130, 129), as shells report a signal."""

    def __init__(self, signum: int):
        import signal

        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}: finished rows are "
                         f"written; the next run does the rest")
