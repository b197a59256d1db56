"""vlbatch: folders of PDFs and images -> Parquet tables of vision-language-model answers."""

import os

__version__ = "0.1.0"

# set by the CLI ("1" with --debug), inherited by render workers and the engine's processes
LIBRARY_CHATTER_ENV = "VLBATCH_LIBRARY_CHATTER"


def library_chatter() -> bool:
    """Whether third-party libraries may print to stderr (MuPDF's repair messages, vLLM's
    weight-loading bars): only under `--debug`, so cron logs hold vlbatch's lines alone."""
    return os.environ.get(LIBRARY_CHATTER_ENV) == "1"
