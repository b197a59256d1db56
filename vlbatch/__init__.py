"""vlbatch: folders of PDFs and images -> Parquet tables of vision-language-model answers."""

import os

__version__ = "0.1.0"

# set by the CLI ("1" with --debug), inherited by render workers and the engine's processes
LIBRARY_CHATTER_ENV = "VLBATCH_LIBRARY_CHATTER"

# polars' allocator (its own jemalloc) keeps memory it freed for ~10 s before giving it back
# to the system; a night's planning frees most of what it allocates within a second (joins
# over every input), so that memory goes back at once (a night with nothing new over 100,000
# files: 60 MiB less at its peak). Read as polars loads: vlbatch sets it before importing
# polars; a value set by the user is kept.
os.environ.setdefault("_RJEM_MALLOC_CONF", "dirty_decay_ms:0,muzzy_decay_ms:0")


def library_chatter() -> bool:
    """Whether third-party libraries may print to stderr (MuPDF's repair messages, vLLM's
    weight-loading bars): only under `--debug`, so cron logs hold vlbatch's lines alone."""
    return os.environ.get(LIBRARY_CHATTER_ENV) == "1"
