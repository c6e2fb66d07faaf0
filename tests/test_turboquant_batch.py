"""TurboQuant's codes as a continuous batch's KV cache: float32 greedy texts
equal each job's alone over TurboQuant's own cache; the rows hold codes."""

from contextlib import nullcontext

import mlx.core as mx
import pytest

from batchgen.config import DecodeConfig, EngineConfig, KVConfig, PromptCacheConfig, SamplingConfig
from batchgen.cache.turboquant import TurboQuantKVCache
from batchgen.cache.turboquant_rows import TurboQuantBatchLayer, TurboQuantStepCache
from batchgen.engine.core import Engine
from batchgen.kernels import registry
from batchgen.step.compiled import fit_capacity


from test_batch import TEXTS, jobs, record_passes
from test_engine import make_job



def engine(path, batch_size, bits=4, pool=False, prewarm=False, compiled=True):
    cfg = EngineConfig(
        model=str(path), fuse=True, decode=DecodeConfig(draft="none"), batch_size=batch_size,
        kv=KVConfig(kind="turboquant", bits=bits), compiled_batch_step=compiled,
        prompt_cache=PromptCacheConfig(enabled=pool, prewarm=prewarm),
    )  # fmt: skip
    return Engine.load(cfg)


def run(e, items):
    return {r.id: r for r in e.run_all(items)}


def assert_same_texts(got: dict, alone: dict):
    assert sorted(got) == sorted(alone)
    for i, r in got.items():
        assert r.ok, r.error
        assert r.text == alone[i].text, i
        assert r.finish_reason == alone[i].finish_reason
        assert r.stats.kv_cache == "turboquant"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("bits,batch_size", [(4, 3), (3, 8)])
def test_batched_greedy_equals_turboquant_alone(model_dir, arch, bits, batch_size):
    path = model_dir(arch)
    alone = run(engine(path, 1, bits), jobs())
    batched = engine(path, batch_size, bits)
    got = run(batched, jobs())
    assert batched.batch_report["rows"] == batch_size and batched.batch_report["step"] == "compiled"
    assert_same_texts(got, alone)


def test_long_rows_cross_windows_sinks_and_capacities(model_dir):
    """Rows of 1-2 prompt tokens (their sinks written from the window), rows
    that outgrow the buffers and refill the window many times, a long prompt
    entering beside short rows (left growth) and padding cut when it leaves."""
    from batchgen.engine.scheduler import BatchScheduler

    path = model_dir("qwen2")
    items = [make_job(prompt="a", max_tokens=300, job_id="one-token"),
             make_job(TEXTS[5], max_tokens=40, job_id="short"),
             make_job(TEXTS[1] * 12, max_tokens=30, job_id="long-in"),
             make_job(prompt="hi", max_tokens=120, job_id="two-tokens")]  # fmt: skip
    alone = run(engine(path, 1), items)
    sched = BatchScheduler(engine(path, 2), 2, kv_budget_bytes=1 << 40)
    capacities = []
    real = sched._forward

    def spy(inputs):
        out = real(inputs)
        capacities.append(sched.cache[0].key_codes.shape[2])
        return out

    sched._forward = spy
    got = {r.id: r for r in sched.run(items)}
    assert_same_texts(got, alone)
    assert len(set(capacities)) >= 2


def test_prewarmed_pool_and_seeded_samples(model_dir):
    """Rows entering from the pool's TurboQuant slots (prewarmed system prompt),
    sampled with per-job seeds: the same as alone."""
    path = model_dir("llama")
    s = SamplingConfig(temperature=0.9, top_p=0.95, seed=5)
    items = [make_job(t, max_tokens=12, job_id=f"s{i}", sampling=s) for i, t in enumerate(TEXTS)]
    items = [make_job(TEXTS[0], max_tokens=12, job_id="greedy")] + items
    e1, e4 = engine(path, 1, pool=True, prewarm=True), engine(path, 4, pool=True, prewarm=True)
    for e in (e1, e4):
        e.prewarm("You are terse.", "test")
    got, alone = run(e4, [_with_system(j) for j in items]), run(e1, [_with_system(j) for j in items])
    assert_same_texts(got, alone)
    assert all(r.usage.cached_tokens > 0 for r in got.values())


@pytest.mark.parametrize("pad,pool", [(False, False), (True, False), (True, True)])
def test_entering_rows_share_one_prompt_pass(model_dir, monkeypatch, pad, pool):
    """TurboQuant rows entering together are rows of one prompt pass (right-
    padded: where passes are padded, far past the cache's trim reserve), after
    the prewarmed system prompt where there is one: texts as alone."""
    path = model_dir("qwen2")
    items = [_with_system(j) for j in jobs()] if pool else jobs()
    passes = record_passes(monkeypatch)
    e1, e8 = engine(path, 1, pool=pool, prewarm=pool), engine(path, 8, pool=pool, prewarm=pool)
    e8.pad_prompts = pad
    if pool:
        for e in (e1, e8):
            e.prewarm("You are terse.", "test")
    alone = run(e1, items)
    got = run(e8, items)
    assert len(passes) == 1 and passes[0][:2] == (8 if pad else 7, 7)
    assert_same_texts(got, alone)
    assert all((r.usage.cached_tokens > 0) == pool for r in got.values())


def test_entering_rows_prefill_a_shared_block_once(model_dir, monkeypatch):
    """Entering prompts that share a block beyond any cached prefix: the block
    is one pass of its own, their tails rows of one pass after it; as alone."""
    path = model_dir("llama")
    items = [make_job(TEXTS[3] + t, max_tokens=10, job_id=f"b{i}") for i, t in enumerate(TEXTS[:4])]
    passes = record_passes(monkeypatch)
    alone = run(engine(path, 1), items)
    b4 = engine(path, 4)
    got = run(b4, items)
    assert len(passes) == 1 and passes[0][1] == 4
    assert passes[0][3] >= 32  # the rows start after the shared block (SHARED_MIN tokens or more)
    assert_same_texts(got, alone)


def test_a_row_entering_alone_takes_a_padded_pass(model_dir, monkeypatch):
    """Where passes are padded, a TurboQuant row entering alone is a pass of one
    row padded as the shared passes are (not a pass at its own length); texts
    as alone."""
    import batchgen.engine.core as eng
    path = model_dir("qwen2")
    passes = record_passes(monkeypatch)
    e1, e2 = engine(path, 1), engine(path, 2)
    e2.pad_prompts = True
    lengths = {len(e2.prompt_tokens(j)) for j in jobs()}
    alone = run(e1, jobs())
    got = run(e2, jobs())
    singles = [length for rows, tails, length, _ in passes if tails == 1]
    assert singles and all(n in {eng.padded_length(m, 2048) for m in lengths} for n in singles)
    assert any(n not in lengths for n in singles)  # padded past the prompt
    assert_same_texts(got, alone)


def _with_system(job):
    from dataclasses import replace

    return replace(job, messages=({"role": "system", "content": "You are terse."},) + job.messages)


def test_rows_hold_codes_not_fp16(model_dir):
    """The batch's per-token bytes and a job's kv_bytes at 4 bits: at most 0.30x
    fp16's (codes and scales; the exact sinks, tail and window per row aside)."""
    path = model_dir("qwen2")
    e = engine(path, 3)
    fp16_token, fp16_row = e.kv_bytes_per_token(KVConfig())
    tq_token, tq_row = e.kv_bytes_per_token(KVConfig(kind="turboquant", bits=4))
    assert fp16_row == 0 and tq_row > 0
    assert tq_token <= 0.30 * fp16_token
    got = run(e, jobs())
    for r in got.values():
        tokens = r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.stats.kv_bytes == tokens * tq_token + tq_row
    # what the layers hold after a run: codes over every column, the per-row exact parts
    from batchgen.engine.scheduler import BatchScheduler

    sched = BatchScheduler(e, 3, kv_budget_bytes=1 << 40)
    list(sched.run(jobs()[:3]))
    layer = sched.cache[0]
    assert layer.key_codes.dtype == mx.uint32 and layer.tail_keys.shape[2] == layer.layout.window - 1


def test_a_step_that_cannot_be_recorded_steps_unrecorded(model_dir, monkeypatch, caplog):
    import logging

    import batchgen.step.compiled as cs
    path = model_dir("qwen2")
    alone = run(engine(path, 1), jobs())
    real = cs.make_step

    def unrecordable(model, sample_rows, kernel, own_forward=True, kinds=None, compiled=True):
        step = real(model, sample_rows, kernel, own_forward, kinds, compiled)
        if not compiled:
            return step

        def fail(*args):
            raise ValueError("cannot record this model")

        return fail

    monkeypatch.setattr(cs, "make_step", unrecordable)
    e = engine(path, 3)
    with caplog.at_level(logging.INFO, logger="batchgen"):
        got = run(e, jobs())
    assert "compiled step unavailable (ValueError: cannot record this model)" in caplog.text
    assert e.batch_report["step"] == "unrecorded"
    assert_same_texts(got, alone)


@pytest.mark.parametrize("kernel,trimmed", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("bits", [4, 3])
def test_step_attention_reads_what_a_cache_alone_reads(bits, kernel, trimmed):
    """Two rows (3 prompt tokens: sinks still filling; 37: codes, sinks and a
    full window) placed in a batch layer, stepped 20 times through the window
    (two flushes into the codes): each row's attention output is its own
    `TurboQuantKVCache`'s (float32; on CUDA the cache alone takes its own
    one-kernel step, hence the tolerance). `kernel`: the batch's step kernel,
    fed the token as from the model's attention and as from `step_forward`'s
    fused projection (on a CPU its reference standing in), else its ops.
    `trimmed`: the long row's cache was cut
    back 20 positions (as a pool hit is), its exact copies of the window's
    older positions gone: alone it reads their codes, in the batch its tail."""
    with registry.using("standin") if kernel and not registry.available() else nullcontext():
        rows_against_caches_alone(bits, kernel, trimmed)


def rows_against_caches_alone(bits, kernel, trimmed):
    mx.random.seed(0)
    H, G, D, steps, lengths = 2, 3, 64, 20, (3, 37)
    scale = D**-0.5
    keys = mx.random.normal((2, H, 37 + steps, D))
    values = mx.random.normal((2, H, 37 + steps, D))
    queries = mx.random.normal((2, H * G, steps, D))
    layer, alone = TurboQuantBatchLayer(2), []
    layer.write_position = 40
    for b, n in enumerate(lengths):
        c = TurboQuantKVCache(bits, seed=7)
        c.routed = False  # a prefill without the attention hook
        extra = 20 if trimmed and n > 3 else 0
        c.update_and_fetch(keys[b : b + 1, :, : n + extra], values[b : b + 1, :, : n + extra])
        c.trim(extra)
        assert (c.recent_keys is None) == bool(extra)
        c.routed = True
        layer.place(b, c, n, 2)
        alone.append(c)
    window = layer.layout.window
    rk, rv, used = mx.zeros((2, H, window, D)), mx.zeros((2, H, window, D)), 0
    for t in range(steps):
        if used == window:
            fit_capacity([layer])
            layer.write_window(rk, rv, used)
            used = 0
        fit_capacity([layer])
        meta = mx.array([layer.write_position, used, layer.key_codes.shape[2], window], mx.int32)
        args = (layer.layout, layer.step_arrays(), rk, rv, meta, layer.left_padding, {}, kernel)
        step = TurboQuantStepCache(*args)
        k = mx.stack([keys[b, :, n + t] for b, n in enumerate(lengths)])[:, :, None]
        v = mx.stack([values[b, :, n + t] for b, n in enumerate(lengths)])[:, :, None]
        q = queries[:, :, t : t + 1]
        step.update_and_fetch(k, v)
        assert (step.new is not None) == kernel
        got = step.attention(q, scale=scale)
        if kernel:
            fused = TurboQuantStepCache(*args)
            heads = mx.concatenate([q, k, v], axis=1)
            assert fused.takes_kernel(heads)
            fused_out = fused.fused_attention(heads, heads, scale)
            assert mx.array_equal(fused_out, got.reshape(fused_out.shape)).item()
            assert mx.array_equal(fused.rkeys, step.rkeys).item() and mx.array_equal(fused.rvalues, step.rvalues).item()
        rk, rv, used = step.rkeys, step.rvalues, used + 1
        for b, c in enumerate(alone):
            c.update_and_fetch(k[b : b + 1], v[b : b + 1])
            want = c.attention(queries[b : b + 1, :, t : t + 1], scale=scale)
            assert mx.allclose(got[b : b + 1], want, atol=2e-5, rtol=1e-4).item(), (bits, b, t)
        assert step.offset.tolist() == [n + t for n in lengths]


@pytest.mark.parametrize("trimmed", [False, True])
def test_placing_decodes_only_positions_without_recent_copies(monkeypatch, trimmed):
    """A job's tail comes from its recent exact copies; only where a trim
    dropped them are codes decoded (for those positions alone), and the tail
    is the same either way as its own cache's exact parts and decoded codes."""
    from batchgen.cache import turboquant_rows as T
    from batchgen.cache.turboquant import TurboQuantKVCache

    decoded = []
    real = T.dequantize
    monkeypatch.setattr(T, "dequantize", lambda codes, *a: decoded.append(codes.shape[2]) or real(codes, *a))
    mx.random.seed(1)
    n, extra = 37, 20 if trimmed else 0
    kv = mx.random.normal((1, 2, n + extra, 64))
    c = TurboQuantKVCache(4, seed=3)
    c.update_and_fetch(kv, kv * 0.5)
    c.trim(extra)
    layer = T.TurboQuantBatchLayer(1)
    layer.write_position = 40
    layer.place(0, c, n, 1)
    lay = layer.layout
    assert decoded == ([lay.tail, lay.tail] if trimmed else [])  # keys, values
    cols = slice(n - lay.tail - lay.sink_tokens, n - lay.sink_tokens)
    want = (real(c.key_codes[:, :, cols], c.key_norms[:, :, cols], lay.key_bits, T.rotation(64, 3), mx.float32)
            if trimmed else c.recent_keys[:, :, -lay.tail :])  # fmt: skip
    assert mx.array_equal(layer.tail_keys, want).item()


def test_failing_job_fails_alone(model_dir):
    path = model_dir("qwen2", max_position_embeddings=40)
    items = jobs()
    items.insert(2, make_job("long " * 60, max_tokens=5, job_id="too-long"))
    alone, got = run(engine(path, 1), items), run(engine(path, 3), items)
    assert got["too-long"].error.type == "prompt_too_long"
    assert {i for i, r in got.items() if not r.ok} == {i for i, r in alone.items() if not r.ok}
    ok = {i for i, r in alone.items() if r.ok}
    assert len(ok) >= 3
    assert_same_texts({i: got[i] for i in ok}, {i: alone[i] for i in ok})


@pytest.mark.parametrize("short", [0, 1])
def test_budget_counts_codes_and_exact_parts(model_dir, short):
    """A budget of the step's buffers for all four rows of the longest job in
    TurboQuant's bytes (codes a position, the exact parts a row) runs rows
    together, where fp16 bytes would allow one at a time; a byte less, one at
    a time."""
    from batchgen.engine.scheduler import BatchScheduler
    from batchgen.step.compiled import held_positions

    path = model_dir("qwen2")
    e = engine(path, 4)
    longest = max(len(e.prompt_tokens(j)) + j.max_tokens for j in jobs())
    per_token, per_row = e.kv_bytes_per_token(KVConfig(kind="turboquant", bits=4))
    budget = 4 * (held_positions(longest) * per_token + per_row) - short
    assert budget < 4 * held_positions(longest) * e.kv_bytes_per_token()[0]
    sched = BatchScheduler(e, 4, kv_budget_bytes=budget)
    live = []
    real_read = sched._read

    def spy(step):
        live.append(sched.live)
        return real_read(step)

    sched._read = spy
    assert_same_texts({r.id: r for r in sched.run(jobs())}, run(engine(path, 1), jobs()))
    assert max(live) == (1 if short else 4)
