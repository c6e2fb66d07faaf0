"""`batchgen run` / `batchgen validate` end to end on JSONL files, through
click's CliRunner, on a tiny real model."""

import json
import sys
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.config import CPU_PLD_MAX_LOOKUP

SYSTEM = "You are a helpful assistant. Answer briefly and exactly."


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import tiny

    return str(tiny.build_model("qwen2", tmp_path_factory.mktemp("cli-qwen2")))


def write_jobs(path: Path, lines) -> Path:
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def good_jobs(n=4):
    header = {"batchgen": {"system": SYSTEM, "defaults": {"max_tokens": 6}}}
    jobs = [{"id": f"j{i}", "messages": [{"role": "user", "content": f"task {i}"}], "metadata": {"i": i}} for i in range(n)]
    return [header] + jobs


def invoke(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def read_lines(path: Path):
    return [orjson.loads(l) for l in path.read_text().splitlines()]


def test_run_writes_one_line_per_job_and_summary(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs())
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--summary", str(summary), "--no-fuse", "--draft", "pld")
    assert r.exit_code == 0, r.stderr
    lines = read_lines(out)
    assert [l["id"] for l in lines] == ["j0", "j1", "j2", "j3"]
    for i, l in enumerate(lines):
        assert set(l) == {"id", "text", "finish_reason", "usage", "stats", "metadata", "error"}
        assert l["error"] is None and l["metadata"] == {"i": i} and isinstance(l["text"], str)
        assert l["finish_reason"] == "length" and l["usage"]["completion_tokens"] == 6
        assert set(l["usage"]) == {"prompt_tokens", "completion_tokens", "cached_tokens"}
        for key in ("prefill_s", "decode_s", "prompt_tps", "decode_tps", "cache_hit_ratio", "draft",
                    "pld_drafted", "pld_accepted", "kv_cache", "kv_bytes", "peak_memory_gb"):  # fmt: skip
            assert key in l["stats"]
    s = json.loads(summary.read_text())
    assert s["jobs"] == {"total": 4, "ok": 4, "failed": 0, "skipped": 0, "skipped_failed": 0}
    assert s["tokens"]["completion"] == 24 and s["tokens"]["prompt"] == sum(l["usage"]["prompt_tokens"] for l in lines)
    for key in ("wall_s", "load_s", "decode_tps", "peak_memory_gb", "model_memory_gb", "device", "fusion", "prewarm", "draft", "kv_cache"):
        assert key in s
    assert set(s["fusion"]) >= {"qkv", "gate_up", "experts", "skipped", "bytes_freed"}
    assert set(s["prewarm"]) == {"tokens", "seconds"} and s["prewarm"]["tokens"] > 0
    parts = s["load_parts"]  # where loading went, in order; together (rounded) the load
    assert list(parts) == ["import", "device", "read", "transforms"] and min(parts.values()) >= 0
    assert sum(parts.values()) == pytest.approx(s["load_s"], abs=0.01)
    assert f"load {s['load_s']}s (import {parts['import']:.1f}, device {parts['device']:.1f}," in r.stderr
    assert "jobs: 4 total, 4 ok, 0 failed, 0 skipped" in r.stderr
    assert f"prompt-lookup decoding ENABLED pld_max_lookup={CPU_PLD_MAX_LOOKUP} pld_ngram_size=3" in r.stderr  # the CPU's default


def test_bad_lines_get_error_lines_and_exit_1(tmp_path, model):
    lines = good_jobs(2) + [
        "{broken json",
        '"a string"',
        {"id": "typo", "prompt": "x", "temprature": 0.2},
        {"id": "neg", "prompt": "x", "max_tokens": -3},
        {"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        {"id": "role", "messages": [{"role": "wizard", "content": "y"}]},
        {"id": "empty", "messages": []},
        {"id": "type", "prompt": "x", "top_k": "ten"},
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    out = tmp_path / "out.jsonl"
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse")
    assert r.exit_code == 1
    got = {l["id"]: l for l in read_lines(out)}
    assert got["j0"]["error"] is None and got["j1"]["error"] is None
    expected = {"4": ("invalid_json", 4), "5": ("invalid_job", 5), "typo": ("unknown_key", 6),
                "neg": ("invalid_value", 7), "both": ("invalid_job", 8), "role": ("invalid_job", 9),
                "empty": ("invalid_job", 10), "type": ("invalid_value", 11)}  # fmt: skip
    for job_id, (kind, line) in expected.items():
        e = got[job_id]["error"]
        assert (e["type"], e["line"]) == (kind, line), job_id
        assert "text" not in got[job_id]
    assert "jobs: 10 total, 2 ok, 8 failed, 0 skipped" in r.stderr


@pytest.mark.parametrize(
    "lines, words",
    [
        ([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], "duplicate job id 'a' on lines 1 and 2"),
        ([{"batchgen": {"system": 3}}, {"prompt": "x"}], "'system' must be a string"),
    ],
)
def test_unusable_file_exits_2_without_output(tmp_path, model, lines, words):
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    out = tmp_path / "out.jsonl"
    r = invoke("run", str(jobs), "--model", model, "-o", str(out))
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == [f"batchgen: error: {r.stderr.split('error: ', 1)[1].strip()}"]
    assert words in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_missing_model_and_missing_file_exit_2(tmp_path):
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(1))
    out = tmp_path / "out.jsonl"
    r = invoke("run", str(jobs), "--model", str(tmp_path / "no-such-model"), "-o", str(out))
    assert r.exit_code == 2 and "model not found" in r.stderr and not out.exists()
    assert len(r.stderr.strip().splitlines()) == 1
    r = invoke("run", str(tmp_path / "nope.jsonl"), "-o", str(out))
    assert r.exit_code == 2 and "cannot read job file" in r.stderr and not out.exists()


def test_broken_model_dir_exits_2(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(1))
    r = invoke("run", str(jobs), "--model", str(tmp_path / "m"), "-o", str(tmp_path / "o.jsonl"))
    assert r.exit_code == 2 and "cannot load model" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("opts", [["--kv-bits", "9"], ["--draft", "eagle"], ["--max-tokens", "0"], ["--prompt-cache-bytes", "lots"]])
def test_bad_options_exit_2(tmp_path, opts):
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(1))
    r = invoke("run", str(jobs), "-o", str(tmp_path / "o.jsonl"), *opts)
    assert r.exit_code == 2 and not (tmp_path / "o.jsonl").exists()


def test_resume_repairs_torn_line_and_skips_done(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(4))
    out = tmp_path / "out.jsonl"
    assert invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse").exit_code == 0
    full = read_lines(out)
    # A crash while writing the third line: two complete lines and half of one.
    raw = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(raw[:2]) + raw[2][: len(raw[2]) // 2])
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse")
    assert r.exit_code == 0, r.stderr
    again = read_lines(out)
    assert [l["id"] for l in again] == ["j0", "j1", "j2", "j3"]
    assert [l["text"] for l in again] == [l["text"] for l in full]
    assert "2 skipped" in r.stderr and "repaired a torn last line" in r.stderr
    # Everything done: a third run writes nothing new.
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse")
    assert r.exit_code == 0 and len(read_lines(out)) == 4 and "4 skipped" in r.stderr


def test_resume_refuses_a_foreign_output_file(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(1))
    out = tmp_path / "out.jsonl"
    out.write_text("hello\nworld\n")
    r = invoke("run", str(jobs), "--model", model, "-o", str(out))
    assert r.exit_code == 2 and "line 1 is not a batchgen result line" in r.stderr
    assert out.read_text() == "hello\nworld\n"


def test_interrupted_run_keeps_finished_lines_and_resumes(tmp_path, model, monkeypatch):
    from batchgen.engine.core import Engine

    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(4))
    out = tmp_path / "out.jsonl"
    real_run, calls = Engine.run, []

    def run_then_interrupt(self, job):
        calls.append(job.id)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_run(self, job)

    monkeypatch.setattr(Engine, "run", run_then_interrupt)
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse")
    assert r.exit_code == 130 and "interrupted after 2 jobs" in r.stderr
    assert [l["id"] for l in read_lines(out)] == ["j0", "j1"]
    monkeypatch.setattr(Engine, "run", real_run)
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse")
    assert r.exit_code == 0 and [l["id"] for l in read_lines(out)] == ["j0", "j1", "j2", "j3"]


def test_retry_failed_reruns_error_lines_once(tmp_path, model):
    jobs = tmp_path / "jobs.jsonl"
    write_jobs(jobs, good_jobs(2) + [{"id": "bad", "prompt": "x", "max_tokens": 0}])
    out = tmp_path / "out.jsonl"
    assert invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse").exit_code == 1
    write_jobs(jobs, good_jobs(2) + [{"id": "bad", "prompt": "x", "max_tokens": 3}])
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse", "--retry-failed")
    assert r.exit_code == 0, r.stderr
    lines = read_lines(out)
    assert [l["id"] for l in lines] == ["j0", "j1", "bad"] and lines[-1]["error"] is None


def test_stdin_to_stdout(tmp_path, model):
    text = "".join(json.dumps(l) + "\n" for l in good_jobs(2))
    r = invoke("run", "-", "--model", model, "-o", "-", "--no-fuse", input=text)
    assert r.exit_code == 0, r.stderr
    lines = [orjson.loads(l) for l in r.stdout.splitlines()]
    assert [l["id"] for l in lines] == ["j0", "j1"]
    assert "jobs: 2 total" in r.stderr and "jobs:" not in r.stdout


def test_default_output_path_is_outputs_stem(tmp_path, model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jobs(tmp_path / "nightly.jsonl", good_jobs(1))
    assert invoke("run", "nightly.jsonl", "--model", model, "--no-fuse", "-q").exit_code == 0
    assert len(read_lines(tmp_path / "outputs" / "nightly.jsonl")) == 1


def test_model_from_environment(tmp_path, model, monkeypatch):
    monkeypatch.setenv("BATCHGEN_MODEL", model)
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(1))
    r = invoke("run", str(jobs), "-o", str(tmp_path / "o.jsonl"), "--no-fuse")
    assert r.exit_code == 0 and model in r.stderr


def test_openai_batch_output_validates_with_openai_models(tmp_path, model):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    lines = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}},
        {"custom_id": "c2", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": "def add(", "max_tokens": 4}},
        {"custom_id": "c3", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "best_of": 2}},
    ]  # fmt: skip
    jobs = write_jobs(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out.jsonl"
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse", "--draft", "pld")
    assert r.exit_code == 1
    c1, c2, c3 = read_lines(out)
    assert c1["custom_id"] == "c1" and c1["error"] is None and c1["response"]["status_code"] == 200
    assert c1["id"].startswith("batch_req_") and c1["response"]["request_id"]
    chat = ChatCompletion.model_validate(c1["response"]["body"])
    assert chat.usage.completion_tokens == 5 and chat.choices[0].message.role == "assistant"
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 5 and chat.model == "tiny"
    comp = Completion.model_validate(c2["response"]["body"])
    assert comp.usage.completion_tokens == 4 and comp.choices[0].finish_reason == "length"
    assert c1["response"]["body"]["batchgen"]["stats"]["draft"] == "pld"
    assert c3["response"] is None and c3["error"]["code"] == "unsupported" and c3["error"]["line"] == 3
    assert c3["error"]["message"] == "'body.best_of' is not supported by batchgen"


def test_validate_lists_bad_jobs(tmp_path):
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(2) + ["{oops", {"id": "t", "prompt": "x", "temprature": 1}])
    r = invoke("validate", str(jobs))
    assert r.exit_code == 1
    first, second = r.stdout.splitlines()
    assert first.startswith("line 4: job '4': invalid_json: not valid JSON: ")
    assert second == "line 5: job 't': unknown_key: unknown key 'temprature'"
    assert "4 jobs (native), 2 valid, 2 invalid" in r.stderr
    ok = write_jobs(tmp_path / "ok.jsonl", good_jobs(2))
    assert invoke("validate", str(ok)).exit_code == 0
    dup = write_jobs(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "x"}])
    r = invoke("validate", str(dup))
    assert r.exit_code == 2 and "duplicate job id" in r.stderr
    assert invoke("validate", str(tmp_path / "missing.jsonl")).exit_code == 2


def test_validate_checks_json_schemas_as_a_run_would(tmp_path, monkeypatch):
    """A schema the grammar engine refuses is that job's line, once per job and in
    one line, checked without a model; without the engine every schema job is."""
    pytest.importorskip("llguidance")
    unique = {"type": "array", "uniqueItems": True}
    lines = [{"id": "ok", "prompt": "x", "json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
             {"id": "u1", "prompt": "x", "json_schema": unique},
             {"id": "free", "prompt": "x"},
             {"id": "re", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
                 "name": "r", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "["}}}}}},
             {"id": "u2", "prompt": "x", "json_schema": unique},
             "{oops"]  # fmt: skip
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    r = invoke("validate", str(jobs))
    assert r.exit_code == 1
    out = r.stdout.splitlines()
    assert out[0] == """line 2: job 'u1': invalid_schema: the JSON schema cannot be used: Unimplemented keys: ["uniqueItems"]"""
    assert out[1].startswith("line 4: job 're': invalid_schema: the JSON schema cannot be used: regex parse error: [ ^ ")
    assert out[2] == out[0].replace("line 2: job 'u1'", "line 5: job 'u2'")
    assert out[3].startswith("line 6: job '6': invalid_json: ") and len(out) == 4
    assert "6 jobs (native), 2 valid, 4 invalid" in r.stderr
    monkeypatch.setitem(sys.modules, "llguidance", None)
    r = invoke("validate", str(jobs))
    assert [l.split(": ")[:3] for l in r.stdout.splitlines()[:2]] == [
        ["line 1", "job 'ok'", "grammar_unavailable"], ["line 2", "job 'u1'", "grammar_unavailable"]]


def test_draft_auto_resolves_to_pld(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(1))
    summary = tmp_path / "s.json"
    r = invoke("run", str(jobs), "--model", model, "-o", str(tmp_path / "o.jsonl"), "--summary", str(summary))
    assert r.exit_code == 0
    want = "pld"
    assert json.loads(summary.read_text())["draft"] == want
    assert read_lines(tmp_path / "o.jsonl")[0]["stats"]["draft"] == want


def test_turboquant_run_batches_over_its_cache_where_the_device_would_batch(tmp_path, model, monkeypatch):
    """On a GPU the default batches; with TurboQuant the rows hold its codes
    (auto sizes the batch to them); --batch-size 1 runs jobs one at a time."""
    from batchgen.engine import core as engine_module

    monkeypatch.setattr(engine_module, "default_batch_size", lambda: "auto")
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(3))
    for extra, rows in (((), 3), (("--batch-size", "2"), 2), (("--batch-size", "1"), 1)):
        out = tmp_path / f"out-{rows}.jsonl"
        r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--kv-cache", "turboquant", "--no-fuse", *extra)
        assert r.exit_code == 0, r.stderr
        assert {l["stats"]["kv_cache"] for l in read_lines(out)} == {"turboquant"}
        assert (f"batched decoding: up to {rows} jobs per step" in r.stderr) == (rows > 1)


def test_summary_reports_the_batch_and_overall_throughput(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(4))
    for extra, rows in (((), 1), (("--batch-size", "2"), 2)):
        summary = tmp_path / f"s{rows}.json"
        r = invoke("run", str(jobs), "--model", model, "-o", str(tmp_path / f"o{rows}.jsonl"), "--summary", str(summary),
                   "--no-fuse", *extra)  # fmt: skip
        assert r.exit_code == 0, r.stderr
        s = json.loads(summary.read_text())
        assert s["batch"]["rows"] == rows and f"batch rows={rows}" in r.stderr
        if rows > 1:  # 4 jobs of 6 tokens on 2 rows: the first tokens come from prompt passes
            assert s["batch"]["jobs_started"] == 4 and 10 <= s["batch"]["steps"] <= 12 and s["batch"]["prompt_s"] > 0
            assert s["draft"] == "pld" and s["batch"]["draft"] == "none" and "(batched rows: draft=none)" in r.stderr
        # completion tokens over the wall time, up to the JSON's rounding (wall_s to 1 ms, tps to 0.01)
        c, wall = s["tokens"]["completion"], s["wall_s"]
        assert c / (wall + 5e-4) - 5e-3 <= s["throughput_tps"] <= c / (wall - 5e-4) + 5e-3


def test_warm_up_also_runs_a_batch_wide_enough_for_the_wide_grid_kernels(model, monkeypatch, tmp_path):
    """Where kernel builds are kept (CUDA; stood in for here), the fp16 batched path
    runs once more with the rows from which the batch attention kernels take a block
    per kv head or fewer warps (`attention.wide_rows`, made small here; TurboQuant's rows
    keep theirs):
    every job of it finishes."""
    from batchgen.config import EngineConfig
    from batchgen.kernels import attention, registry
    from batchgen.warmup import warm_up

    monkeypatch.setattr(registry, "keep_builds", lambda: tmp_path)
    heads = json.loads((Path(model) / "config.json").read_text())["num_attention_heads"]
    for wide, widths in [(12, [1, 8, 12]), (8, [1, 8]), (3, [1, 8])]:  # a wide batch of 8 rows or fewer: the 8 rows' run
        monkeypatch.setattr(attention, "WIDE_GRID", wide * heads)
        report = warm_up(EngineConfig(model=model, dtype="float32"), ("fp16", "turboquant"))
        # one at a time: the three prompt lengths, then a job sampling, one asking for logprobs,
        # one with penalties, one sampling with logprobs, one with a JSON schema
        want = [(kind, w, 8 if w == 1 else w) for kind in ("fp16", "turboquant") for w in widths if kind == "fp16" or w <= 8]
        assert [(kind, rows, jobs) for kind, rows, jobs, _ in report.paths] == want, wide
    assert report.builds_dir == str(tmp_path)


def test_warm_up_runs_each_path_and_says_so_in_one_line(model):
    import re

    r = invoke("warm-up", "--model", model, "--dtype", "float32", "--kv-cache", "fp16")
    assert r.exit_code == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1
    pattern = (rf"batchgen: warm-up: {re.escape(model)} on cpu.*: loaded in \d+\.\d s; "
               r"fp16 one at a time 8 jobs \d+\.\d s, fp16 8 rows 8 jobs \d+\.\d s; no kernel builds to keep on this device")  # fmt: skip
    assert re.fullmatch(pattern, lines[0]), lines[0]
    r = invoke("warm-up", "--model", model, "--dtype", "float32", "--one-at-a-time")
    assert r.exit_code == 0, r.stderr
    assert "fp16 one at a time 8 jobs" in r.stderr and "turboquant one at a time 8 jobs" in r.stderr
    assert "rows" not in r.stderr
    r = invoke("warm-up", "--model", str(Path(model) / "missing"))
    assert r.exit_code == 2 and r.stderr.count("\n") == 1


def test_a_batched_run_says_once_that_it_leaves_predictions_unused(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", [{"id": f"p{i}", "prompt": "def f(x):", "max_tokens": 4,
                                                 "prediction": "    return x"} for i in range(3)])  # fmt: skip
    note = "predictions are drafted from where jobs run one at a time (--batch-size 1)"
    batched = invoke("run", str(jobs), "--model", model, "-o", str(tmp_path / "b.jsonl"), "--batch-size", "2", "--no-fuse")
    alone = invoke("run", str(jobs), "--model", model, "-o", str(tmp_path / "a.jsonl"), "--batch-size", "1", "--no-fuse")
    assert batched.exit_code == alone.exit_code == 0, batched.stderr + alone.stderr
    assert batched.stderr.count(note) == 1 and note not in alone.stderr
    assert [l["text"] for l in read_lines(tmp_path / "b.jsonl")] == [l["text"] for l in read_lines(tmp_path / "a.jsonl")]
    # the prediction's usage figures are about its text and the output's, batched or not
    usage = [{k: l["usage"][k] for k in ("accepted_prediction_tokens", "rejected_prediction_tokens")}
             for l in read_lines(tmp_path / "b.jsonl")]  # fmt: skip
    assert usage == [{k: l["usage"][k] for k in usage[0]} for l in read_lines(tmp_path / "a.jsonl")]
    assert all(sum(u.values()) > 0 for u in usage)
