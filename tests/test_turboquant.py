"""TurboQuant's cache (cache/turboquant.py): protocol, its attention against the reading
rule's reference (turboquant/reference.py), state, and model-level quality (CPU, float32).
The codec's tests: test_turboquant_codec.py."""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from batchgen.cache import turboquant as tq
from batchgen.cache import turboquant_attention as tqa
from batchgen.cache.factory import make_turboquant_cache
from batchgen.transforms.attention import route_attention, unroute_attention
from batchgen.turboquant import reference
from batchgen.turboquant.codec import packed_words, rotation

from tiny import ARCHS

# --------------------------------------------------------------------------------------
# Cache protocol
# --------------------------------------------------------------------------------------


def kv(length, seed, heads=2, dim=64, dtype=mx.float32):
    k = mx.random.normal((1, heads, length, dim), key=mx.random.key(seed))
    v = mx.random.normal((1, heads, length, dim), key=mx.random.key(seed + 1000))
    return k.astype(dtype), v.astype(dtype)


def test_update_and_fetch_shapes_dtype_offset():
    c = tq.TurboQuantKVCache(4)
    assert c.empty() and c.offset == 0 and c.nbytes == 0
    k, v = kv(10, 0, dtype=mx.float16)
    fk, fv = c.update_and_fetch(k, v)
    assert fk.shape == fv.shape == (1, 2, 10, 64) and fk.dtype == mx.float16
    # The chunk itself comes back exact (its queries read it within their window)...
    assert mx.array_equal(fk, k) and mx.array_equal(fv, v)
    k2, v2 = kv(1, 1, dtype=mx.float16)
    fk, fv = c.update_and_fetch(k2, v2)
    assert fk.shape == (1, 2, 11, 64) and c.offset == 11 and not c.empty()
    # ...and so do the window - 1 tokens before a new token; older ones are decoded.
    assert mx.array_equal(fk[:, :, -8:], mx.concatenate([k[:, :, -7:], k2], axis=2))
    assert mx.array_equal(fk[:, :, :4], k[:, :, :4])  # sinks
    stored, _ = c.keys_and_values()
    assert mx.array_equal(stored[:, :, :4], k[:, :, :4])
    coded, exact = stored[:, :, 4:10].astype(mx.float32), k[:, :, 4:].astype(mx.float32)
    assert not mx.array_equal(coded, exact)
    rel = mx.linalg.norm(coded - exact) / mx.linalg.norm(exact)
    assert rel.item() < 0.12


def test_mask_matches_kvcache():
    c, ref = tq.TurboQuantKVCache(4), KVCache()
    for cache in (c, ref):
        cache.update_and_fetch(*kv(7, 0))
    assert c.make_mask(3) == "causal"
    assert c.make_mask(1) is None
    for return_array, window_size in ((True, None), (False, 4)):
        kw = dict(return_array=return_array, window_size=window_size)
        assert mx.array_equal(c.make_mask(3, **kw), ref.make_mask(3, **kw))


def fetch_all(cache):
    return cache.keys_and_values()


def appended(first, drop, extra, seed=3, **options):
    """(cache that got `first` tokens, lost `drop`, got `extra`; cache that got the
    first - drop tokens, then the same `extra`). Both keep copies for trims of up to 5
    tokens unless `options` say otherwise (the default cache keeps none)."""
    options.setdefault("trim_reserve", 5)
    k, v = kv(first + extra, seed)
    a = tq.TurboQuantKVCache(4, **options)
    a.update_and_fetch(k[:, :, :first], v[:, :, :first])
    assert a.is_trimmable() and a.trim(drop) == drop and a.offset == first - drop
    fetched_a = a.update_and_fetch(k[:, :, first:], v[:, :, first:])
    b = tq.TurboQuantKVCache(4, **options)
    b.update_and_fetch(k[:, :, : first - drop], v[:, :, : first - drop])
    fetched_b = b.update_and_fetch(k[:, :, first:], v[:, :, first:])
    return a, b, fetched_a, fetched_b


@pytest.mark.parametrize("first,drop", [(20, 5), (300, 5), (6, 4), (3, 2), (40, 1)])
def test_trim_then_append_equals_appending_fewer(first, drop):
    # Within trim_reserve (5 here) everything matches:
    # codes, sinks, exact recent copies, and what is fetched.
    a, b, fa, fb = appended(first, drop, 9)
    for x, y in zip(a.state, b.state):
        assert (x is None and y is None) or (
            isinstance(x, str) and x == y or mx.array_equal(x, y)
        )
    for x, y in zip(fa, fb):
        assert mx.array_equal(x, y)


def test_trim_past_the_reserve_keeps_the_codes():
    a, b, fa, fb = appended(300, 45, 9)
    assert a.offset == b.offset == 264
    # Codes and sinks are those of the shorter sequence; only the exact copies of the
    # 7 tokens before the trim point are gone (those now read from codes).
    for x, y in zip(a.state[:6], b.state[:6]):
        assert mx.array_equal(x, y)
    assert a.recent_keys.shape[2] == 9 and b.recent_keys.shape[2] == 12
    assert mx.array_equal(fa[0][:, :, -9:], fb[0][:, :, -9:])


def test_trim_is_clamped_to_offset():
    c = tq.TurboQuantKVCache(3)
    c.update_and_fetch(*kv(5, 0))
    assert c.trim(9) == 5 and c.offset == 0 and c.empty()
    assert c.update_and_fetch(*kv(2, 1))[0].shape[2] == 2


def test_chunking_does_not_change_what_is_stored():
    k, v = kv(40, 4)
    whole, steps = tq.TurboQuantKVCache(4), tq.TurboQuantKVCache(4)
    whole.update_and_fetch(k, v)
    for i in range(0, 40, 7):
        steps.update_and_fetch(k[:, :, i : i + 7], v[:, :, i : i + 7])
    for x, y in zip(whole.state, steps.state):
        assert isinstance(x, str) and x == y or mx.array_equal(x, y)


def assert_same_state(a, b):
    for x, y in zip(a.state, b.state, strict=True):
        assert (x is None and y is None) or (isinstance(x, str) and x == y) or mx.array_equal(x, y)


@pytest.mark.parametrize("prefix", [0, 2, 30])
def test_rows_of_one_padded_pass_equal_passes_of_their_own(prefix):
    """`repeated` then `row`: tails of 1 .. 40 tokens after a shared prefix, right-
    padded to 40 in one pass (far past trim_reserve), then cut: each row holds
    exactly what a pass of its own over its tail holds (codes, sinks, recent
    copies, offset), and fetches the same; the pass's own arrays stay as they were."""
    tails = [1, 3, 40, 17]
    k, v = kv(prefix + 40, 5)
    base = tq.TurboQuantKVCache(4, trim_reserve=5)
    if prefix:
        base.update_and_fetch(k[:, :, :prefix], v[:, :, :prefix])
    group = base.repeated(len(tails), reserve=40)
    pads = [mx.concatenate([k[:, :, prefix : prefix + n], mx.repeat(k[:, :, prefix + n - 1 : prefix + n], 40 - n, 2)], 2)
            for n in tails]  # fmt: skip
    pad_v = [mx.concatenate([v[:, :, prefix : prefix + n], mx.repeat(v[:, :, prefix + n - 1 : prefix + n], 40 - n, 2)], 2)
             for n in tails]  # fmt: skip
    group.update_and_fetch(mx.concatenate(pads, 0), mx.concatenate(pad_v, 0))
    for r, n in enumerate(tails):
        alone = tq.TurboQuantKVCache(4, trim_reserve=5)
        alone.update_and_fetch(k[:, :, : prefix + n], v[:, :, : prefix + n])
        got = group.row(r, prefix + n, reserve=40)
        assert got.offset == prefix + n and got.trim_reserve == 5
        assert_same_state(got, alone)
        for x, y in zip(fetch_all(got), fetch_all(alone)):
            assert mx.array_equal(x, y)
    assert group.offset == prefix + 40 and group.key_codes.shape[0] == len(tails)


def reference_attention(cache, exact_k, exact_v, q, scale):
    """The reading rule's reference over the cache's codes: exact keys and values where
    a query reads them exactly, the cache's own codes elsewhere (so chunking must not
    have changed them)."""
    kc, kn, vc, vn = cache._coded()
    n, L = cache.offset, q.shape[2]
    dk = reference.decoded_like(exact_k, kc, kn, cache.key_bits, rotation(cache.key_dim, cache.seed), cache.sink_tokens)
    dv = reference.decoded_like(exact_v, vc, vn, cache.value_bits, rotation(cache.value_dim, cache.seed),
                                cache.sink_tokens)  # fmt: skip
    return reference.attention(q, mx.arange(n - L, n), exact_k, exact_v, dk, dv, sink_tokens=cache.sink_tokens,
                               window=cache.window, scale=scale)  # fmt: skip


def test_query_block_bounds_the_scores():
    assert tqa.query_block(14, 1024) == 512
    assert tqa.query_block(14, 32768) == (128 << 20) // (4 * 14 * 32768) == 73
    assert tqa.query_block(28, 10**7) == 16


@pytest.mark.parametrize("options", [{}, {"sink_tokens": 0}, {"window": 1, "trim_reserve": 0}])
@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("chunks", [[37], [30, 7], [1] * 12, [20, 5, 1, 11], "blocks of 16"])
def test_attention_is_the_reading_rule(chunks, flash, options, monkeypatch):
    """GQA (4 query heads on 2 kv heads), sinks, window exactness, masks and the
    rotation, against turboquant/reference.py; multi-query passes blocked (ops) or as
    one masked mx.fast attention call (`fused_prefill`)."""
    if chunks == "blocks of 16":  # a prefill chunk attended 16 queries at a time
        monkeypatch.setattr(tqa, "SCORE_BYTES", 1)
        chunks = [37]
    total = sum(chunks)
    k, v = kv(total, 11)
    q = mx.random.normal((1, 4, total, 64), key=mx.random.key(12))
    cache = tq.TurboQuantKVCache(4, fused_prefill=flash, routed=True, **options)
    start, outs = 0, []
    for n in chunks:
        cache.update_and_fetch(k[:, :, start : start + n], v[:, :, start : start + n])
        mask = "causal" if n > 1 else None
        outs.append(cache.attention(q[:, :, start : start + n], scale=0.125, mask=mask))
        start += n
    got = mx.concatenate(outs, axis=2)
    # The reference rebuilds every query's keys from the final cache, so this also
    # checks that chunking changes nothing.
    want = reference_attention(cache, k, v, q, 0.125)
    assert mx.allclose(got, want, atol=2e-5), mx.abs(got - want).max()


def test_flash_mask_literal():
    """The docstring's example: queries 3 and 4, tail 2..4, window 2, width 8."""
    bias = tqa.fused_prefill_mask(2, 5, 0, 3, 2, 8, mx.float32)
    readable = np.array(bias[0, 0] == 0).astype(int)
    assert readable.tolist() == [[1, 1, 0, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 1, 1]]
    # Sinks (position 0 here) are read as sinks, never from the tail.
    bias = tqa.fused_prefill_mask(2, 3, 1, 3, 8, 6, mx.float32)
    assert np.array(bias[0, 0] == 0).astype(int).tolist() == [[1, 0, 0, 0, 1, 0], [1, 0, 0, 0, 1, 1]]
    # Padding queries (rows past L_q, their outputs dropped) read every column.
    bias = tqa.fused_prefill_mask(2, 5, 0, 3, 2, 8, mx.float32, rows=4)
    readable = np.array(bias[0, 0] == 0).astype(int)
    assert readable.tolist() == [[1, 1, 0, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 1, 1], [1] * 8, [1] * 8]


def test_unrouted_cache_falls_back_to_fetch():
    c = tq.TurboQuantKVCache(4, routed=True)  # but nobody calls c.attention
    c.update_and_fetch(*kv(6, 0))
    c.update_and_fetch(*kv(1, 1))
    assert not c.routed and c._chunk is None


def test_state_round_trip_and_copy():
    c = tq.TurboQuantKVCache(3, sink_tokens=2, seed=9, trim_reserve=5)
    c.update_and_fetch(*kv(30, 5, dtype=mx.bfloat16))
    c.trim(3)
    d = tq.TurboQuantKVCache.from_state(c.state)
    assert d.meta_state == c.meta_state and d.offset == 27
    assert (d.key_bits, d.value_bits, d.sink_tokens, d.seed) == (4, 2, 2, 9)
    assert (d.window, d.trim_reserve) == (8, 5)
    for x, y in zip(fetch_all(c), fetch_all(d)):
        assert x.dtype == mx.bfloat16 and mx.array_equal(x, y)
    # A deep copy (the prompt-cache pool's copy) is independent of the original.
    e = copy.deepcopy(c)
    e.update_and_fetch(*kv(4, 6, dtype=mx.bfloat16))
    assert e.offset == 31 and c.offset == 27
    assert mx.array_equal(fetch_all(c)[0], fetch_all(d)[0])
    c.meta_state = e.meta_state
    assert c.offset == 31


def test_save_load_prompt_cache_file(tmp_path):
    caches = [tq.TurboQuantKVCache(4, seed=i) for i in range(2)] + [ArraysCache(2)]
    for c in caches[:2]:
        c.update_and_fetch(*kv(12, 7))
    caches[2][0] = mx.ones((1, 3))
    path = str(tmp_path / "cache.safetensors")
    mlx_cache.save_prompt_cache(path, caches, {"model": "tiny"})
    # mlx-lm's own loader works too: the class is registered on import.
    loaded, meta = mlx_cache.load_prompt_cache(path, return_metadata=True)
    assert meta == {"model": "tiny"}
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    for a, b in zip(caches[:2], loaded[:2]):
        assert b.offset == a.offset and b.seed == a.seed
        for x, y in zip(fetch_all(a), fetch_all(b)):
            assert mx.array_equal(x, y)
        # and the loaded cache keeps working
        b.update_and_fetch(*kv(2, 8))
        assert b.offset == 14


def test_save_load_empty_cache(tmp_path):
    path = str(tmp_path / "empty.safetensors")
    mlx_cache.save_prompt_cache(path, [tq.TurboQuantKVCache(4)])
    (c,) = mlx_cache.load_prompt_cache(path)
    assert c.empty()
    assert c.update_and_fetch(*kv(3, 0))[0].shape == (1, 2, 3, 64)


@pytest.mark.parametrize("dim", [64, 128])
def test_nbytes_at_most_030_of_fp16_from_512_tokens(dim):
    k, v = kv(512, 0, heads=4, dim=dim, dtype=mx.float16)
    ref, c = KVCache(), tq.TurboQuantKVCache(4)
    ref.update_and_fetch(k, v)
    c.update_and_fetch(k, v)
    ratio = c.nbytes / ref.nbytes
    assert ratio <= 0.30, ratio
    # What is counted: 4 sink tokens and 8 - 1 recent copies (fp16), codes for
    # positions 4.. (capacity in 256-token steps: 512) with two fp16 norms each; a
    # reserve for trims keeps that many copies more.
    words = packed_words(dim, 5) + packed_words(dim, 3)
    exact = (4 + 7) * 4 * dim * 2 * 2
    coded = 512 * 4 * (words * 4 + 2 * 2)
    assert c.nbytes == exact + coded
    reserved = tq.TurboQuantKVCache(4, trim_reserve=5)
    reserved.update_and_fetch(k, v)
    assert reserved.nbytes == c.nbytes + 5 * 4 * dim * 2 * 2
    small = tq.TurboQuantKVCache(3)
    small.update_and_fetch(k, v)
    assert small.nbytes < c.nbytes
    # Decoding more tokens keeps the ratio (same 256-token capacity steps as KVCache).
    for _ in range(100):
        step = kv(1, 1, heads=4, dim=dim, dtype=mx.float16)
        ref.update_and_fetch(*step)
        c.update_and_fetch(*step)
    assert c.nbytes / ref.nbytes <= 0.30


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("tokens", [300, 520, 900])
def test_fewer_bytes_than_mlx_lm_4_bit_cache_in_float32(dim, tokens):
    """The comparison bench/turboquant_demo_quality.py makes (float32, caches made
    outside the engine), at lengths of its jobs: mlx-lm's 4-bit cache holds 4 + 2 x 32
    bits a group of 64 (its scales and biases in float32) and capacity in 256-token
    steps; this one 5 + 3 bits a pair, two fp16 scales, 11 exact float32 tokens."""
    k, v = kv(tokens, 2, heads=2, dim=dim)
    mine, theirs = tq.TurboQuantKVCache(4), QuantizedKVCache(group_size=64, bits=4)
    mine.update_and_fetch(k, v)
    theirs.update_and_fetch(k, v)
    cap = -(-tokens // 256) * 256
    assert theirs.nbytes == cap * 2 * 2 * (dim // 2 + dim // 64 * 2 * 4)
    assert mine.nbytes == 11 * 2 * dim * 4 * 2 + -(-(tokens - 4) // 256) * 256 * 2 * (dim + 4)
    assert mine.nbytes < theirs.nbytes


def test_bad_arguments_fail_early():
    with pytest.raises(ValueError, match="kv bits"):
        tq.TurboQuantKVCache(6)
    with pytest.raises(ValueError, match="key_bits"):
        tq.TurboQuantKVCache(4, key_bits=7)
    with pytest.raises(ValueError, match="window"):
        tq.TurboQuantKVCache(4, window=-1)
    with pytest.raises(ValueError, match="shape"):
        tq.TurboQuantKVCache(4).update_and_fetch(mx.zeros((2, 64)), mx.zeros((2, 64)))
    c = tq.TurboQuantKVCache(4)
    c.update_and_fetch(*kv(2, 0))
    with pytest.raises(ValueError, match="head dims"):
        c.update_and_fetch(*kv(2, 0, dim=128))


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _restore_stock_attention():
    # make_turboquant_cache routes attention through our caches; leave mlx-lm as found.
    yield
    unroute_attention()


@pytest.fixture(scope="module")
def tiny_models(model_dir):
    return {arch: mlx_lm.load(str(model_dir(arch))) for arch in ARCHS}


def teacher_forced_logits(model, tokens, cache, n_prompt):
    """Prefill n_prompt tokens, then feed the rest one at a time; logits per step."""
    out = [model(tokens[None, :n_prompt], cache=cache)[0, -1]]
    for t in range(n_prompt, len(tokens) - 1):
        out.append(model(tokens[None, t : t + 1], cache=cache)[0, -1])
    return mx.stack(out)


def kl_and_top1(ref, got):
    lp = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
    lq = got - mx.logsumexp(got, axis=-1, keepdims=True)
    kl = mx.sum(mx.exp(lp) * (lp - lq), axis=-1).mean().item()
    return kl, mx.mean(ref.argmax(-1) == got.argmax(-1)).item()


def fp_cache(model):
    return model.make_cache() if hasattr(model, "make_cache") else None


def random_tokens(n, seed=0, vocab=320):
    return mx.array(np.random.default_rng(seed).integers(3, vocab, n))


@pytest.mark.parametrize("arch", ARCHS)
def test_model_generates_and_stays_close(tiny_models, arch):
    model, tokenizer = tiny_models[arch]
    cache = make_turboquant_cache(model, bits=4)
    stock = fp_cache(model) or [KVCache() for _ in model.layers]
    assert len(cache) == len(stock)
    for c, s in zip(cache, stock):
        if type(s) is KVCache:
            assert isinstance(c, tq.TurboQuantKVCache)
        else:
            assert type(c) is type(s)  # recurrent layers keep their ArraysCache
    text = mlx_lm.generate(
        model, tokenizer, "def add(a, b):", max_tokens=8, prompt_cache=cache
    )
    assert isinstance(text, str)
    assert all(c.offset > 0 for c in cache if isinstance(c, tq.TurboQuantKVCache))

    tokens = random_tokens(96, seed=1)
    stock = fp_cache(model) or [KVCache() for _ in model.layers]
    ref = teacher_forced_logits(model, tokens, stock, 48)
    got = teacher_forced_logits(model, tokens, make_turboquant_cache(model, 4), 48)
    kl, top1 = kl_and_top1(ref, got)
    # Random tiny models amplify any perturbation (a broken cache gives KL > 1), so
    # also compare with a deliberately coarse cache on the same model.
    coarse = make_turboquant_cache(
        model, 2, key_bits=2, value_bits=2, sink_tokens=0, window=0
    )
    kl_coarse, _ = kl_and_top1(ref, teacher_forced_logits(model, tokens, coarse, 48))
    assert kl < 0.1 and top1 >= 0.6 and kl < 0.5 * kl_coarse, (kl, top1, kl_coarse)


def test_attention_hook_matches_dequantize_on_fetch(tiny_models):
    from mlx_lm.models import base, qwen3_next

    model, _ = tiny_models["qwen3_5"]
    tokens = random_tokens(40, seed=2)
    stock_logits = teacher_forced_logits(model, tokens, model.make_cache(), 1)
    unroute_attention()
    fetch = make_turboquant_cache(model, 4, rotated_attention=False)
    assert qwen3_next.scaled_dot_product_attention is base.scaled_dot_product_attention
    plain = teacher_forced_logits(model, tokens, fetch, 1)
    routed = make_turboquant_cache(model, 4)
    assert route_attention(model) == ["mlx_lm.models.qwen3_next"]
    assert all(c.routed for c in routed if isinstance(c, tq.TurboQuantKVCache))
    hooked = teacher_forced_logits(model, tokens, routed, 1)
    # One token at a time both read the same window: same logits up to rounding.
    assert mx.allclose(hooked, plain, atol=1e-4), mx.abs(hooked - plain).max()
    # Other caches go through the stock attention, unchanged.
    stock = teacher_forced_logits(model, tokens, model.make_cache(), 1)
    assert mx.array_equal(stock, stock_logits)
    unroute_attention()
    assert qwen3_next.scaled_dot_product_attention is base.scaled_dot_product_attention


@pytest.mark.parametrize("arch,shape", [("qwen2", dict(hidden_size=256, num_attention_heads=4)),
                                        ("llama", dict(hidden_size=256, num_attention_heads=2))])  # fmt: skip
def test_copies_kept_for_trims_change_nothing_plain_decoding_reads(model_dir, arch, shape):
    """Head dims 64 and 128: without trims a query reads only the last window - 1 copies,
    so a cache keeping five more for trims gives the same logits, float32, bit for bit
    (the default keeps none: codec.DEFAULT_TRIM_RESERVE)."""
    model, _ = mlx_lm.load(str(model_dir(arch, **shape)))
    tokens = random_tokens(100, seed=5)
    plain = teacher_forced_logits(model, tokens, make_turboquant_cache(model, 4), 60)
    kept = make_turboquant_cache(model, 4, trim_reserve=5)
    assert mx.array_equal(plain, teacher_forced_logits(model, tokens, kept, 60))
    assert kept[0].recent_keys.shape[2] == 8 - 1 + 5


def test_4bit_at_least_as_close_as_mlx_affine_4bit(model_dir):
    """qwen2 with head_dim 64 and a large key bias on 4 channels per head (the key
    outlier channels of trained Qwen2 models), 1040 tokens: both caches then hold
    0.28x of fp16 (ours: 8 bits + 2 norms per coordinate pair, plus 11 exact tokens;
    affine: 9 bits per pair)."""
    path = model_dir("qwen2", hidden_size=256, num_attention_heads=4)
    model, _ = mlx_lm.load(str(path))  # a fresh copy: its weights are changed below
    rng = np.random.default_rng(0)
    for layer in model.model.layers:
        bias = np.array(layer.self_attn.k_proj.bias).reshape(-1, 64)
        for head in bias:
            head[rng.choice(64, 4, replace=False)] = rng.uniform(8, 15, 4)
        layer.self_attn.k_proj.bias = mx.array(bias.reshape(-1))
    tokens = random_tokens(1040, seed=3)
    n = len(model.layers)
    ref = teacher_forced_logits(model, tokens, [KVCache() for _ in range(n)], 1000)
    affine = [QuantizedKVCache(group_size=64, bits=4) for _ in range(n)]
    got = teacher_forced_logits(model, tokens, affine, 1000)
    kl_affine, top_affine = kl_and_top1(ref, got)
    ours = make_turboquant_cache(model, 4)
    kl_tq, top_tq = kl_and_top1(ref, teacher_forced_logits(model, tokens, ours, 1000))
    assert kl_tq <= kl_affine and top_tq >= top_affine, (
        kl_tq,
        kl_affine,
        top_tq,
        top_affine,
    )
    assert sum(c.nbytes for c in ours) <= sum(c.nbytes for c in affine)
