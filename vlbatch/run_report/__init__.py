"""The run report: OUTPUT/_runs/<run_id>.html, one self-contained page per run (written at
the end of every run, and by `vlbatch report OUTPUT [--run RUN_ID]` for any run).

    data.py        the run's manifest and rows, read back from the output folder (bounded)
    thumbnails.py  the sample pages' images (feature cache, else rendered again, bounded)
    plots.py       matplotlib figures as inline SVG
    page.py        the HTML
"""

from __future__ import annotations

import os
from pathlib import Path


def write_report(root: Path, run_id: str | None = None) -> Path:
    """Write the report of `run_id` (the newest run when None); its path. Atomic: a reader
    sees the old file or the new one."""
    from vlbatch.run_report.data import read_run
    from vlbatch.run_report.page import render_page
    from vlbatch.run_report.thumbnails import add_thumbnails

    data = read_run(Path(root), run_id)
    add_thumbnails(data.gallery, data.manifest.get("config", {}))
    html = render_page(data)
    path = Path(root) / "_runs" / f"{data.manifest['run_id']}.html"
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    tmp.write_text(html, encoding="utf-8")
    os.replace(tmp, path)
    return path
