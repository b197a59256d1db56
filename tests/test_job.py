"""The job file: validation at load time, clear messages, exit code 2, prompt placeholders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlbatch.cli import app
from vlbatch.errors import JobFileError
from vlbatch.job import Task, load_job

VALID = """
name: t
inputs: ["docs/*.pdf"]
output: out
model: some/model
tasks:
  - name: md
    prompt: "Convert."
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_valid_job_paths_are_relative_to_the_job_file(tmp_path):
    job = load_job(write(tmp_path, VALID))
    assert job.output == (tmp_path / "out").resolve()
    assert job.cache == (tmp_path / ".vlbatch-cache").resolve()
    assert job.tasks[0].max_tokens == 1024 and job.render.dpi == 150
    assert job.render.max_pixels == 1280 * 32 * 32


def test_cli_overrides_are_relative_to_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = load_job(write(tmp_path, VALID), output="elsewhere", cache="c2")
    assert job.output == tmp_path / "elsewhere" and job.cache == tmp_path / "c2"


@pytest.mark.parametrize("text, expected", [
    (VALID + "colour: red\n", "unknown field 'colour'"),
    (VALID.replace("model: some/model\n", ""), "missing required field 'model'"),
    (VALID + "max_error_rate: lots\n", "field 'max_error_rate'"),
    (VALID.replace('prompt: "Convert."', 'prompt: "Convert."\n    max_tokens: -3'),
     "field 'tasks.0.max_tokens'"),
    (VALID + "  - name: md\n    prompt: again\n", "task names must be unique"),
    (VALID + "render:\n  min_pixels: 900000\n  max_pixels: 300000\n", "min_pixels must not exceed"),
    ("name: [unclosed\n", "invalid YAML (line"),
    ("- just\n- a list\n", "must be a mapping"),
    (VALID + "engine:\n  gpu_memory_util: 0.5\n", "unknown field 'engine.gpu_memory_util'"),
])
def test_invalid_job_names_file_and_field(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(JobFileError) as info:
        load_job(path)
    assert str(path) in str(info.value) and expected in str(info.value)


def test_cli_exit_code_2_one_line_no_traceback(tmp_path):
    path = write(tmp_path, VALID + "colour: red\n")
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2
    assert "unknown field 'colour'" in result.output and "Traceback" not in result.output


def test_cli_missing_job_file_and_bad_flag_exit_2(tmp_path):
    assert CliRunner().invoke(app, ["run", str(tmp_path / "nope.yaml")]).exit_code == 2
    assert CliRunner().invoke(app, ["run", "x.yaml", "--limit", "0"]).exit_code == 2
    bogus = CliRunner().invoke(app, ["run", "x.yaml", "--bogus"])
    assert bogus.exit_code == 2 and "Error: No such option: --bogus" in bogus.output
    assert "╭" not in bogus.output  # one plain line, not a box
    assert "<bool>" not in CliRunner().invoke(app, ["run", "--help"]).output


def test_prompt_placeholders_by_name_other_braces_literal():
    task = Task(name="t", prompt='Return {"a": 1, "b": [{}]} for {source} p{page}: {text_layer} {{other}}')
    out = task.render_prompt(text_layer="HELLO", source="x.pdf", page=3)
    assert out == 'Return {"a": 1, "b": [{}]} for x.pdf p3: HELLO {other}'


def test_an_unknown_placeholder_is_a_job_file_error(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: j\ninputs: ['*.pdf']\noutput: out\nmodel: m\n"
                   "tasks:\n  - name: summary\n    prompt: 'Summarise: {textlayer}'\n")
    result = CliRunner().invoke(app, ["run", str(job)])
    assert result.exit_code == 2
    assert "tasks.0.prompt" in result.output and "unknown placeholder {textlayer}" in result.output


def test_prompt_placeholders_in_one_pass_a_text_layer_is_not_rewritten():
    task = Task(name="t", prompt="{text_layer} / {source} p{page}")
    out = task.render_prompt(text_layer="Form {page} of {source}", source="a.pdf", page=2)
    assert out == "Form {page} of {source} / a.pdf p2"


def test_task_fingerprint_changes_with_prompt_and_sampling_not_name():
    base = Task(name="a", prompt="p")
    assert base.fingerprint() == Task(name="b", prompt="p").fingerprint()
    assert base.fingerprint() != Task(name="a", prompt="q").fingerprint()
    assert base.fingerprint() != Task(name="a", prompt="p", max_tokens=5).fingerprint()


def test_engine_settings_reach_vllm_arguments(tmp_path):
    from vlbatch.engine.vllm_engine import engine_kwargs

    text = VALID + ("engine:\n  max_num_seqs: 64\n  load_format: dummy\n  compile_mm_encoder: true\n"
                    "  cudagraph_mm_encoder: true\n  compile_cache_dir: vllm-cache\n"
                    "render:\n  max_pixels: 500000\n")
    job = load_job(write(tmp_path, text))
    kwargs = engine_kwargs(job)
    assert kwargs["max_num_seqs"] == 64 and kwargs["load_format"] == "dummy"
    assert "max_model_len" not in kwargs  # unset: vLLM's own default
    # unset: vLLM's own (0.92 in 0.26), not a lower share that leaves less KV cache
    assert "gpu_memory_utilization" not in kwargs
    assert kwargs["compilation_config"] == {"compile_mm_encoder": True, "cudagraph_mm_encoder": True}
    plain = load_job(write(tmp_path, VALID + "engine:\n  compile_mm_encoder: false\n"))
    assert "compilation_config" not in engine_kwargs(plain)
    share = load_job(write(tmp_path, VALID + "engine:\n  gpu_memory_utilization: 0.8\n"))
    assert engine_kwargs(share)["gpu_memory_utilization"] == 0.8
    assert kwargs["mm_processor_kwargs"]["size"]["longest_edge"] == 500000
    assert kwargs["limit_mm_per_prompt"] == {"image": 1, "video": 0}
    assert job.engine.compile_cache_dir == (tmp_path / "vllm-cache").resolve()


def test_an_fp8_kv_cache_reaches_vllm_and_keys_answers_apart(tmp_path):
    from vlbatch.engine.vllm_engine import engine_kwargs
    from vlbatch.pipeline.identity import model_identity

    plain = load_job(write(tmp_path, VALID))
    fp8 = load_job(write(tmp_path, VALID + "engine:\n  kv_cache_dtype: fp8\n"))
    assert "kv_cache_dtype" not in engine_kwargs(plain)  # unset: vLLM's own (the model's dtype)
    assert engine_kwargs(fp8)["kv_cache_dtype"] == "fp8"
    # an fp8 cache changes answers: they never share a result-cache key with bf16 ones
    assert model_identity(fp8) != model_identity(plain)
    with pytest.raises(JobFileError, match="kv_cache_dtype"):
        load_job(write(tmp_path, VALID + "engine:\n  kv_cache_dtype: int3\n"))


def test_a_model_folder_that_does_not_exist_is_said_before_anything_runs(tmp_path):
    from vlbatch.errors import JobCannotRunError
    from vlbatch.job import Job
    from vlbatch.run import run_job

    def job(model):
        return Job(name="t", inputs=["*.pdf"], output=tmp_path / "out", model=model,
                   tasks=[Task(name="t", prompt="p")], base_dir=tmp_path)

    assert job("Qwen/Qwen3-VL-8B-Instruct").missing_model_folder() is None  # a hub id
    (tmp_path / "models" / "x").mkdir(parents=True)
    assert job("models/x").missing_model_folder() is None
    assert "does not exist" in job("../models/x").missing_model_folder()
    with pytest.raises(JobCannotRunError, match="models/y/z does not exist"):
        run_job(job("models/y/z"))
    assert not (tmp_path / "out").exists()  # nothing probed, nothing written


def test_the_printed_json_schema_accepts_the_shipped_jobs_and_refuses_a_typo():
    """`vlbatch schema` is what editors check job files with: it must agree with the loader."""
    import jsonschema
    import yaml

    from conftest import ROOT, run_cli

    result = run_cli("schema")
    assert result.returncode == 0, result.stderr
    schema = json.loads(result.stdout)
    for name in ("demo.yaml", "invoices.yaml"):
        jsonschema.validate(yaml.safe_load((ROOT / "jobs" / name).read_text()), schema)
    job = yaml.safe_load((ROOT / "jobs" / "invoices.yaml").read_text())
    job["tasks"][0]["max_tokns"] = 5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(job, schema)
    assert "base_dir" not in schema["properties"]


def test_every_job_field_is_described_in_the_printed_schema():
    """Every field of every section (the job, tasks, render, engine, dedupe, ray) says what
    it does in `vlbatch schema`, which editors show as the field's help."""
    from conftest import run_cli

    schema = json.loads(run_cli("schema").stdout)
    sections = {"job": schema["properties"],
                **{name: d.get("properties", {}) for name, d in schema["$defs"].items()}}
    assert {"Task", "Render", "EngineSettings", "Dedupe", "RaySettings"} <= set(sections)
    bare = [f"{section}.{field}" for section, fields in sections.items()
            for field, spec in fields.items() if len(spec.get("description", "").strip()) < 10]
    assert not bare, f"fields without a description: {bare}"
    assert sum(len(fields) for fields in sections.values()) > 60
