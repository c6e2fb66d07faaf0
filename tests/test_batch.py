"""Continuous batching: batched float32 greedy texts equal sequential ones,
per-job seeds sample the same tokens in a batch as alone, a failing job
fails alone."""

import mlx.core as mx
import pytest

from batchgen.config import DecodeConfig, EngineConfig, KVConfig, PromptCacheConfig, SamplingConfig
from batchgen.engine.core import Engine
from batchgen.jobs import BadJob, NATIVE

from test_engine import make_job

TEXTS = [
    "Rename the variable `count` to `total`.",
    "def add(a, b):\n    return a + b\n" * 3,
    "hi",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "for i in range(10):\n    print(i * i)\n",
    "x",
    "import os\nimport sys\n\nclass Point:\n    x: int\n",
]
LENGTHS = [17, 5, 30, 9, 1, 23, 12]


def engine(path, batch_size, pool=True, compiled=True, kv=None):
    cfg = EngineConfig(
        model=str(path), fuse=False, decode=DecodeConfig(draft="none"), batch_size=batch_size,
        prompt_cache=PromptCacheConfig(enabled=pool, prewarm=False), compiled_batch_step=compiled,
        kv=kv or KVConfig(),
    )  # fmt: skip
    return Engine.load(cfg)


def jobs(sampling=None):
    return [make_job(t, max_tokens=n, job_id=f"j{i}", sampling=sampling) for i, (t, n) in enumerate(zip(TEXTS, LENGTHS))]


def record_passes(monkeypatch) -> list:
    """Each shared prompt pass (`entering.prefill_rows`) from now on, as (rows,
    tails, length, tokens cached before it)."""
    import batchgen.engine.entering as ent
    passes = []
    real = ent.prefill_rows

    def spy(model, cache, tails, length, rows):
        passes.append((rows, len(tails), length, cache[0].offset))
        return real(model, cache, tails, length, rows)

    monkeypatch.setattr(ent, "prefill_rows", spy)
    return passes


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("batch_size,compiled", [(3, True), (8, True), (3, False)])
def test_batched_greedy_equals_sequential(model_dir, arch, batch_size, compiled):
    path = model_dir(arch)
    seq = {r.id: r for r in engine(path, 1).run_all(jobs())}
    batched = engine(path, batch_size, compiled=compiled)
    got = list(batched.run_all(jobs()))
    assert bool(batched.batch_steps) == compiled  # the compiled step ran (no fallback)
    assert sorted(r.id for r in got) == sorted(seq)
    for r in got:
        assert r.ok, r.error
        assert r.text == seq[r.id].text, (arch, r.id)
        assert r.usage.completion_tokens == seq[r.id].usage.completion_tokens
        assert r.finish_reason == seq[r.id].finish_reason


def test_results_stream_in_completion_order(model_dir):
    got = [r.id for r in engine(model_dir("qwen2"), 4).run_all(jobs())]
    # j4 (1 token) finishes before j0 (17 tokens) although it comes later
    assert got.index("j4") < got.index("j0")


def test_seeded_samples_are_the_same_in_a_batch(model_dir):
    path = model_dir("qwen2")
    s = SamplingConfig(temperature=0.9, top_p=0.95, seed=5)
    seq = {r.id: r.text for r in engine(path, 1).run_all(jobs(s))}
    bat = {r.id: r.text for r in engine(path, 4).run_all(jobs(s))}
    assert bat == seq


def test_rows_with_different_sampling_settings_sample_as_alone(model_dir):
    """Rows drawn together (each its temperature, top-p/k, min-p, seed), beside greedy rows."""
    path = model_dir("qwen2")
    settings = [SamplingConfig(temperature=0.7, top_p=0.9, seed=1), SamplingConfig(),
                SamplingConfig(temperature=1.3, top_k=5, seed=2), SamplingConfig(temperature=0.5, min_p=0.05, seed=3),
                SamplingConfig(temperature=1.0, seed=4), SamplingConfig(),
                SamplingConfig(temperature=0.9, top_p=0.5, min_p=0.1, top_k=20, seed=5)]  # fmt: skip
    batch = [make_job(t, max_tokens=n, job_id=f"m{i}", sampling=s)
             for i, (t, n, s) in enumerate(zip(TEXTS, LENGTHS, settings))]  # fmt: skip
    seq = {r.id: r.text for r in engine(path, 1).run_all(batch)}
    assert {r.id: r.text for r in engine(path, 4).run_all(batch)} == seq


def test_seeded_samples_of_repeated_prompts_are_the_same_in_a_batch(model_dir):
    """Repeats enter fed by the step (first token from keys[0] there, not from a
    prompt pass) or as duplicates of one round: the same samples as alone."""
    path = model_dir("qwen2")
    batch = [make_job(TEXTS[i % 2], max_tokens=8, job_id=f"s{i}", sampling=SamplingConfig(temperature=0.9, seed=i))
             for i in range(6)]  # fmt: skip
    seq = {r.id: r.text for r in engine(path, 1).run_all(batch)}
    e = engine(path, 2)
    got = {r.id: r for r in e.run_all(batch)}
    assert {i: r.text for i, r in got.items()} == seq
    assert any(r.usage.cached_tokens == r.usage.prompt_tokens - 1 for r in got.values())  # some were fed


def test_failing_job_fails_alone(model_dir):
    path = model_dir("qwen2", max_position_embeddings=40)
    items = jobs()
    items.insert(2, make_job("long " * 60, max_tokens=5, job_id="too-long"))
    items.insert(4, BadJob("bad", 99, NATIVE, "invalid_json", "not valid JSON"))
    seq = {r.id: r for r in engine(path, 1).run_all(items)}
    bat = {r.id: r for r in engine(path, 3).run_all(items)}
    assert bat["too-long"].error.type == "prompt_too_long" and bat["bad"].error.type == "invalid_json"
    for job_id, r in seq.items():
        assert bat[job_id].text == r.text


def test_memory_budget_limits_rows(model_dir):
    path = model_dir("qwen2")
    e = engine(path, 8)
    from batchgen.engine.scheduler import BatchScheduler

    sched = BatchScheduler(e, 8, kv_budget_bytes=1)  # room for one row at a time
    live_max = 0
    real_read = sched._read

    def spy(step):
        nonlocal live_max
        live_max = max(live_max, sum(r is not None for r in sched.rows))
        return real_read(step)

    sched._read = spy
    seq = {r.id: r.text for r in engine(path, 1).run_all(jobs())}
    got = {r.id: r.text for r in sched.run(jobs())}
    assert got == seq and live_max == 1


def test_compiled_step_across_capacity_changes(model_dir):
    """Rows that outgrow the step's buffers (recorded anew at each capacity)
    and fill its recent window many times over, a long prompt entering beside
    short rows (left growth), padding cut when it leaves: the sequential texts."""
    from batchgen.engine.scheduler import BatchScheduler
    from batchgen.step.compiled import WINDOW

    path = model_dir("qwen2")
    items = [make_job(TEXTS[0], max_tokens=300, job_id="long-out"),
             make_job(TEXTS[5], max_tokens=40, job_id="short"),
             make_job(TEXTS[1] * 12, max_tokens=30, job_id="long-in"),
             make_job(TEXTS[2], max_tokens=120, job_id="after")]  # fmt: skip
    seq = {r.id: r.text for r in engine(path, 1).run_all(items)}
    sched = BatchScheduler(engine(path, 2), 2, kv_budget_bytes=1 << 40)
    capacities, window = [], []
    real = sched._forward

    def spy(inputs):
        out = real(inputs)
        capacities.append(sched.cache[0].keys.shape[2])
        window.append(sched.stepper.used)
        return out

    sched._forward = spy
    got = {r.id: r.text for r in sched.run(items)}
    assert got == seq
    assert len(set(capacities)) >= 2 and all(c % 256 == 0 for c in capacities)
    assert window.count(WINDOW) >= 3 and window.count(1) > window.count(WINDOW)  # flushed, full or not


def test_a_step_that_cannot_be_recorded_falls_back_to_uncompiled(model_dir, monkeypatch, caplog):
    """Mid-run, its window holding positions, the compiled step fails: the
    window is flushed, the batch steps uncompiled, texts as one by one."""
    import logging

    import batchgen.step.compiled as cs
    from batchgen.engine.scheduler import BatchScheduler

    path = model_dir("qwen2")
    seq = {r.id: r.text for r in engine(path, 1).run_all(jobs())}
    sched = BatchScheduler(engine(path, 3), 3, kv_budget_bytes=1 << 40)
    real, held = cs.make_step, []

    def flaky(model, sample_rows, kernel, **kw):
        step = real(model, sample_rows, kernel, **kw)

        def run(*args):
            if sched.stepper.used >= 4:
                held.append(sched.stepper.used)
                raise ValueError("cannot record this model")
            return step(*args)

        return run

    monkeypatch.setattr(cs, "make_step", flaky)
    with caplog.at_level(logging.INFO, logger="batchgen"):
        got = {r.id: r.text for r in sched.run(jobs())}
    assert "compiled step unavailable (ValueError: cannot record this model)" in caplog.text
    assert held == [4] and not sched.compiled
    assert got == seq


def test_budget_counts_the_buffers_as_the_step_holds_them(model_dir):
    """A budget that holds four rows of the longest job's tokens, but not the
    step's buffers for them (rounded up, plus the window): one row at a time."""
    from batchgen.engine.scheduler import BatchScheduler
    from batchgen.step.compiled import held_positions

    path = model_dir("qwen2")
    e = engine(path, 4)
    longest = max(len(e.prompt_tokens(j)) + j.max_tokens for j in jobs())
    sched = BatchScheduler(e, 4, kv_budget_bytes=4 * held_positions(longest) * e.kv_bytes_per_token()[0] - 1)
    assert 4 * longest * sched.per_token <= sched.budget
    live_max = 0
    real_read = sched._read

    def spy(step):
        nonlocal live_max
        live_max = max(live_max, sched.live)
        return real_read(step)

    sched._read = spy
    got = {r.id: r.text for r in sched.run(jobs())}
    assert got == {r.id: r.text for r in engine(path, 1).run_all(jobs())}
    assert live_max == 1


def test_hybrid_model_falls_back_to_sequential(model_dir, caplog):
    import logging

    path = model_dir("qwen3_5")
    with caplog.at_level(logging.INFO, logger="batchgen"):
        got = {r.id: r.text for r in engine(path, 4).run_all(jobs()[:3])}
    assert "batched decoding off" in caplog.text
    assert got == {r.id: r.text for r in engine(path, 1).run_all(jobs()[:3])}


def test_auto_size_fits_the_budget():
    from batchgen.engine.scheduler import BatchScheduler

    assert BatchScheduler.auto_size(10_000, per_token_bytes=10, tokens_per_job=100) == 10
    assert BatchScheduler.auto_size(10, per_token_bytes=10, tokens_per_job=100) == 1
    assert BatchScheduler.auto_size(10**12, per_token_bytes=10, tokens_per_job=100) == 256


@pytest.mark.parametrize("device_default, expected", [(1, 1), ("auto", 7)])
def test_unset_batch_size_takes_the_device_default(model_dir, monkeypatch, device_default, expected):
    """A CPU runs one job at a time; a GPU sizes the batch to the KV budget, capped by
    the number of jobs (7 here, far below what the budget holds for a tiny model)."""
    from batchgen.engine import core as engine_module

    monkeypatch.setattr(engine_module, "default_batch_size", lambda: device_default)
    assert engine(model_dir("qwen2"), None).resolve_batch_size(total=len(TEXTS)) == expected


def test_resume_mid_batch(model_dir, tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    from batchgen.engine.scheduler import BatchScheduler
    from batchgen.cli import main

    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps({"id": f"j{i}", "prompt": t, "max_tokens": n}) + "\n"
                            for i, (t, n) in enumerate(zip(TEXTS, LENGTHS))))  # fmt: skip
    out = tmp_path / "out.jsonl"
    args = ["run", str(path), "--model", str(model_dir("qwen2")), "-o", str(out), "--no-fuse", "--batch-size", "3"]
    real, calls = BatchScheduler._finish, []

    def finish_then_interrupt(self, row):
        calls.append(row.job.id)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, row)

    monkeypatch.setattr(BatchScheduler, "_finish", finish_then_interrupt)
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 130 and len(out.read_text().splitlines()) == 2
    monkeypatch.setattr(BatchScheduler, "_finish", real)
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.stderr
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert sorted(l["id"] for l in lines) == sorted(f"j{i}" for i in range(7))
    seq = CliRunner().invoke(main, args[:4] + ["-o", str(tmp_path / "seq.jsonl"), "--no-fuse", "--batch-size", "1"])
    assert seq.exit_code == 0
    want = {json.loads(l)["id"]: json.loads(l)["text"] for l in (tmp_path / "seq.jsonl").read_text().splitlines()}
    assert {l["id"]: l["text"] for l in lines} == want


@pytest.mark.parametrize("pad", [False, True])
def test_entering_jobs_share_one_prompt_pass(model_dir, monkeypatch, pad):
    """Jobs entering together are prefilled as rows of one pass (padded: rows
    and length to powers of two); texts and token counts as one by one."""
    import batchgen.engine.core as eng
    path = model_dir("qwen2")
    seq = {r.id: r for r in engine(path, 1).run_all(jobs())}
    passes = record_passes(monkeypatch)
    e = engine(path, 8)
    e.pad_prompts = pad
    tokens = [e.prompt_tokens(j) for j in jobs()]
    got = {r.id: r for r in e.run_all(jobs())}
    longest = max(len(t) for t in tokens)
    assert passes == [(8 if pad else 7, 7, eng.padded_length(longest, 2048) if pad else longest, 0)]
    for i, r in got.items():
        assert (r.text, r.usage.completion_tokens) == (seq[i].text, seq[i].usage.completion_tokens), i
        assert r.usage.cached_tokens == 0  # the pool was empty when they entered
    assert e.batch_report["jobs_started"] == 7 and e.batch_report["steps"] >= max(LENGTHS) - 1


def test_entering_jobs_of_unlike_lengths_split_into_passes_where_passes_cost_little(model_dir, monkeypatch):
    """Where a pass costs little beside its tokens (a large model), entering rows
    of very different tails take passes by length instead of one padded to the
    longest: fewer tokens computed, texts and token counts as one by one."""
    import batchgen.engine.core as eng
    import batchgen.engine.entering as ent
    path = model_dir("qwen2")
    seq = {r.id: r for r in engine(path, 1).run_all(jobs())}
    e = engine(path, 8)
    e.pad_prompts = True
    e.pass_cost_tokens = 0
    split, real = [], ent._row_groups

    def spy(members, tails, *args, **kwargs):
        parts = real(members, tails, *args, **kwargs)
        split.extend([tails[i] for i in part] for part in parts)  # each pass's tail lengths
        return parts

    monkeypatch.setattr(ent, "_row_groups", spy)
    got = {r.id: r for r in e.run_all(jobs())}
    assert len(split) > 1 and sum(map(len, split)) == 7
    longest = max(max(part) for part in split)
    passes = [ent.pass_shape(len(part), max(part), 2048) for part in split]
    assert sum(rows * length for rows, length in passes) < 8 * eng.padded_length(longest, 2048)
    for i, r in got.items():
        assert (r.text, r.usage.completion_tokens) == (seq[i].text, seq[i].usage.completion_tokens), i


def test_a_pass_costs_fewer_tokens_of_a_larger_model():
    """`pass_cost_tokens`: PASS_OVERHEAD_S x PROMPT_FLOPS / (2 x parameters), whatever
    their dtype or bits."""
    import mlx.nn as nn

    from batchgen.engine.entering import PASS_OVERHEAD_S, PROMPT_FLOPS, pass_cost_tokens

    class Stack(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.layers = [nn.Linear(width, width, bias=False) for _ in range(2)]

    small, large = Stack(64), Stack(128)
    for m, params in ((small, 2 * 64 * 64), (large, 2 * 128 * 128)):
        assert pass_cost_tokens(m) == int(PASS_OVERHEAD_S * PROMPT_FLOPS / (2 * params))
    assert pass_cost_tokens(large) * 4 <= pass_cost_tokens(small) + 4
    # a quantized model counts the parameters it had: its compute is theirs
    quantized = Stack(128)
    nn.quantize(quantized, group_size=64, bits=4)
    assert pass_cost_tokens(quantized) == pass_cost_tokens(large)


def test_jobs_sharing_the_prewarmed_prefix_enter_in_one_pass(model_dir, monkeypatch):
    from batchgen.jobs import Job

    system = "You are a helpful assistant. Answer briefly and exactly."
    batch = [
        Job(id=f"s{i}", line=i + 1, format=NATIVE, max_tokens=n, prompt=None, sampling=SamplingConfig(),
            messages=({"role": "system", "content": system}, {"role": "user", "content": t}))
        for i, (t, n) in enumerate(zip(TEXTS[:4], LENGTHS[:4]))
    ]  # fmt: skip
    path = model_dir("llama")
    seq = {r.id: r for r in engine(path, 1).run_all(batch)}
    passes = record_passes(monkeypatch)
    e = engine(path, 4)
    prefix = e.prewarm(system, "test")["tokens"]
    got = {r.id: r for r in e.run_all(batch)}
    assert [p[0] for p in passes] == [4]
    for i, r in got.items():
        assert r.usage.cached_tokens == prefix > 0
        assert (r.text, r.usage.completion_tokens) == (seq[i].text, seq[i].usage.completion_tokens), i


@pytest.mark.parametrize("pad", [False, True])
def test_pool_hits_a_little_longer_are_cut_back_to_share_a_pass(model_dir, monkeypatch, pad):
    """An earlier job left a slot a few tokens longer than the system prompt for
    one of three entering prompts. Where passes are padded (a GPU) that hit is
    cut back to the system prompt's and all three share one pass; elsewhere it
    keeps its longer hit and a pass of its own. Texts as one by one."""
    import batchgen.engine.core as eng
    import batchgen.engine.entering as ent
    from batchgen.jobs import Job

    system = "You are a helpful assistant. Answer briefly and exactly."
    users = ["Write the function load of plistlib.", "Write the function dump of json.", "hi", "x = 1"]
    batch = [
        Job(id=f"m{i}", line=i + 1, format=NATIVE, max_tokens=6, prompt=None, sampling=SamplingConfig(),
            messages=({"role": "system", "content": system}, {"role": "user", "content": u}))
        for i, u in enumerate(users)
    ]  # fmt: skip
    path = model_dir("qwen2")
    seq = {r.id: r for r in engine(path, 1).run_all(batch)}
    e = engine(path, 4)
    e.pad_prompts = pad
    prefix = e.prewarm(system, "test")["tokens"]
    got = {r.id: r for r in e.run_all(batch[:1])}  # leaves a slot sharing "Write the function " with m1
    passes = []
    real_prefill, real_rows = eng.prefill, ent.prefill_rows
    monkeypatch.setattr(eng, "prefill", lambda *a, **k: passes.append("one") or real_prefill(*a, **k))
    monkeypatch.setattr(ent, "prefill_rows", lambda *a, **k: passes.append("rows") or real_rows(*a, **k))
    longer = e.pool.fetch(e.prompt_tokens(batch[1]), "fp16").cached_tokens
    assert 0 < longer - prefix <= ent.MERGE_SLACK
    got.update({r.id: r for r in e.run_all(batch[1:])})
    assert passes == (["rows"] if pad else ["one", "rows"])
    assert got["m1"].usage.cached_tokens == (prefix if pad else longer)
    assert got["m2"].usage.cached_tokens == got["m3"].usage.cached_tokens == prefix
    for i, r in got.items():
        assert (r.text, r.usage.completion_tokens) == (seq[i].text, seq[i].usage.completion_tokens), i


def test_merged_hits_keep_a_hit_whose_tail_gets_a_pass_of_its_own():
    """A hit is cut back to another prompt's shorter one only where the prompt
    can then share that prompt's pass: its tail after the cut within the prefill
    step (here 8). Prompt 1's would be 14 tokens: it keeps its 10 cached."""
    from mlx_lm.models.cache import KVCache

    from batchgen.engine.entering import _merge_hits

    def cached(n):
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
        return [c]

    prompts = [list(range(9)), list(range(20)), list(range(12))]
    fetched = {0: (cached(6), 6), 1: (cached(10), 10), 2: (cached(9), 9)}
    _merge_hits([0, 1, 2], prompts, fetched, step=8)
    assert {i: n for i, (_, n) in fetched.items()} == {0: 6, 1: 10, 2: 6}
    assert [c[0].offset for c, _ in fetched.values()] == [6, 10, 6]


def test_row_groups_split_by_pass_size(monkeypatch):
    import batchgen.engine.entering as ent
    monkeypatch.setattr(ent, "GROUP_TOKENS", 1000)
    tails = {0: 100, 1: 120, 2: 200, 3: 300, 4: 600}
    # passes dear: the fewest within the bound, then the fewest tokens (not [[0, 1, 2], [3], [4]])
    assert ent._row_groups([0, 1, 2, 3, 4], tails, pad_step=None, pass_cost=10**6) == [[0, 1], [2, 3], [4]]
    # padded: 3 rows count as 4 and 200 tokens as 256 (4 x 256 > 1000)
    assert ent._row_groups([0, 1, 2, 3, 4], tails, pad_step=2048, pass_cost=10**6) == [[0, 1], [2], [3], [4]]
    # passes free: a pass for every length
    assert ent._row_groups([0, 1, 2, 3, 4], tails, pad_step=None, pass_cost=0) == [[0], [1], [2], [3], [4]]


def test_duplicate_and_shared_prompts_entering_together_are_prefilled_once(model_dir, monkeypatch):
    """Three copies of one prompt and three prompts sharing a long block enter in
    one round: the copies take the first one's cache (all tokens cached), the
    block gets one pass of its own; texts as one by one."""
    import batchgen.engine.core as eng
    import batchgen.engine.entering as ent
    block = "Example: def add(a, b):\n    return a + b\n" * 6
    texts = [TEXTS[0]] * 3 + [block + q for q in ("hi", "The quick brown fox", "x = 1")]
    batch = [make_job(t, max_tokens=8, job_id=f"d{i}") for i, t in enumerate(texts)]
    path = model_dir("qwen2")
    seq = {r.id: r for r in engine(path, 1).run_all(batch)}
    passes = []
    real = eng.prefill

    def spy(model, cache, tokens, step_size, pad=False, logits=False):
        passes.append(len(tokens))
        return real(model, cache, tokens, step_size, pad=pad, logits=logits)

    monkeypatch.setattr(eng, "prefill", spy)
    e = engine(path, 8)
    tok = [e.prompt_tokens(j) for j in batch]
    shared = min(ent.common_prefix_len(tok[3], t) for t in tok[4:])
    got = {r.id: r for r in e.run_all(batch)}
    # the block, once; the lone prompt a pass of its own; the three tails rows of one pass
    assert passes == [shared, len(tok[0])]
    assert [got[f"d{i}"].usage.cached_tokens for i in range(6)] == [0, len(tok[0]), len(tok[0])] + [shared] * 3
    for i, r in got.items():
        assert (r.text, r.usage.completion_tokens) == (seq[i].text, seq[i].usage.completion_tokens), i


def test_a_prompt_seen_before_enters_without_a_pass(model_dir, monkeypatch):
    """Its pool hit leaves one token: the batch's next step feeds it, no pass of its own."""
    import batchgen.engine.core as eng
    import batchgen.engine.entering as ent
    batch = [make_job(t, max_tokens=n, job_id=f"r{i}") for i, (t, n) in enumerate(zip(TEXTS[:2] * 2, [6, 9, 7, 5]))]
    path = model_dir("qwen3")
    seq = {r.id: r for r in engine(path, 1).run_all(batch)}
    passes = []
    real_prefill, real_rows = eng.prefill, ent.prefill_rows
    monkeypatch.setattr(eng, "prefill", lambda *a, **k: passes.append("one") or real_prefill(*a, **k))
    monkeypatch.setattr(ent, "prefill_rows", lambda *a, **k: passes.append("rows") or real_rows(*a, **k))
    e = engine(path, 2)
    tokens = [e.prompt_tokens(j) for j in batch]
    got = {r.id: r for r in e.run_all(batch[:2])}
    assert passes == ["rows"]  # the first two, together
    got.update({r.id: r for r in e.run_all(batch[2:])})
    assert passes == ["rows"]  # the repeats: none
    assert [got[f"r{i}"].usage.cached_tokens for i in range(4)] == [0, 0, len(tokens[2]) - 1, len(tokens[3]) - 1]
    for i, r in got.items():
        assert (r.text, r.usage.completion_tokens) == (seq[i].text, seq[i].usage.completion_tokens), i
        assert r.stats.prefill_s > 0


def test_host_copy_of_left_padding_follows_the_caches(model_dir, monkeypatch):
    """Compaction reads the host's copy of each row's left padding (reading the
    device's would drain the step pipeline): it must equal the caches' own."""
    import batchgen.engine.scheduler as batch_mod
    from batchgen.engine.scheduler import BatchScheduler

    monkeypatch.setattr(batch_mod, "_COMPACT_PAD", 2)
    monkeypatch.setattr(batch_mod, "_COMPACT_EVERY", 2)
    path = model_dir("qwen2")
    sched = BatchScheduler(engine(path, 3), 3, kv_budget_bytes=1 << 30)
    checks = []
    real_read = sched._read

    def spy(step):
        checks.append(sched.pads == sched.cache[0].left_padding.tolist())
        return real_read(step)

    sched._read = spy
    seq = {r.id: r.text for r in engine(path, 1).run_all(jobs())}
    assert {r.id: r.text for r in sched.run(jobs())} == seq
    assert len(checks) > 20 and all(checks)


@pytest.mark.parametrize("kv", ["fp16", "turboquant"])
@pytest.mark.parametrize("shrinks", [True, False])
def test_freed_rows_are_emptied_and_the_batch_shrinks_only_where_told(model_dir, kv, shrinks):
    """A freed row that no job takes starts at the write position in every
    layer (its attention reads nothing of the job that left); the batch drops
    its empty rows at the end only where `shrinks` (not on the step kernels'
    path); the texts are the sequential ones either way."""
    from batchgen.engine.scheduler import BatchScheduler

    path = model_dir("qwen2")
    cfg = KVConfig(kind=kv, bits=4)

    def load(batch_size):
        return engine(path, batch_size, pool=False, kv=cfg)

    sched = BatchScheduler(load(3), 3, kv_budget_bytes=1 << 30)
    sched.shrinks = shrinks
    emptied = []
    real_empty = sched._empty_freed

    def spy():
        freed = [i for i in sched.freed if sched.rows[i] is None]
        real_empty()
        if freed and sched.cache[0].write_position:
            emptied.append(all(c.left_padding[i].item() == c.write_position for c in sched.cache for i in freed))

    sched._empty_freed = spy
    seq = {r.id: r.text for r in load(1).run_all(jobs())}
    assert {r.id: r.text for r in sched.run(jobs())} == seq
    assert emptied and all(emptied)
    assert sched.B == (1 if shrinks else 3)


def test_jobs_sharing_a_prefix_enter_together(model_dir, monkeypatch):
    """Interleaved jobs of two system prompts: read ahead and put in prefix
    order, each admission round holds one system prompt's jobs (one shared pass
    each); texts as one by one."""
    from batchgen.engine.scheduler import prefix_key, read_ahead
    from batchgen.jobs import Job

    systems = ["You are terse.", "Answer in French, please, always."]
    batch = [
        Job(id=f"p{i}", line=i + 1, format=NATIVE, max_tokens=4, prompt=None, sampling=SamplingConfig(),
            messages=({"role": "system", "content": systems[i % 2]}, {"role": "user", "content": TEXTS[i]}))
        for i in range(6)
    ]  # fmt: skip
    # "Answer..." before "You...", then by the user text
    assert [j.id for j in read_ahead(iter(batch), 4)] == ["p3", "p1", "p0", "p2"]
    assert prefix_key(batch[1]).startswith("\x1esystem\x1fAnswer")
    path = model_dir("qwen2")
    seq = {r.id: r for r in engine(path, 1).run_all(batch)}
    passes = record_passes(monkeypatch)
    e = engine(path, 3)
    got = {r.id: r for r in e.run_all(batch)}
    assert [p[1] for p in passes] == [3, 3]
    for i, r in got.items():
        assert (r.text, r.usage.completion_tokens) == (seq[i].text, seq[i].usage.completion_tokens), i


def test_step_cache_view():
    """Inside the compiled step: row b's tokens sit at left_padding[b] .. base - 1
    of the big buffers, then in the window's first `used` slots; the new token
    goes to window slot `used`, at position base + used (RoPE's offset minus the
    row's padding)."""
    import mlx.core as mx

    from batchgen.step.compiled import StepCache, capacity_for, held_positions

    assert [capacity_for(n) for n in (1, 256, 257, 600)] == [256, 256, 512, 768]
    assert [held_positions(n) for n in (1, 224, 225, 1000)] == [288, 288, 544, 1312]
    big, window = mx.zeros((2, 1, 4, 2)), mx.zeros((2, 1, 3, 2))
    meta = mx.array([3, 1, 4, 3], mx.int32)  # base 3, one position in the window
    c = StepCache(big, big, window, window, meta, mx.array([0, 2], mx.int32), kernel=False)
    assert c.offset.tolist() == [4, 2]
    assert c.make_mask(1)[:, 0, 0].tolist() == [[True, True, True, False, True, True, False],
                                                  [False, False, True, False, True, True, False]]  # fmt: skip
    k, v = c.update_and_fetch(mx.ones((2, 1, 1, 2)), 2 * mx.ones((2, 1, 1, 2)))
    assert k.shape == (2, 1, 7, 2) and k[:, 0, :, 0].tolist() == [[0, 0, 0, 0, 0, 1, 0]] * 2
    assert c.rvalues[0, 0, 1].tolist() == [2, 2] and c.rvalues[0, 0, 0].tolist() == [0, 0]


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3_5"])
def test_a_pass_evaluated_layer_by_layer_is_the_same_pass(model_dir, arch):
    """`layer_by_layer` (big shared passes on a GPU) evaluates each layer's
    output as it goes: same logits and caches (models that read their layers'
    attributes too), and the layers are put back, also when the pass fails."""
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from batchgen.engine.entering import layer_by_layer, prefill_rows

    model, _ = load(str(model_dir(arch)))
    layers = list(model.model.layers)
    tails = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    runs = []
    for on in (False, True):
        cache = make_prompt_cache(model)
        with layer_by_layer(model, on):
            logits = prefill_rows(model, cache, tails, 4, 4)
        runs.append((logits, [v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)]))
    (a, ca), (b, cb) = runs
    assert mx.array_equal(a, b).item() and len(ca) == len(cb) > 0
    assert all(mx.array_equal(x, y).item() for x, y in zip(ca, cb))
    assert all(x is y for x, y in zip(model.model.layers, layers))
    with pytest.raises(ValueError):
        with layer_by_layer(model, True):
            assert type(model.model.layers[0]).__name__ == "_Evaluated"
            raise ValueError("a failing pass")
    assert all(x is y for x, y in zip(model.model.layers, layers))
