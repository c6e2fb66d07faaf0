"""TurboQuant's step type (cache/turboquant_step.py): a one-token decode step as one
kernel over a window of slots.

The kernel (the `tq_step` op, kernels/turboquant.py) runs only on CUDA. Its reference
is the same contract as plain ops (encode the new token into its slot, attend over
sinks + codes + exact window by the reading rule), so on the CPU the cache's bookkeeping
around the kernel (entering, window flushes and shifts, leaving for trims, chunks and
state) runs with the reference standing in for the kernel (`registry.using("standin")`)
and is checked against the base type's ops path; on CUDA the kernel itself is checked
against the reference (tests/test_kernel_registry.py and below).
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from batchgen.cache import turboquant as tq
from batchgen.cache import turboquant_attention as tqa
from batchgen.cache.factory import make_turboquant_cache
from batchgen.cache.turboquant_step import TurboQuantStepKVCache
from batchgen.kernels import registry
from batchgen.kernels import turboquant as kernels

from test_turboquant import kv, random_tokens, teacher_forced_logits

STEP = kernels.STEP


@pytest.fixture
def step_on_cpu():
    """Step mode on this CPU, the references standing in for the step and encode kernels."""
    if registry.available():
        pytest.skip("the GPU runs the real kernel (test_step_kernel_matches_reference)")
    with registry.using("standin", "tq_step", "tq_encode"):
        yield


# Head dims the step kernel takes (64, 128, 256): the tiny models' own are 16.
STEP_SHAPES = {"qwen3": {"head_dim": 64}, "llama": {"hidden_size": 256}}


def drive(cache, schedule, k, v, q):
    """Feed chunks ("trim", n) or n tokens; attention for each; outputs in order."""
    start, outs = 0, []
    for item in schedule:
        if isinstance(item, tuple):
            cache.trim(item[1])
            start -= item[1]
            continue
        cache.update_and_fetch(k[:, :, start : start + item], v[:, :, start : start + item])
        mask = "causal" if item > 1 else None
        outs.append(cache.attention(q[:, :, start : start + item], scale=0.125, mask=mask))
        start += item
    return outs


def same_stored(a, b):
    a._settle()
    b._settle()
    assert a.offset == b.offset
    n = a._n_coded
    for x, y in ((a.key_codes, b.key_codes), (a.value_codes, b.value_codes),
                 (a.key_norms, b.key_norms), (a.value_norms, b.value_norms)):  # fmt: skip
        assert mx.array_equal(x[:, :, :n], y[:, :, :n])
    for x, y in ((a.recent_keys, b.recent_keys), (a.recent_values, b.recent_values),
                 (a.sink_keys, b.sink_keys)):  # fmt: skip
        assert (x is None and y is None) or mx.array_equal(x, y)


SCHEDULES = {
    # 90 steps cross the 44-slot window twice (8 - 1 + 5 kept + 32 new, with a reserve of 5).
    "steps": [40] + [1] * 90,
    # prompt-lookup: verify chunks and trims between steps, a trim past the reserve.
    "pld": [30] + [1] * 20 + [6, ("trim", 4)] + [1] * 40 + [5, ("trim", 9)] + [1] * 30,
    "short prompt": [3] + [1] * 60,
    # trims straight out of step mode, within and past the reserve, then steps again.
    "trim after steps": [30] + [1] * 20 + [("trim", 3)] + [1] * 50 + [("trim", 8)] + [1] * 10,
}


# The engine's jobs keep copies for trims (a reserve); a cache made outside it keeps none.
@pytest.mark.parametrize("options", [{"trim_reserve": 5}, {}, {"sink_tokens": 0, "trim_reserve": 5}, {"window": 1},
                                     {"bits": 3, "trim_reserve": 5}])  # fmt: skip
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_step_mode_matches_the_ops_path(step_on_cpu, name, options):
    schedule = SCHEDULES[name]
    total = sum(x for x in schedule if isinstance(x, int))
    k, v = kv(total, 21)
    q = mx.random.normal((1, 4, total, 64), key=mx.random.key(22))
    stepped = TurboQuantStepKVCache(routed=True, **options)
    plain = tq.TurboQuantKVCache(routed=True, **options)
    got = drive(stepped, schedule, k, v, q)
    assert stepped._win is not None  # it ended in step mode
    want = drive(plain, schedule, k, v, q)
    for i, (x, y) in enumerate(zip(got, want)):
        assert mx.allclose(x, y, atol=1e-5), (i, mx.abs(x - y).max())
    same_stored(stepped, plain)


def test_verify_passes_run_as_step_launches_and_trims_keep_the_window(step_on_cpu, monkeypatch):
    """A 6-token pass is one launch of the step (not the ops path), a 12-token pass two
    (the window, 8, then 4); a trim that stays inside the window keeps step mode; one
    past the window's first slot settles. The outputs are checked against the ops path
    by the schedules above."""
    launches = []
    real = STEP.kernel_form
    monkeypatch.setattr(STEP, "kernel_form", lambda *a, **kw: launches.append(a[0].shape[2]) or real(*a, **kw))
    k, v = kv(100, 7)
    q = mx.random.normal((1, 4, 100, 64), key=mx.random.key(8))
    c = TurboQuantStepKVCache(4, routed=True)
    drive(c, [30] + [1] * 5, k, v, q)
    assert launches == [1] * 5 and c._win is not None
    drive(c, [6], k[:, :, 35:], v[:, :, 35:], q[:, :, 35:])
    assert launches[5:] == [6] and c.offset == 41
    c.trim(4)
    assert c._win is not None and c.offset == 37 and c._win_n == 37 - c._win_r0
    drive(c, [12], k[:, :, 37:], v[:, :, 37:], q[:, :, 37:])
    assert launches[6:] == [8, 4] and c.offset == 49 and c._win is not None
    c.trim(8)
    deep = 41 - c._win_r0 + 1  # past the window's first slot
    c.trim(deep)
    assert c._win is None and c.offset == 41 - deep


def test_step_mode_counts_its_window_and_settles_for_state(step_on_cpu):
    k, v = kv(60, 3)
    q = mx.random.normal((1, 4, 60, 64), key=mx.random.key(4))
    c = TurboQuantStepKVCache(4, routed=True)
    drive(c, [20] + [1] * 40, k, v, q)
    assert c._win is not None and c.recent_keys is None
    assert c.nbytes == sum(a.nbytes for a in (c.sink_keys, c.sink_values, c.key_codes, c.key_norms,
                                              c.value_codes, c.value_norms, *c._win))  # fmt: skip
    restored = TurboQuantStepKVCache.from_state(c.state)  # settles first
    assert c._win is None and c.recent_keys.shape[2] == c._recent_capacity
    assert restored.offset == 60
    for x, y in zip(restored.keys_and_values(), c.keys_and_values()):
        assert mx.array_equal(x, y)


def test_prefill_encodes_with_the_step_encoder_at_every_bit_width(step_on_cpu, monkeypatch):
    """Keys at 5 bits too: a token's codes never depend on which path stored it."""
    widths = []
    real = kernels.ENCODE.reference
    monkeypatch.setattr(kernels.ENCODE, "reference", lambda x, bits, rot: widths.append(bits) or real(x, bits, rot))
    c = tq.TurboQuantKVCache(4)
    c.update_and_fetch(*kv(20, 1))
    assert sorted(widths) == [3, 5]


def test_step_handed_over_but_never_attended_goes_the_ordinary_way(step_on_cpu):
    k, v = kv(30, 5)
    c = TurboQuantStepKVCache(4, routed=True)
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    c.attention(mx.zeros((1, 4, 20, 64)), scale=0.125, mask="causal")
    c.update_and_fetch(k[:, :, 20:21], v[:, :, 20:21])  # step mode: handed over
    assert c._step_new is not None
    c.update_and_fetch(k[:, :, 21:22], v[:, :, 21:22])  # no attention came
    assert not c.routed and c._step_new is None and c.offset == 22
    plain = tq.TurboQuantKVCache(4)
    plain.update_and_fetch(k[:, :, :22], v[:, :, :22])
    same_stored(c, plain)


def test_model_decodes_the_same_in_step_mode(step_on_cpu, model_dir):
    """Through the attention hook, grouped-query heads, every layer: float32 logits of
    a teacher-forced decode equal the ops path's."""
    model, _ = mlx_lm.load(str(model_dir("qwen3", **STEP_SHAPES["qwen3"])))
    tokens = random_tokens(120, seed=5)
    cache = make_turboquant_cache(model, 4)
    stepped = teacher_forced_logits(model, tokens, cache, 30)
    assert all(isinstance(c, TurboQuantStepKVCache) and c._win is not None for c in cache)
    with registry.using("reference", "tq_step"):
        plain_cache = make_turboquant_cache(model, 4)
        plain = teacher_forced_logits(model, tokens, plain_cache, 30)
    assert not any(isinstance(c, TurboQuantStepKVCache) for c in plain_cache)
    assert mx.allclose(stepped, plain, atol=1e-4), mx.abs(stepped - plain).max()


@pytest.mark.parametrize("options", [{"trim_reserve": 5}, {}, {"sink_tokens": 0, "trim_reserve": 5}, {"window": 1}])
@pytest.mark.parametrize("name", ["pld", "short prompt"])
def test_flash_multi_query_passes_match_the_blocked_path(step_on_cpu, monkeypatch, name, options):
    """Prefill chunks and prompt-lookup verify passes (with trims) as one masked
    mx.fast attention call each, between step-mode steps: the blocked path's outputs
    within float32 rounding, the same codes stored."""
    schedule = SCHEDULES[name]
    total = sum(x for x in schedule if isinstance(x, int))
    k, v = kv(total, 23)
    q = mx.random.normal((1, 4, total, 64), key=mx.random.key(24))
    outs = {}
    for flash in (True, False):
        cache = TurboQuantStepKVCache(fused_prefill=flash, routed=True, **options)
        outs[flash] = (drive(cache, schedule, k, v, q), cache)
    for i, (x, y) in enumerate(zip(outs[True][0], outs[False][0])):
        assert mx.allclose(x, y, atol=1e-5), (i, mx.abs(x - y).max())
    same_stored(outs[True][1], outs[False][1])
    assert tqa._FUSED_MASK[0] is None  # every schedule ends decoding: the prefill's mask is let go


@pytest.mark.skipif(registry.available(), reason="float32 exactness is a CPU claim (CUDA: the bf16 test below)")
def test_model_prefills_the_same_through_flash(monkeypatch, model_dir):
    """A tiny qwen3 (grouped heads, every layer): float32 logits of a chunked prefill
    and teacher-forced decode equal the blocked path's."""
    model, _ = mlx_lm.load(str(model_dir("qwen3")))
    tokens = random_tokens(100, seed=6)
    logits = {}
    for flash in (True, False):
        cache = make_turboquant_cache(model, 4, fused_prefill=flash)
        first = model(tokens[None, :40], cache=cache)[0]
        rest = teacher_forced_logits(model, tokens[40:], cache, 25)
        logits[flash] = mx.concatenate([first, rest])
    assert mx.allclose(logits[True], logits[False], atol=1e-4), mx.abs(logits[True] - logits[False]).max()

# ---------------------------------------------------------------------------
# CUDA: the kernels against the reference

cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("heads,dim,n,dtype", [((14, 2), 64, 700, mx.float32), ((28, 4), 128, 3000, mx.float32),
                                               ((7, 1), 128, 300, mx.bfloat16),
                                               ((32, 2), 64, 900, mx.float32),  # 16 query heads a kv head
                                               ((8, 2), 256, 500, mx.float32),
                                               ((2, 1), 64, 40000, mx.float32),  # 105 chunks: the merge in 4 passes
                                               ((8, 4), 32, 300, mx.float32),  # the demo model's heads
                                               ((2, 1), 32, 5000, mx.float32)])  # 79 chunks of 64 # fmt: skip
def test_step_kernel_matches_reference(heads, dim, n, dtype):
    """Many steps (window shifts, chunk splits), kernel vs reference on the same
    cache state each step: outputs within float32 rounding (2e-4; 2e-3 at D = 128, where
    the coded positions' products take fp16 operands on tensor cores; bf16: 2e-2),
    windows equal."""
    tol = 2e-2 if dtype == mx.bfloat16 else (2e-3 if dim == 128 else 2e-4)
    for t, c, out, want, want_window in kernel_steps(heads, dim, n, 80, dtype):
        err = mx.abs(out.astype(mx.float32) - want.astype(mx.float32)).max().item()
        assert err <= tol * max(1.0, mx.abs(want).max().item()), (t, err)
        slot = t - c._win_r0
        assert mx.array_equal(c._win[0][:, :, : slot + 1], want_window[0][:, :, : slot + 1]), t


def test_kernel_steps_hands_the_reference_what_the_step_got(step_on_cpu):
    """The helper below on this CPU, the reference standing in for the kernel: a step
    each position, each output the reference's on the arguments the step got."""
    seen = [(t, mx.array_equal(out, want).item()) for t, _, out, want, _ in kernel_steps((4, 2), 64, 50, 5, mx.float32)]
    assert seen == [(t, True) for t in range(50, 55)]


def kernel_steps(heads: tuple, dim: int, n: int, steps: int, dtype):
    """A TurboQuant cache of n random positions in step mode, then `steps` decode
    steps through the kernel: (t, cache, output, reference output, reference window)
    a step, the reference run on the arguments the kernel got."""
    n_heads, kv_heads = heads
    total = n + steps
    k, v = kv(total, 31, heads=kv_heads, dim=dim, dtype=dtype)
    q = mx.random.normal((1, n_heads, total, dim), key=mx.random.key(32)).astype(dtype)
    c = TurboQuantStepKVCache(4, routed=True)
    c.update_and_fetch(k[:, :, :n], v[:, :, :n])
    c.attention(q[:, :, n - 1 :], scale=dim**-0.5, mask=None)  # consumes the chunk
    for t in range(n, total):
        c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        calls = []
        STEP.kernel_form = lambda *a, form=STEP.kernel_form, **kw: calls.append(a) or form(*a, **kw)
        try:
            out = c.attention(q[:, :, t : t + 1], scale=dim**-0.5, mask=None)
        finally:
            del STEP.kernel_form  # the method again
        yield (t, c, out, *STEP.reference(*calls[0]))


@cuda
@pytest.mark.parametrize("reserve", [0, 12])  # a cache's default; the engine's on a GPU, 2 x (5 + 1)
@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("name", ["pld", "trim after steps"])
def test_step_kernel_passes_and_trims_match_the_ops_path(name, dim, reserve):
    """The real kernel through verify passes as step launches and trims inside the
    window: the ops path's outputs within float32 rounding (2e-4 of the largest; 2e-3
    at D = 128, fp16 tensor-core operands)."""
    schedule = SCHEDULES[name]
    total = sum(x for x in schedule if isinstance(x, int))
    k, v = kv(total, 51, dim=dim)
    q = mx.random.normal((1, 4, total, dim), key=mx.random.key(52))
    got = drive(TurboQuantStepKVCache(routed=True, trim_reserve=reserve), schedule, k, v, q)
    want = drive(tq.TurboQuantKVCache(routed=True, trim_reserve=reserve), schedule, k, v, q)
    tol = 2e-3 if dim == 128 else 2e-4
    for i, (x, y) in enumerate(zip(got, want)):
        err = mx.abs(x - y).max().item()
        assert err <= tol * max(1.0, mx.abs(y).max().item()), (i, err)


@cuda
@pytest.mark.parametrize("heads,dim", [((14, 2), 64), ((28, 4), 128)])
def test_flash_on_cuda_matches_the_blocked_path(heads, dim):
    """bf16 prefill chunks and a verify pass through cuDNN's fused attention: the
    blocked path's outputs within bf16 rounding (2e-2 of the largest)."""
    n_heads, kv_heads = heads
    schedule = [1500, 700, 1, 6, ("trim", 3), 300]
    total = sum(x for x in schedule if isinstance(x, int))
    k, v = kv(total, 41, heads=kv_heads, dim=dim, dtype=mx.bfloat16)
    q = mx.random.normal((1, n_heads, total, dim), key=mx.random.key(42)).astype(mx.bfloat16)
    outs = {}
    for flash in (None, False):
        cache = TurboQuantStepKVCache(4, fused_prefill=flash, routed=True)
        outs[flash] = drive(cache, schedule, k, v, q)
    for i, (x, y) in enumerate(zip(outs[None], outs[False])):
        err = mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max().item()
        assert err <= 2e-2 * max(1.0, mx.abs(y).max().item()), (i, err)


def test_step_meta_follows_the_fields(monkeypatch):
    """Steps that move fields by 0 or 1 derive the array on the device; any other
    change makes a new one; the values are the fields either way."""
    monkeypatch.setattr(kernels, "_last_meta", [None, None])
    made = []
    real_array = mx.array
    monkeypatch.setattr(kernels.mx, "array", lambda *a, **k: made.append(a[0]) or real_array(*a, **k))
    seq = [(5, 4, 256, 5, 0, 1, 5, 44, 4, 128), (6, 4, 256, 5, 0, 1, 6, 44, 4, 128), (7, 4, 256, 5, 0, 1, 6, 44, 4, 128),
           (7, 4, 256, 5, 0, 1, 6, 44, 4, 128), (40, 4, 256, 37, 35, 1, 37, 44, 4, 128), (41, 4, 256, 37, 35, 1, 38, 44, 4, 128)]
    got = [kernels.step_meta(f) for f in seq]
    for fields, meta in zip(seq, got):
        assert np.array(meta).tolist() == list(fields)
    assert got[3] is got[2]
    fresh = [m for m in made if m in seq]  # not the deltas (0 / 1 constants)
    assert fresh == [seq[0], seq[4]]  # the rest moved by 0 or 1


@pytest.mark.parametrize("dim,tile", [(32, 64), (64, 128), (128, 256), (256, 256)])
def test_step_chunks_cover_the_positions_in_at_most_a_tile_of_chunks(dim, tile):
    for positions in (1, 127, 128, 129, 1000, 8192, 32768, 40000, 10**6):
        for rows in (1, 2, 3, 4, 28, 600):
            chunks, span = kernels.step_chunks(positions, rows, dim)
            assert span % tile == 0
            assert (chunks - 1) * span < positions <= chunks * span
            assert chunks <= tile  # the merge: NT / 32 passes of a lane a chunk; weights in the score tile
            if rows * -(-positions // tile) <= kernels.STEP_BLOCKS and positions <= tile * tile:
                assert span == tile  # a tile a block while that stays within STEP_BLOCKS


@pytest.mark.parametrize("rows", [1, 2, 4, 28])
def test_step_counters_are_a_fresh_zeroed_buffer_above_mlx_small_pool(rows):
    """The kernel's block counters: zeros, one a row at least, more than 8 bytes (MLX
    puts arrays of at most 8 in managed memory, where the kernel's atomics made the step
    4.5x slower on the H200), a new array for each owner."""
    counters = kernels.step_counters(rows)
    assert counters.dtype == mx.uint32 and counters.size >= rows and counters.nbytes >= 64
    assert np.array(counters).tolist() == [0] * counters.size
    assert kernels.step_counters(rows) is not counters


def test_each_step_window_launches_with_counters_of_its_own(step_on_cpu, monkeypatch):
    """Every launch of one cache's window passes that window's counters, and two caches
    hold different ones: MLX orders a CUDA graph's kernels only by what they write, so
    two caches' steps in one evaluation may run at once, and a shared set let their
    blocks miscount (2.6e38 on the H200)."""
    seen = []
    real = STEP.kernel_form
    monkeypatch.setattr(STEP, "kernel_form", lambda *a, counters=None: seen.append(counters) or real(*a))
    k, v = kv(60, 5)
    q = mx.random.normal((1, 4, 60, 64), key=mx.random.key(6))
    caches = [TurboQuantStepKVCache(4, routed=True) for _ in range(2)]
    for c in caches:
        drive(c, [20, 1, 6, ("trim", 3), 1], k, v, q)
    mine = [c._counters for c in caches]
    assert len(seen) == 6 and all(x is not None for x in seen)  # a step, a 6-token pass, a step each
    assert all(x is mine[0] for x in seen[:3]) and all(x is mine[1] for x in seen[3:]) and mine[0] is not mine[1]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pld_and_the_pool_compose_with_step_mode(step_on_cpu, monkeypatch, model_dir, arch):
    """Prompt-lookup verify passes and trims between steps, and pooled TurboQuant
    slots: the same greedy texts as TurboQuant alone, in step mode (float32)."""
    from test_compose import tq_engine
    from test_engine import make_job
    from test_pld import LOOPY
    from test_prompt_cache import JOBS, SYSTEM

    steps = []
    real = STEP.reference
    monkeypatch.setattr(STEP, "reference", lambda *a, **kw: steps.append(1) or real(*a, **kw))
    path = model_dir(arch, **STEP_SHAPES[arch])
    plain, fast, pooled = tq_engine(path), tq_engine(path, draft="pld"), tq_engine(path, pool=True)
    drafted = 0
    for text in LOOPY[:3]:
        a, b = plain.run(make_job(text, max_tokens=40)), fast.run(make_job(text, max_tokens=40))
        assert a.ok and b.ok and b.text == a.text, (arch, text)
        drafted += b.stats.pld_drafted
    pooled.prewarm(SYSTEM, "test")
    hits = 0
    for job in JOBS[:3]:
        a, b = plain.run(job), pooled.run(job)
        assert b.text == a.text, (arch, job.id)
        hits += b.usage.cached_tokens
    assert drafted > 0 and hits > 0 and len(steps) > 100
