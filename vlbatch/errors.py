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


class OutputLocked(VlbatchError):
    """Another live run holds this output folder's lock (EX_TEMPFAIL: try later)."""

    exit_code = 75
