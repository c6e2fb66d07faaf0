"""The side-by-side benchmark harness on a tiny model: the shape of its
output (not its speed)."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner

from batchgen.bench import median_index, prefix_agreement, runs_in_turn
from batchgen.cli import main

from test_cli import good_jobs, write_jobs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import tiny

    return str(tiny.build_model("qwen2", tmp_path_factory.mktemp("bench-qwen2")))


def test_bench_writes_both_sides_and_ratios(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(4))
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["bench", str(jobs), "--model", model, "--out", str(out), "--no-png", "--warmup", "1"])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert set(d["sides"]) == {"mlx-lm", "batchgen"} and d["jobs"] == 3
    for side in d["sides"].values():
        for key in ("decode_tps", "prefill_tps", "ttft_s_mean", "wall_s", "peak_memory_gb", "forward_passes_per_token"):
            assert side[key] > 0, key
    assert set(d["ratio_batchgen_over_plain"]) >= {"decode_tps", "prefill_tps", "wall_s", "ttft_s_mean"}
    assert len(d["per_job"]["mlx-lm"]) == len(d["per_job"]["batchgen"]) == 3
    for name, side in d["sides"].items():
        jobs_ = d["per_job"][name]
        assert side["prefill_s_total"] == pytest.approx(sum(j["ttft_s"] for j in jobs_))
        assert side["first_job_cache_hit_ratio"] == jobs_[0]["cached_tokens"] / jobs_[0]["prompt_tokens"]
    # the pool with the header's system prompt prewarmed: the first job starts cached
    assert d["sides"]["batchgen"]["first_job_cache_hit_ratio"] > 0 == d["sides"]["mlx-lm"]["first_job_cache_hit_ratio"]
    assert 0 <= d["identical_outputs"] <= 3 and isinstance(d["divergences"], list)
    assert d["device"] and d["versions"]["mlx"] and d["batchgen"]["draft"] == "pld"
    assert "decode tok/s: mlx-lm" in r.stdout


def test_bench_plain_and_fused_greedy_outputs_agree(tmp_path, model):
    """float32 tiny model, no techniques that change numerics: all identical."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(3))
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["bench", str(jobs), "--model", model, "--out", str(out), "--no-png",
                                  "--draft", "none", "--no-prompt-cache"])  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["identical_outputs"] == d["jobs"] == 2 and d["divergences"] == []


@pytest.mark.parametrize("cast, expected", [([], "float32"), (["--dtype", "bfloat16"], "bfloat16")])
def test_bench_casts_both_sides_of_a_model(tmp_path, model, cast, expected):
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(2))
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["bench", str(jobs), "--model", model, "--out", str(out), "--no-png",
                                  "--max-tokens", "3", *cast])  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["dtype"] == d["plain_dtype"] == expected


def test_bench_random_shape_and_throughput(tmp_path, model):
    out = tmp_path / "s.json"
    r = CliRunner().invoke(main, ["bench", "--shape", "tiny", "--model", model, "--dtype", "float32",
                                  "--synthetic", "24", "--synthetic-jobs", "1", "--max-tokens", "4",
                                  "--out", str(out), "--no-png"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["model"] == "tiny"
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(3))
    out = tmp_path / "t.json"
    r = CliRunner().invoke(main, ["bench", str(jobs), "--model", model, "--throughput", "1,2,auto",
                                  "--jobs-total", "4", "--max-tokens", "4", "--out", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch_size"] for row in rows] == [1, 2, 4]  # auto: as many rows as jobs fit
    assert rows[2]["requested"] == "auto"
    # each stage says when it ends, so a run cut short still shows where its time went
    import re

    said = r.stderr.splitlines()[:5]
    expected = [r"loaded both sides in \d+\.\d s", r"batch   1: batch_generate warm-up \(1 jobs\) \d+\.\d s",
                r"batch   1: batchgen warm-up \(1 jobs, pld\) \d+\.\d s", r"batch   1 \(4 jobs\): batch_generate .*",
                r"batch   2: batch_generate warm-up \(2 jobs\) \d+\.\d s"]  # fmt: skip
    assert all(re.fullmatch(e, line) for e, line in zip(expected, said)) and len(said) == 5, r.stderr
    assert rows[1]["jobs"] == 4 and rows[1]["batchgen"]["completion_tokens"] > 0
    assert rows[1]["batchgen_over_batchgen_sequential"] > 0
    # each run starts from an empty pool: the same jobs, the same cached tokens, but for
    # a duplicate entering beside its original (all its tokens cached, one more than alone)
    cached = [row["batchgen"]["cached_tokens"] for row in rows[:2]]
    assert cached[0] > 0 and abs(cached[1] - cached[0]) <= rows[1]["jobs"], cached


def test_throughput_keeps_the_rows_of_sizes_it_finished(tmp_path, model, monkeypatch):
    """A run cut short (here batch_generate failing at the second size) leaves
    the first size's row in the output file."""
    import importlib

    generate = importlib.import_module("mlx_lm.generate")  # the package's `generate` is a function
    real = generate.batch_generate

    def fails_at_two(*args, completion_batch_size, **kwargs):
        if completion_batch_size == 2:
            raise RuntimeError("cut short")
        return real(*args, completion_batch_size=completion_batch_size, **kwargs)

    monkeypatch.setattr(generate, "batch_generate", fails_at_two)
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(3))
    out = tmp_path / "t.json"
    r = CliRunner().invoke(main, ["bench", str(jobs), "--model", model, "--throughput", "1,2",
                                  "--jobs-total", "4", "--max-tokens", "4", "--out", str(out)])  # fmt: skip
    assert r.exit_code != 0 and "cut short" in str(r.exception)
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch_size"] for row in rows] == [1]
    assert rows[0]["batchgen"]["completion_tokens"] > 0


def test_throughput_runs_each_draft_kind_beside_one_batch_generate_run(tmp_path, model):
    loopy = [{"id": f"l{i}", "messages": [{"role": "user", "content": "ab ab ab ab " * (i + 2)}]} for i in range(3)]
    jobs = write_jobs(tmp_path / "jobs.jsonl", loopy)
    out = tmp_path / "t.json"
    r = CliRunner().invoke(main, ["bench", str(jobs), "--model", model, "--throughput", "1", "--jobs-total", "4",
                                  "--max-tokens", "24", "--pld-always", "--throughput-drafts", "pld,none",
                                  "--out", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert [(row["batch_size"], row["draft"]) for row in rows] == [(1, "pld"), (1, "none")]
    assert rows[0]["mlx_lm_batch_generate"] == rows[1]["mlx_lm_batch_generate"]
    pld, plain = rows[0]["batchgen"], rows[1]["batchgen"]
    assert pld["pld_drafted"] > 0 and plain["pld_drafted"] == 0
    assert pld["completion_tokens"] == plain["completion_tokens"]
    r = CliRunner().invoke(main, ["bench", str(jobs), "--model", model, "--throughput", "2", "--throughput-drafts", "x"])
    assert r.exit_code == 2 and "--throughput-drafts: draft kinds are pld, none" in r.output


def test_median_index_takes_the_lower_middle_run():
    assert median_index([5.0]) == 0
    assert median_index([3.0, 1.0, 2.0]) == 2
    assert median_index([1.0, 3.0, 2.0, 4.0]) == 2  # of 2.0 and 3.0, the lower
    assert median_index([2.0, 2.0]) == 0


def test_runs_in_turn_reverses_the_order_every_other_round():
    order = []
    sides = {name: (lambda name=name: order.append(name) or f"{name}{len(order)}") for name in ("plain", "pld", "none")}
    runs = runs_in_turn(3, sides)
    assert order == ["plain", "pld", "none", "none", "pld", "plain", "plain", "pld", "none"]
    assert runs == {"plain": ["plain1", "plain6", "plain7"], "pld": ["pld2", "pld5", "pld8"],
                    "none": ["none3", "none4", "none9"]}  # fmt: skip


def test_throughput_repeats_report_the_median_run_and_every_run(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(3))
    out = tmp_path / "t.json"
    r = CliRunner().invoke(main, ["bench", str(jobs), "--model", model, "--throughput", "2", "--jobs-total", "4",
                                  "--max-tokens", "4", "--throughput-repeats", "3", "--out", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    (row,) = json.loads(out.read_text())["rows"]
    runs = row["runs_tokens_per_s"]
    assert len(runs["batchgen"]) == len(runs["mlx_lm_batch_generate"]) == 3
    ours, plain = row["batchgen"]["tokens_per_s"], row["mlx_lm_batch_generate"]["tokens_per_s"]
    assert ours == sorted(runs["batchgen"])[1] and plain == sorted(runs["mlx_lm_batch_generate"])[1]
    assert row["ratio_tokens_per_s"] == ours / plain
    assert row["batchgen"]["rows"] == 2  # the median run's own batch report
    r = CliRunner().invoke(main, ["bench", str(jobs), "--model", model, "--throughput", "2", "--jobs-total", "4",
                                  "--max-tokens", "4", "--out", str(out)])  # fmt: skip
    assert r.exit_code == 0 and "runs_tokens_per_s" not in json.loads(out.read_text())["rows"][0]


def test_bench_needs_jobs_or_synthetic():
    r = CliRunner().invoke(main, ["bench"])
    assert r.exit_code == 2 and "give a JOBS file or --synthetic N" in r.output


def test_answer_nll_equals_one_teacher_forced_pass(model):
    """Token by token through a cache, the same sum as from one pass over the whole sequence."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from batchgen.bench import answer_nll

    net, _ = load(model)
    prompt, answer = [5, 9, 12, 7, 3, 30], [11, 4, 4, 21]
    logits = net(mx.array([prompt + answer]))[0]
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    start = len(prompt) - 1
    expected = -sum(logp[start + i, t].item() for i, t in enumerate(answer))
    got = answer_nll(net, prompt, answer, make_prompt_cache(net))
    assert abs(got - expected) <= 1e-4 * max(1.0, abs(expected)), (got, expected)


def test_parse_policy_reads_settings_and_rejects_the_rest():
    from batchgen.bench import parse_policy

    assert parse_policy("min_plain_tokens=4, margin=1.0") == (("min_plain_tokens", 4), ("margin", 1.0))
    assert parse_policy("") == ()
    for bad in ("drafted=3", "nope=1", "margin"):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            parse_policy(bad)


def test_bench_applies_the_policy_settings(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(3))
    out = tmp_path / "b.json"
    args = ["bench", str(jobs), "--model", str(model), "--max-tokens", "8", "--out", str(out), "--no-png",
            "--pld-policy", "min_plain_tokens=2,margin=1.5"]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["batchgen"]["pld_policy"] == {"min_plain_tokens": 2, "margin": 1.5}
    r = CliRunner().invoke(main, args[:-1] + ["margin=x"])
    assert r.exit_code != 0 and "--pld-policy" in r.output


def test_prefix_agreement_is_the_reference_fraction_before_the_first_difference():
    assert prefix_agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert prefix_agreement([1, 2], [1, 2, 3, 4]) == 0.5  # stopped early: parted where it stopped
    assert prefix_agreement([1, 2, 3, 4, 5], [1, 2, 3, 4]) == 1.0  # ran on: all of the reference first
    assert prefix_agreement([7], [1, 2]) == 0.0
    assert prefix_agreement([3, 4], [3, 4]) == 1.0 and prefix_agreement([], []) == 1.0


def test_bench_features_writes_each_figure(tmp_path, model):
    """`--features` on a tiny model: JSON-schema and logprobs rows against free
    ones at each size, n samples against separate jobs (the shape of the
    output, and that the sampled texts are the separate jobs' texts)."""
    pytest.importorskip("llguidance")
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(3))
    out = tmp_path / "f.json"
    r = CliRunner().invoke(main, ["bench", str(jobs), "--model", model, "--features", "--throughput", "2,auto",
                                  "--jobs-total", "4", "--max-tokens", "6", "--samples", "2x3x16", "--out", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    rows = d["structured_and_logprobs"]
    assert [row["rows"] for row in rows] == [2, 4]
    for row in rows:
        assert row["json_schema_over_free"] > 0 and row["logprobs_over_free"] > 0
        assert row["free"]["completion_tokens"] == row["logprobs"]["completion_tokens"] == 24
    s = d["samples"]
    assert (s["prompts"], s["rows"]) == (2, 4) and s["n"]["lines"] == 2 and s["separate"]["lines"] == 6
    assert s["n"]["completion_tokens"] == s["separate"]["completion_tokens"]
    assert s["samples_identical_to_separate_jobs"] == 6
    assert s["n"]["prefill_tokens"] <= s["separate"]["prefill_tokens"]


def bench_script(name: str):
    """A script of bench/ (not a package) loaded as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_line_times_whole_run_processes(tmp_path, model):
    first_line = bench_script("first_line")
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(2))
    out = tmp_path / "fl.json"
    rows = first_line.main([str(jobs), "--runs", "1", "--out", str(out), "--", "--model", model, "--dtype", "float32"])
    (row,) = rows
    assert row["exit_code"] == 0, row
    assert row["jobs"]["ok"] == 2 and row["completion_tokens"] == 12  # the file's default max_tokens, 6
    assert 0 < row["load_s"] < row["first_line_s"] <= row["total_s"]
    assert row["first_line_less_load_s"] == round(row["first_line_s"] - row["load_s"], 3)
    assert json.loads(out.read_text())["runs"] == rows
    assert [j["id"] for j in row["per_job"]] == ["j0", "j1"]
    assert sum(j["completion_tokens"] for j in row["per_job"]) == 12
    assert all(j["forward_passes"] >= 1 and j["decode_s"] >= 0 for j in row["per_job"])
    assert row["jobs_total"]["forward_passes"] == sum(j["forward_passes"] for j in row["per_job"])
    assert row["jobs_total"]["prefill_s"] == round(sum(j["prefill_s"] for j in row["per_job"]), 3)
    assert first_line.brief(row).endswith(f"passes {row['jobs_total']['forward_passes']}, tokens 12")


def test_turboquant_passes_times_both_caches_at_each_length(tmp_path, model):
    """Every (history, tokens fed) pair gets both caches' ms a pass and their ratio, and a
    pass's trim leaves each cache at its history (the next pass sees the same one)."""
    tqp = bench_script("turboquant_passes")
    out = tmp_path / "tqp.json"
    result = tqp.main(["--model", model, "--dtype", "float32", "--contexts", "24,40", "--lengths", "1,4",
                       "--rounds", "2", "--reps", "2", "--out", str(out)])  # fmt: skip
    rows = result["rows"]
    assert [(r["context"], r["tokens_fed"]) for r in rows] == [(24, 1), (24, 4), (40, 1), (40, 4)]
    for r in rows:
        assert r["fp16_ms"] > 0 and r["turboquant_ms"] > 0 and len(r["rounds"]["turboquant"]) == 2
        assert r["turboquant_over_fp16"] == round(r["turboquant_ms"] / r["fp16_ms"], 3)
    assert json.loads(out.read_text())["rows"] == rows

    from batchgen.config import EngineConfig, KVConfig
    from batchgen.engine.core import Engine

    engine = Engine.load(EngineConfig(model=model, dtype="float32"))
    cache = engine.make_cache(KVConfig(kind="turboquant", bits=4))
    engine.model(mx.array([[3] * 24]), cache=cache)
    tqp.pass_ms(engine.model, cache, 4, 2)
    assert {c.offset for c in cache} == {24}


def test_feature_phases_times_each_phase_of_free_json_and_logprobs_runs():
    """Every variant's runs report their steps and each phase's ms a step; the JSON run's
    grammar work (fill, consume) is timed inside its pick and read, and the scheduler's
    methods are themselves again afterwards."""
    pytest.importorskip("llguidance")
    from batchgen.engine.scheduler import BatchScheduler

    before = BatchScheduler._read
    phases = bench_script("feature_phases")
    out = phases.main(["--shape", "tiny", "--dtype", "float32", "--jobs", "6", "--rows", "3", "--max-tokens", "5",
                       "--repeats", "1"])  # fmt: skip
    assert set(out) == {"free", "json", "logprobs"} and all(len(runs) == 1 for runs in out.values())
    for name, (run,) in out.items():
        assert run["steps"] >= 5 and run["tokens"] > 0 and run["step_ms"] > 0
        assert {"queue", "read+wait", "wait", "start"} <= set(run["ms_per_step"]), name
    json_phases = out["json"][0]["ms_per_step"]
    assert 0 < json_phases["fill"] <= json_phases["pick"] and 0 < json_phases["consume"] <= json_phases["read+wait"]
    assert "fill" not in out["free"][0]["ms_per_step"]
    assert BatchScheduler._read is before


def test_feature_phases_takes_long_random_prompts():
    """`--synthetic N`: every job a random prompt of about N tokens (the chat template's
    few around it), the variants asked for only."""
    phases = bench_script("feature_phases")
    out = phases.main(["--shape", "tiny", "--dtype", "float32", "--jobs", "3", "--rows", "3", "--max-tokens", "2",
                       "--repeats", "1", "--variants", "free", "--synthetic", "60"])  # fmt: skip
    assert set(out) == {"free"}
    (run,) = out["free"]
    assert 3 * 60 <= run["prompt_tokens"] <= 3 * 90 and run["tokens"] == 3 * 2


def test_grammar_threads_times_masks_for_each_way_of_making_matchers(tmp_path):
    """One row of timings per (threads, kept) pair, the schema read back from the file
    `--write-schema` wrote (a machine without MLX)."""
    pytest.importorskip("llguidance")
    gt = bench_script("grammar_threads")
    schema = tmp_path / "schema.json"
    assert gt.main(["--write-schema", str(schema)]) is None
    from batchgen.bench_features import FEATURE_SCHEMA

    assert json.loads(schema.read_text())["schema"] == FEATURE_SCHEMA
    res = gt.main(["--schema-file", str(schema), "--rows", "4", "--kept", "1,2c,0", "--threads", "1,2", "--steps", "7",
                   "--out", str(tmp_path / "gt.json")])  # fmt: skip
    assert [(r["threads"], r["kept"]) for r in res["runs"]] == [(t, k) for t in (1, 2) for k in ("1", "2c", "0")]
    assert all(r["ms"] > 0 and r["first5_ms"] > 0 for r in res["runs"])
    assert res["vocab"] == res["n_vocab"] == 4096 and json.loads((tmp_path / "gt.json").read_text()) == res


def test_a_trained_tokenizer_saved_as_a_model_folder_serves_a_shape(tmp_path):
    """`grammar_masks.py --save-tokenizer`: mlx-lm's loader reads the folder (chat template
    and all), and the phases probe runs a shape's JSON rows through it."""
    pytest.importorskip("llguidance")
    from mlx_lm.utils import load_tokenizer

    gm = bench_script("grammar_masks")
    out = tmp_path / "tok"
    gm.main(["--train-vocab", "600", "--cache", str(tmp_path / "cache"), "--save-tokenizer", str(out)])
    tok = load_tokenizer(out)
    assert len(tok.vocab) == 600 and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "def f(x): return x"}], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    assert text.startswith("<|im_start|>") and tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"
    phases = bench_script("feature_phases")
    runs = phases.main(["--shape", "tiny", "--dtype", "float32", "--jobs", "2", "--rows", "2", "--max-tokens", "4",
                        "--repeats", "1", "--tokenizer", str(out)])  # fmt: skip
    assert runs["json"][0]["ms_per_step"]["fill"] > 0


def test_attention_plans_times_each_mask_kind_and_counts_the_shapes(tmp_path):
    """Each mask kind times every prompt length; the padded bias form makes fewer
    distinct (queries, keys) shapes than the prompt's own, and its padded mask lets the
    real queries read exactly what the unpadded one does."""
    ap = bench_script("attention_plans")
    out = tmp_path / "plans.json"
    result = ap.main(["--dtype", "float32", "--lengths", "70,90,130,200", "--prefix", "8", "--reps", "1",
                      "--heads", "4,2", "--dim", "32", "--out", str(out)])  # fmt: skip
    rows = result["rows"]
    assert [(r["mask"], r["queries"]) for r in rows] == [(m, n) for m in ap.MASKS for n in (70, 90, 130, 200)]
    assert all(r["first_ms"] > 0 and r["repeat_ms"] > 0 for r in rows)
    assert {k: v["shapes"] for k, v in result["summary"].items()} == {"causal": 4, "bias": 4, "bias_padded": 2}
    assert [r["shape"] for r in rows if r["mask"] == "bias_padded"] == [[128, 128], [128, 128], [256, 256], [256, 256]]
    assert json.loads(out.read_text())["rows"] == rows
    *_, own = ap.pass_arrays("bias", 70, 78, 4, 2, 32, mx.float32)
    *_, padded = ap.pass_arrays("bias_padded", 70, 78, 4, 2, 32, mx.float32)
    assert (padded[..., :70, :78] == own[..., :70, :78]).all() and (padded[..., :70, 78:] == -mx.inf).all()


def test_kernel_profile_sweep_times_every_setting_and_puts_the_warps_back():
    """A line per (rows, context, warps, grouped, unroll, host ms), each with the step's
    wall and queueing ms; host work longer than a step bounds the step (its sleep is taken
    every step); the kernels' settings are put back."""
    from batchgen.kernels import attention

    kp = bench_script("kernel_profile")
    names = ("WARPS", "WIDE_WARPS", "GROUP_WARPS", "GROUPED", "UNROLL")
    before = [getattr(attention, n) for n in names]
    lines = kp.sweep("tiny", [2], [24], [16, 4], [0.0, 150.0], steps=4, groups=[0, 1], unrolls=[None])
    keys = ("rows", "context", "warps", "grouped", "unroll", "host_ms")
    settings = [tuple(part for part in line.split() if part.split("=")[0] in keys) for line in lines]
    assert settings == [("rows=2", "context=24", f"warps={w}", f"grouped={g}", f"unroll={attention.UNROLL}",
                         f"host_ms={h}") for w in (16, 4) for g in (0, 1) for h in ("0", "150")]  # fmt: skip
    wall = [float(line.split("wall_ms_per_step=")[1].split()[0]) for line in lines]
    queue = [float(line.split("queue_ms_per_step=")[1].split()[0]) for line in lines]
    assert all(q > 0 for q in queue) and min(wall[1::2]) >= 150 * 4 / 5 > max(wall[0::2])
    assert [getattr(attention, n) for n in names] == before


def test_predicted_outputs_bench_runs_both_sides_on_the_same_jobs(tmp_path):
    predicted = bench_script("predicted_outputs")
    out = tmp_path / "p.json"
    (row,) = predicted.main(["--jobs", "2", "--every", "40", "--rounds", "1", "--out", str(out), "--", "--dtype", "float32"])
    assert row["identical"] == "2 of 2"
    lookup, told = row["lookup"], row["predicted"]
    assert lookup["completion_tokens"] == told["completion_tokens"] > 0
    # how many passes each side takes is the adaptive policy's, which times them (on a busy
    # CPU it may draft little): tests/test_pld.py checks what predictions save, policy fixed
    assert all(side["forward_passes"] > 0 and side["pld_accepted"] >= 0 for side in (lookup, told))
    assert json.loads(out.read_text())["rounds"] == [row]


def test_peer_reads_the_jobs_messages_as_batchgen_does_and_counts_generated_tokens(tmp_path):
    from types import SimpleNamespace

    from test_cli import SYSTEM

    peer = bench_script("peer_transformers")
    bad = {"id": "bad", "messages": "not a list"}
    jobs = write_jobs(tmp_path / "jobs.jsonl", good_jobs(2) + [bad])
    assert peer.job_messages(jobs, 16) == [
        ({"role": "system", "content": SYSTEM}, {"role": "user", "content": f"task {i}"}) for i in range(2)
    ]
    results = {"a": SimpleNamespace(generated_tokens=[5, 6, 7]), "b": SimpleNamespace(generated_tokens=[])}
    assert peer.outputs_tokens(results) == [3, 0]
    with pytest.raises(TypeError, match="without generated_tokens: SimpleNamespace"):
        peer.outputs_tokens({"a": SimpleNamespace(sequences=[1])})
    with pytest.raises(RuntimeError, match="request failed: boom"):
        peer.outputs_tokens({"a": SimpleNamespace(generated_tokens=[], error="boom")})
    with pytest.raises(RuntimeError, match="2 requests and no generated token"):
        peer.outputs_tokens({"a": SimpleNamespace(generated_tokens=[]), "b": SimpleNamespace(generated_tokens=[])})


def test_build_times_splits_a_process_new_builds_by_kind(tmp_path):
    times = bench_script("build_times")
    before = tmp_path / "before.txt"
    before.write_text("100.0 10 sm_90/mean_float32.ptx\n")
    after = tmp_path / "after.txt"  # unsorted, as a listing may come: read_list sorts by write time
    after.write_text("\n".join(["103.5 30 sm_90/custom_kernel_tq_step_64.ptx", "100.0 10 sm_90/mean_float32.ptx",
                                 "101.0 20 sm_90/gemv_bfloat16.ptx", "160.0 5 sm_90/softmax_bfloat16.ptx", ""]))
    out = times.main([str(after), str(before), "--json", str(tmp_path / "t.json")])
    assert out == {"mlx": {"builds": 2, "seconds": 1.0, "after_other_work": 1},
                   "batchgen": {"builds": 1, "seconds": 2.5, "after_other_work": 0}, "span_s": 59.0}
    assert json.loads((tmp_path / "t.json").read_text()) == out
    # no previous list: every build is new, the first after nothing to time it by
    first = times.main([str(before)])
    assert first["mlx"] == {"builds": 1, "seconds": 0.0, "after_other_work": 1}


def test_logprob_entries_times_the_steps_and_the_lines(tmp_path):
    probe = bench_script("logprob_entries")
    out = probe.main(["--rows", "3", "--steps", "4", "--k", "2", "--repeats", "2", "--out", str(tmp_path / "r.json")])
    assert (out["rows"], out["steps"], out["k"], len(out["runs"])) == (3, 4, 2, 2)
    assert all(r["add_ms_a_step"] > 0 and r["lines_ms_a_step"] > 0 for r in out["runs"])
    assert json.loads((tmp_path / "r.json").read_text())["lines_sha1"] == out["lines_sha1"]
