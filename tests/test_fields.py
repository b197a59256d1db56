"""Schema tasks: the schema checked at load time, answers reviewed (schema, loops) and
generated once more, typed fields tables read back with polars and duckdb; through the real
vLLM CPU engine, the grammar enforced."""

from __future__ import annotations

import hashlib
import json
from datetime import date, datetime, timezone

import duckdb
import polars as pl
from deltalake import DeltaTable
import pytest

from conftest import job_fields, run_cli
from fakes import ScriptedEngine, fake_prompts
from vlbatch.engine.base import Completion, Request
from vlbatch.engine.loop import EngineLoop
from vlbatch.errors import JobFileError
from vlbatch.job import Task, load_job
from vlbatch.pipeline.answers import DEGENERATE, repeating_tail, review, schema_problem
from vlbatch.run import run_job

INVOICE_FIELDS = {"vendor": "string", "total": "number", "date": "date", "paid": "boolean",
                  "lines": "list[string]", "address": {"city": "string", "zip": "integer?"},
                  "sent_at": "datetime?", "currency": ["EUR", "USD"]}
INVOICE = {"vendor": "ACME GmbH", "total": 1234.5, "date": "2026-11-30", "paid": True,
           "lines": ["bolts", "nuts"], "address": {"city": "Köln", "zip": 50667},
           "sent_at": "2026-12-01T08:30:00+01:00", "currency": "EUR"}


def run(job_path, engine, **kwargs):
    return run_job(load_job(job_path, **{k: kwargs.pop(k) for k in ("output", "cache")
                                          if k in kwargs}),
                   engine_factory=lambda job, prompts: engine, prompts_factory=fake_prompts,
                   **kwargs)


# ----- the job file -----
def test_compact_fields_become_a_json_schema_and_a_schema_file_is_read_beside_the_job(
        tmp_path, write_job):
    task = Task(name="invoice", prompt="Extract.", fields=INVOICE_FIELDS)
    schema = task.answer_schema
    assert schema["required"] == list(INVOICE_FIELDS) and schema["additionalProperties"] is False
    assert schema["properties"]["date"] == {"type": "string", "format": "date"}
    assert schema["properties"]["address"]["properties"]["zip"] == {
        "anyOf": [{"type": "integer"}, {"type": "null"}]}
    assert schema["properties"]["currency"] == {"type": "string", "enum": ["EUR", "USD"]}
    # as plain data (Ray's actors get the job so) it comes back the same, and hashes alike
    again = Task.model_validate(task.model_dump(by_alias=True))
    assert again == task and hash(again) == hash(task)

    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "invoice.schema.json").write_text(json.dumps(schema))
    path = jobs / "job.yaml"
    path.write_text(json.dumps(job_fields("m", ["x/*"], tasks=[
        {"name": "invoice", "prompt": "Extract.", "schema": "invoice.schema.json"}])))
    loaded = load_job(path)  # relative to the job file's folder, not the current one
    assert loaded.tasks[0].answer_schema == schema
    assert loaded.tasks[0].fingerprint() != Task(name="invoice", prompt="Extract.").fingerprint()


@pytest.mark.parametrize("task, says", [
    ({"fields": {"total": "float"}}, "field 'tasks.0.fields': field 'total': unknown type 'float'"),
    ({"fields": {"page": "integer"}}, "field 'page' is named like a key column"),
    ({"schema": {"type": "array", "items": {"type": "string"}}}, "field 'tasks.0.schema': the top "
     "level must be an object"),
    ({"schema": {"type": "object", "properties": {"a": {"type": "strng"}}}},
     "not a valid JSON Schema at properties.a.type"),
    ({"schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}}},
     "field 'a': unsupported schema"),
    ({"schema": "missing.json"}, "cannot read schema file"),
    ({"schema": {"type": "object", "properties": {"a": {"type": "string"}}},
      "fields": {"b": "string"}}, "give `schema` or `fields`, not both"),
])
def test_a_bad_schema_is_refused_at_load_naming_the_file_and_field(write_job, task, says):
    path = write_job(job_fields("m", ["x/*"], tasks=[{"name": "t", "prompt": "p", **task}]))
    with pytest.raises(JobFileError) as raised:
        load_job(path)
    assert str(path) in str(raised.value) and says in str(raised.value), str(raised.value)


def test_a_bad_schema_exits_2_before_anything_runs(write_job, tmp_path):
    path = write_job(job_fields("m", ["x/*"], tasks=[
        {"name": "t", "prompt": "p", "fields": {"when": "timestamp"}}]))
    result = run_cli("run", str(path))
    assert result.returncode == 2 and "tasks.0.fields" in result.stderr and "when" in result.stderr
    assert not (tmp_path / "out").exists()


def test_tasks_without_a_schema_keep_their_fingerprint():
    """Adding the schema settings must not make every existing output stale."""
    task = Task(name="t", prompt="Describe.", max_tokens=12, seed=3)
    before = {"prompt": "Describe.", "max_tokens": 12, "temperature": 0.0, "top_p": 1.0,
              "seed": 3, "ignore_eos": False}  # the fields a task had before schemas
    old = hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    assert task.fingerprint() == old
    assert Task(name="t", prompt="Describe.", max_tokens=12, seed=3,
                retry_repetition_penalty=1.5).fingerprint() != old


# ----- reviewing answers -----
def test_repeating_tails():
    assert repeating_tail("Total: " + "5" * 70)
    assert repeating_tail("intro " + "| a | b |\n" * 12)
    assert repeating_tail("{" + "\t" * 100)
    assert not repeating_tail("5" * 40)  # too short to tell
    assert not repeating_tail("The quick brown fox jumps over the lazy dog. " * 1
                              + "Pack my box with five dozen liquor jugs, then stop.")


def test_schema_answers_are_reviewed():
    task = Task(name="t", prompt="p", fields=INVOICE_FIELDS, max_tokens=50)
    assert schema_problem(task, json.dumps(INVOICE), "stop") is None
    assert schema_problem(task, '{"vendor": "A', "length") == \
        "schema: answer cut at max_tokens (50)"
    assert schema_problem(task, "not json", "stop").startswith("schema: not JSON")
    missing = schema_problem(task, json.dumps({k: v for k, v in INVOICE.items() if k != "paid"}),
                             "stop")
    assert missing.startswith("schema: ") and "'paid' is a required property" in missing
    wrong = schema_problem(task, json.dumps({**INVOICE, "total": "12"}), "stop")
    assert wrong.startswith("schema: field 'total': ")
    bad_date = schema_problem(task, json.dumps({**INVOICE, "date": "2026-02-30"}), "stop")
    assert bad_date.startswith("schema: field 'date'"), bad_date
    request = Request("r", None, "p", Task(name="free", prompt="p"))
    assert review(request, Completion("r", "la " * 40, finish_reason="length")) == DEGENERATE
    assert review(request, Completion("r", "la " * 40, finish_reason="stop")) is None
    forced = Request("r", None, "p", Task(name="bench", prompt="p", ignore_eos=True))
    assert review(forced, Completion("r", "la " * 40, finish_reason="length")) is None


def test_the_engine_loop_generates_a_failed_answer_once_more_with_the_retry_settings():
    answers = {"good": ["5" * 80, "fine now"], "bad": ["5" * 80, "6" * 80]}
    engine = ScriptedEngine(lambda r: (answers[r.text].pop(0), "length"))
    loop = EngineLoop(engine, review=review)
    task = Task(name="free", prompt="p", max_tokens=80)
    good = loop.submit(Request("a", None, "good", task)).result(timeout=10)
    bad = loop.submit(Request("b", None, "bad", task)).result(timeout=10)
    loop.close()
    assert [(r.request_id, r.retry) for r in engine.requests] == [
        ("a", False), ("a#retry", True), ("b", False), ("b#retry", True)]
    assert (good.text, good.error, good.tries) == ("fine now", None, 2)
    assert (bad.text, bad.error, bad.tries, bad.error_output) == (None, DEGENERATE, 2, "6" * 80)


def test_a_retry_the_engine_held_when_it_died_goes_to_the_new_engine():
    died = []

    def answer(request):
        if request.retry and not died:
            died.append(request.request_id)
            raise RuntimeError("engine core died")
        return ("fine now", "stop") if request.retry else ("5" * 80, "length")

    engine = ScriptedEngine(answer)
    loop = EngineLoop(engine, review=review, restart=lambda: engine)
    done = loop.submit(Request("a", None, "p", Task(name="free", prompt="p"))).result(timeout=10)
    loop.close()
    assert died == ["a#retry"] and loop.restarts == 1
    assert (done.request_id, done.text, done.tries) == ("a", "fine now", 2)


# ----- typed fields, end to end with a scripted engine -----
def invoice_job(samples, write_job, **overrides):
    return write_job(job_fields("fake-model", [f"{samples}/*"], tasks=[
        {"name": "invoice", "prompt": "Extract the invoice.", "fields": INVOICE_FIELDS},
        {"name": "notes", "prompt": "Anything else?"}], **overrides))


def test_typed_fields_are_written_and_read_back_with_their_types(samples, write_job, tmp_path):
    job = invoice_job(samples, write_job)
    engine = ScriptedEngine(lambda r: (json.dumps(INVOICE) if r.task.name == "invoice"
                                       else "nothing", "stop"))
    stats = run(job, engine)
    assert stats.fields_rows == 7 and stats.rows_ok == 14
    fields = pl.read_delta(str(tmp_path / "out" / "fields" / "invoice"))
    assert fields.schema == pl.Schema({
        "source": pl.String, "page": pl.Int32, "task": pl.String, "run_id": pl.String,
        "finished_at": pl.Datetime("us", "UTC"), "content_hash": pl.String,
        "vendor": pl.String, "total": pl.Float64, "date": pl.Date, "paid": pl.Boolean,
        "lines": pl.List(pl.String),
        "address": pl.Struct({"city": pl.String, "zip": pl.Int64}),
        "sent_at": pl.Datetime("us", "UTC"), "currency": pl.String})
    row = fields.row(0, named=True)
    assert row["date"] == date(2026, 11, 30) and row["total"] == 1234.5 and row["paid"] is True
    assert row["address"] == {"city": "Köln", "zip": 50667} and row["lines"] == ["bolts", "nuts"]
    assert row["sent_at"] == datetime(2026, 12, 1, 7, 30, tzinfo=timezone.utc)
    results = pl.read_delta(str(tmp_path / "out" / "results"))
    assert json.loads(results.filter(pl.col("task") == "invoice")["output"][0]) == INVOICE
    assert (results["finish_reason"] == "stop").all()
    # the page's rows and the fields rows name the same pages
    keys = results.filter(pl.col("task") == "invoice").select("source", "page", "content_hash")
    assert keys.sort("source", "page").equals(
        fields.select("source", "page", "content_hash").sort("source", "page"))

    invoice = DeltaTable(str(tmp_path / "out" / "fields" / "invoice")).to_pyarrow_dataset()  # noqa: F841
    types = {r[0]: r[1] for r in duckdb.sql("DESCRIBE SELECT * FROM invoice").fetchall()}
    assert (types["total"], types["date"], types["paid"], types["lines"]) == \
        ("DOUBLE", "DATE", "BOOLEAN", "VARCHAR[]")
    assert types["address"] == "STRUCT(city VARCHAR, zip BIGINT)"
    assert types["sent_at"] == "TIMESTAMP WITH TIME ZONE"
    total = duckdb.sql("SELECT sum(total) FROM invoice WHERE paid").fetchall()[0][0]
    assert total == pytest.approx(7 * 1234.5)

    from vlbatch.output.inspect import inspect_output

    [table] = inspect_output(tmp_path / "out")["fields"]
    assert table["task"] == "invoice" and table["rows"] == 7
    assert (table["columns"]["total"], table["columns"]["date"]) == ("double", "date32[day]")

    stats = run(job, engine)  # an identical re-run writes nothing
    assert stats.fields_rows == 0
    assert DeltaTable(str(tmp_path / "out" / "fields" / "invoice")).version() == 0
    other = tmp_path / "out2"  # from the cache into a new output: typed rows there too
    stats = run(job, engine, output=str(other))
    assert stats.cache_hits > 0 and stats.fields_rows == 7
    assert pl.read_delta(str(other / "fields" / "invoice")).height == 7


def test_answers_that_fail_twice_are_error_rows_with_their_text(samples, write_job, tmp_path):
    job = invoice_job(samples, write_job)
    bad = json.dumps({**INVOICE, "total": "lots"})
    engine = ScriptedEngine(lambda r: (bad, "stop") if r.task.name == "invoice"
                            else ("ha" * 60, "length"))
    stats = run(job, engine)
    # 6 distinct pages x 2 tasks, each generated twice
    assert len(engine.requests) == 24 and sum(r.retry for r in engine.requests) == 12
    assert stats.retried == 12 and stats.bad_answers == 12 and stats.rows_error == 14
    results = pl.read_delta(str(tmp_path / "out" / "results"))
    invoice = results.filter(pl.col("task") == "invoice")
    assert invoice["error"].str.starts_with("schema: field 'total'").all()
    assert (invoice["error_output"] == bad).all()
    notes = results.filter(pl.col("task") == "notes")
    assert (notes["error"] == DEGENERATE).all() and (notes["finish_reason"] == "length").all()
    assert (notes["error_output"] == "ha" * 60).all() and notes["output"].is_null().all()
    assert (results["attempt"] == 2).all() and (results["error_kind"] == "permanent").all()
    assert not list((tmp_path / "out" / "fields" / "invoice").glob("*.parquet"))

    stats = run(job, engine)  # permanent: the next run leaves them
    assert stats.requests_total == 0
    fixed = ScriptedEngine(lambda r: (json.dumps(INVOICE), "stop") if r.task.name == "invoice"
                           else ("short", "stop"))
    stats = run(job, fixed, retry_errors=True)  # --retry-errors: once the model behaves
    assert stats.rows_ok == 14 and stats.fields_rows == 7
    current = (pl.read_delta(str(tmp_path / "out" / "results")).sort("finished_at")
               .group_by("source", "page", "task").last())
    assert (current["status"] == "ok").all() and (current["attempt"] == 3).all()


# ----- the real engine -----
def test_the_real_engine_enforces_the_grammar(tiny_model, samples, write_job, tmp_path):
    """The tiny random model: booleans and an enum give valid JSON in a few tokens; a free
    number loops to max_tokens (a schema: error row); free text loops too (degenerate
    output, after a retry with the repetition penalty)."""
    job = write_job(job_fields(tiny_model, [f"{samples}/*"], tasks=[
        {"name": "flags", "prompt": "Is it paid? What is it?", "max_tokens": 40,
         "fields": {"paid": "boolean", "kind": ["invoice", "receipt", "other"]}},
        {"name": "amount", "prompt": "The total.", "max_tokens": 12,
         "fields": {"total": "number"}},
        {"name": "text", "prompt": "Transcribe this page.", "max_tokens": 80}]))
    result = run_cli("run", str(job))
    assert result.returncode == 0, result.stderr[-3000:]
    results = pl.read_delta(str(tmp_path / "out" / "results"))
    assert results.height == 21
    flags = results.filter(pl.col("task") == "flags")
    assert (flags["status"] == "ok").all() and (flags["finish_reason"] == "stop").all()
    for text in flags["output"]:
        answer = json.loads(text)
        assert set(answer) == {"paid", "kind"} and isinstance(answer["paid"], bool)
        assert answer["kind"] in ("invoice", "receipt", "other")
    assert (flags["output_tokens"] < 40).all()
    typed = pl.read_delta(str(tmp_path / "out" / "fields" / "flags"))
    assert typed.height == 7 and typed.schema["paid"] == pl.Boolean
    assert typed.schema["kind"] == pl.String
    flags_table = DeltaTable(str(tmp_path / "out" / "fields" / "flags")).to_pyarrow_dataset()  # noqa: F841
    assert duckdb.sql("SELECT typeof(paid) FROM flags_table LIMIT 1").fetchall()[0][0] == "BOOLEAN"

    amount = results.filter(pl.col("task") == "amount")
    assert amount["error"].str.starts_with("schema: answer cut at max_tokens").all()
    assert amount["error_output"].str.starts_with('{"total":').all()
    assert not (tmp_path / "out" / "fields" / "amount").exists()
    text = results.filter(pl.col("task") == "text")
    assert (text["error"] == DEGENERATE).all() and (text["attempt"] == 2).all()
    assert text["error_output"].map_elements(repeating_tail, return_dtype=pl.Boolean).all()


def test_input_threads_pass_the_retry_settings(tiny_model):
    """The repetition penalty reaches vLLM on a retry (the parameters the engine adds)."""
    from vlbatch.engine.vllm_engine import VllmEngine

    job = load_job_from(tiny_model)
    engine = object.__new__(VllmEngine)
    engine._params, engine.job = {}, job
    task = job.tasks[0]
    first, retry = engine.sampling_params(task), engine.sampling_params(task, retry=True)
    assert first.repetition_penalty == 1.0 and retry.repetition_penalty == 1.3
    assert first.structured_outputs.json == task.answer_schema


def load_job_from(model):
    from vlbatch.job import Job

    return Job.model_validate(job_fields(model, ["x/*"], tasks=[
        {"name": "flags", "prompt": "p", "fields": {"paid": "boolean"},
         "retry_repetition_penalty": 1.3}]))


def test_the_readme_queries_over_a_fields_table(samples, write_job, tmp_path):
    """The README's polars and duckdb snippets ("Typed fields"), run on a real output."""
    from conftest import ROOT

    job = invoice_job(samples, write_job)
    totals = iter(range(100))

    def answer(request):
        n = next(totals)
        return json.dumps({**INVOICE, "vendor": f"V{n % 2}", "total": float(n),
                           "paid": n % 3 == 0, "date": "2026-11-0%d" % (1 + n % 9)}), "stop"

    run(job, ScriptedEngine(answer))
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Typed fields"):readme.index("## Compacting the tables")]
    blocks = [b.split("```", 1)[0] for b in section.split("```python\n")[1:]]
    assert len(blocks) == 3
    scope: dict = {}
    for block in blocks:
        exec(block.replace("out/invoices", str(tmp_path / "out")), scope)
    fields = pl.read_delta(str(tmp_path / "out" / "fields" / "invoice"))
    unpaid = fields.filter(pl.col("paid").not_())
    assert scope["invoices"].height == unpaid.height > 0
    assert scope["invoices"].schema["date"] == pl.Date
    by_vendor = dict(scope["unpaid_by_vendor"].iter_rows())
    assert by_vendor == dict(unpaid.group_by("vendor").agg(pl.col("total").sum()).iter_rows())
    assert dict(zip(scope["unpaid"]["vendor"], scope["unpaid"]["unpaid"])) == by_vendor
    assert scope["failed"].height == 0


def test_the_example_invoice_job_is_valid():
    from conftest import ROOT

    job = load_job(ROOT / "jobs" / "invoices.yaml")
    schema = job.tasks[0].answer_schema
    assert {"vendor", "total", "date", "paid"} <= set(schema["required"])
    assert job.tasks[1].answer_schema is None


@pytest.mark.parametrize("sent_at, kept", [
    ("2026-12-01T08:30:00+01:00", datetime(2026, 12, 1, 7, 30, tzinfo=timezone.utc)),
    ("2026-12-01t07:30:00.250z", datetime(2026, 12, 1, 7, 30, 0, 250000, tzinfo=timezone.utc)),
    ("2026-12-01T07:30:00", None),  # no zone: which instant is unknown
    ("2026-12-01", None),  # a date is not a date-time
    ("20261201T073000Z", None),  # ISO 8601's basic form is not RFC 3339
    ("1 Dec 2026, 7:30", None),
])
def test_date_time_fields_are_rfc_3339_with_a_zone(samples, write_job, tmp_path, sent_at, kept):
    """A `datetime` field takes RFC 3339 date-times with a zone (Z or +HH:MM), whatever
    jsonschema's optional format checkers are installed; anything else is a schema error
    with the text kept, never a guess taken as UTC."""
    job = invoice_job(samples, write_job)
    run(job, ScriptedEngine(lambda r: (json.dumps({**INVOICE, "sent_at": sent_at})
                                       if r.task.name == "invoice" else "none", "stop")))
    results = pl.read_delta(str(tmp_path / "out" / "results")).filter(pl.col("task") == "invoice")
    fields = tmp_path / "out" / "fields" / "invoice"
    if kept is not None:
        assert (results["status"] == "ok").all()
        assert set(pl.read_delta(str(fields))["sent_at"].to_list()) == {kept}
        return
    assert (results["status"] == "error").all()
    assert results["error"].str.contains("sent_at").all(), results["error"][0]
    assert results["error"].str.starts_with("schema:").all()
    assert (results["error_output"].str.contains(sent_at, literal=True)).all()
    assert not fields.exists()
