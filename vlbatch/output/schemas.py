"""The columns of the output tables (DESIGN.md: results table) and each table's key."""

from __future__ import annotations

import pyarrow as pa

RESULT_SCHEMA = pa.schema([
    ("source", pa.string()),
    ("page", pa.int32()),
    ("task", pa.string()),
    ("output", pa.string()),
    ("status", pa.string()),
    ("error", pa.string()),
    ("content_hash", pa.string()),
    ("phash", pa.string()),
    ("cached", pa.bool_()),
    ("reused_from", pa.string()),
    ("model", pa.string()),
    ("run_id", pa.string()),
    # beyond DESIGN.md's contract: what makes a row current, and its cost
    ("source_sha256", pa.string()),
    ("task_hash", pa.string()),
    ("prompt_tokens", pa.int32()),
    ("output_tokens", pa.int32()),
    ("finished_at", pa.timestamp("us", tz="UTC")),
    ("attempt", pa.int32()),  # this row's try at its key: 1, 2, ... (failures.py)
    ("error_kind", pa.string()),  # 'transient' (retried by the next run) or 'permanent'
    ("matched_path", pa.string()),  # the input as the job's glob matched it (`source`: absolute)
    ("finish_reason", pa.string()),  # vLLM's: 'stop', 'length' (max_tokens); null: none generated
    ("error_output", pa.string()),  # an answer kept as an error (schema:, degenerate output): its text
])

PAGE_SCHEMA = pa.schema([
    ("source", pa.string()),
    ("page", pa.int32()),
    ("width", pa.int32()),  # as the model sees it
    ("height", pa.int32()),
    ("text_layer", pa.string()),
    ("content_hash", pa.string()),
    ("phash", pa.string()),
    ("source_sha256", pa.string()),
    ("error", pa.string()),
    ("run_id", pa.string()),
    ("matched_path", pa.string()),
    ("renderer", pa.string()),  # mupdf, pdfium (MuPDF could not read the file), pillow
])

RESULT_KEY = ("source", "page", "task")
PAGE_KEY = ("source", "page")
FIELDS_KEY = ("source", "page", "task")
