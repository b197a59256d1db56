"""answers: what is wrong with an answer (`review`), and a schema task's answer as the typed
row of its `fields/<task>` table (`typed_fields`, `fields_schema`).

Two failures are caught as soon as the engine answers, and the request is generated once
more (engine/loop.py; the retry uses the task's `retry_repetition_penalty`):

    schema: ...        a schema task's answer was cut by max_tokens, is not JSON, does not
                       validate (jsonschema, formats checked), or a value does not fit its
                       typed column (a date that is no date, an integer beyond int64)
    degenerate output  an answer that ran into max_tokens with a repeating tail (OCR-style
                       models loop on a phrase, a table row, whitespace); not checked for
                       tasks with ignore_eos (they ask for max_tokens whatever comes)

If the retry fails too the row is an error row with that reason, its text in
`error_output`.
"""

from __future__ import annotations

import json
import re
from datetime import date, datetime, timezone
from functools import lru_cache

import pyarrow as pa

from vlbatch.answer_schema import KEY_COLUMNS, column_kind
from vlbatch.engine.base import Completion, Request
from vlbatch.job import Task

DEGENERATE = "degenerate output"
REPEAT_MIN_SPAN = 64  # chars of tail that must repeat ...
REPEAT_MAX_UNIT = 256  # ... a unit of at most this many chars ...
REPEAT_MIN_TIMES = 3  # ... at least this many times
INT64 = (-(2 ** 63), 2 ** 63 - 1)


class FieldProblem(ValueError):
    pass


def repeating_tail(text: str) -> bool:
    """Whether the text ends in one unit (up to 256 chars) repeated over the last
    max(64, 3 units) chars: '5555...', 'the table the table ...', tabs."""
    for unit in range(1, REPEAT_MAX_UNIT + 1):
        span = max(REPEAT_MIN_SPAN, REPEAT_MIN_TIMES * unit)
        if span > len(text):
            return False
        tail = text[-span:]
        if tail[unit:] == tail[:-unit]:
            return True
    return False


def review(request: Request, done: Completion) -> str | None:
    """The reason an answer is not to be kept as it is, or None (engine errors pass)."""
    if done.error is not None or done.text is None:
        return None
    if request.task.answer_schema is not None:
        return schema_problem(request.task, done.text, done.finish_reason)
    # ignore_eos asks for max_tokens whatever comes (benchmarks): a loop is no failure there
    if done.finish_reason == "length" and not request.task.ignore_eos and repeating_tail(done.text):
        return DEGENERATE
    return None


def schema_problem(task: Task, text: str, finish_reason: str | None) -> str | None:
    return checked_fields(task, text, finish_reason)[1]


def checked_fields(task: Task, text: str,
                   finish_reason: str | None) -> tuple[dict | None, str | None]:
    """A schema task's answer as its typed values, or why it has none (a `schema:` reason)."""
    if finish_reason == "length":
        looped = ", its tail repeating" if repeating_tail(text) else ""
        return None, f"schema: answer cut at max_tokens ({task.max_tokens}){looped}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"schema: not JSON ({e})"
    error = _best_error(_validator(task), value)
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path)
        return None, f"schema: {'field ' + repr(where) + ': ' if where else ''}{error.message}"[:500]
    try:
        return typed_fields(task, value), None
    except FieldProblem as e:
        return None, f"schema: {e}"


def _best_error(validator, value):
    from jsonschema.exceptions import best_match

    return best_match(validator.iter_errors(value))


# JSON Schema's `date` and `date-time` formats are RFC 3339's full-date and date-time:
# checked here whatever jsonschema's optional format checkers are installed
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
DATE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


@lru_cache(maxsize=64)
def _validator(task: Task):
    from jsonschema import Draft202012Validator

    return Draft202012Validator(task.answer_schema,
                                format_checker=Draft202012Validator.FORMAT_CHECKER)


@lru_cache(maxsize=64)
def _kinds(task: Task) -> tuple:
    return column_kind(task.answer_schema, "(top level)")[1]


def typed_fields(task: Task, value: dict) -> dict:
    """A validated answer as the fields table's values, by column (FieldProblem if one
    does not fit)."""
    return {name: _typed(value.get(name), kind, name) for name, kind in _kinds(task)}


def _typed(value, kind: tuple, path: str):
    if value is None:
        return None
    name = kind[0]
    try:
        if name == "string":
            return str(value)
        if name == "integer":
            if not INT64[0] <= int(value) <= INT64[1]:
                raise FieldProblem(f"field '{path}': {value} is beyond int64")
            return int(value)
        if name == "number":
            return float(value)
        if name == "boolean":
            return bool(value)
        if name == "date":
            if not isinstance(value, str) or not DATE.fullmatch(value):
                raise ValueError("a date is YYYY-MM-DD")
            return date.fromisoformat(value)
        if name == "datetime":
            if not isinstance(value, str) or not DATE_TIME.fullmatch(value):
                raise ValueError("a date-time is RFC 3339: YYYY-MM-DDTHH:MM:SS[.fraction] "
                                 "and a zone, Z or +HH:MM")
            return datetime.fromisoformat(value.upper().replace("Z", "+00:00")) \
                .astimezone(timezone.utc)
        if name == "list":
            return [_typed(item, kind[1], f"{path}[]") for item in value]
        if name == "object":
            return {sub: _typed(value.get(sub), sub_kind, f"{path}.{sub}")
                    for sub, sub_kind in kind[1]}
    except (TypeError, ValueError, AttributeError) as e:
        if isinstance(e, FieldProblem):
            raise
        raise FieldProblem(f"field '{path}': {value!r:.80} is not a {name} ({e})") from None
    raise FieldProblem(f"field '{path}': unknown kind {name}")


_ARROW = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(),
          "boolean": pa.bool_(), "date": pa.date32(), "datetime": pa.timestamp("us", tz="UTC")}
FIELDS_KEY_SCHEMA = pa.schema([
    ("source", pa.string()), ("page", pa.int32()), ("task", pa.string()),
    ("run_id", pa.string()), ("finished_at", pa.timestamp("us", tz="UTC")),
    ("content_hash", pa.string()),
])
assert tuple(FIELDS_KEY_SCHEMA.names) == KEY_COLUMNS


def arrow_type(kind: tuple) -> pa.DataType:
    if kind[0] == "list":
        return pa.list_(arrow_type(kind[1]))
    if kind[0] == "object":
        return pa.struct([(name, arrow_type(sub)) for name, sub in kind[1]])
    return _ARROW[kind[0]]


@lru_cache(maxsize=64)
def fields_schema(task: Task) -> pa.Schema:
    """The fields table of a schema task: the key columns, then one column per field."""
    return pa.schema([*FIELDS_KEY_SCHEMA, *((name, arrow_type(kind)) for name, kind in _kinds(task))])
