"""Prompt-cache pool: LCP matching, prewarm, byte budget, persistence."""

import logging

import mlx.core as mx
import pytest

from batchgen.config import DecodeConfig, EngineConfig, PromptCacheConfig
from batchgen.engine.core import Engine
from batchgen.decode.passes import padded_length, prefill
from batchgen.cache.pool import PromptPool, common_prefix_len, prewarm_prefix

from test_engine import make_job
from tiny import ARCHS

SYSTEM = "You are a helpful assistant. Answer briefly and exactly. " * 3
FEW_SHOT = "Example: rename x to y.\ndef f(x):\n    return x\n-> def f(y):\n    return y\n" * 2


def test_common_prefix_len_literals():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5], [6]) == 0
    assert common_prefix_len([7, 7, 7], [7, 7, 7]) == 3


def fake_render(system_ids, header, closing):
    # tokens: system block, closing tag, user header, user text (one id per char)
    return lambda user: system_ids + closing + header + [ord(c) for c in user]


def test_prewarm_prefix_stops_before_request_text():
    render = fake_render([1, 2, 3], header=[90, 91], closing=[99])
    assert prewarm_prefix(render) == [1, 2, 3, 99, 90, 91]


def engine_for(path, pool=True, prewarm=True, pad_prompts=False, **pc):
    cfg = EngineConfig(
        model=str(path), fuse=False, decode=DecodeConfig(draft="none"),
        prompt_cache=PromptCacheConfig(enabled=pool, prewarm=prewarm, **pc), pad_prompts=pad_prompts,
    )  # fmt: skip
    return Engine.load(cfg)


def chat_job(user, job_id="j", system=SYSTEM, max_tokens=12):
    job = make_job(user, max_tokens=max_tokens, job_id=job_id)
    return job.__class__(**{**job.__dict__, "messages": ({"role": "system", "content": system},) + job.messages})


JOBS = [
    chat_job(FEW_SHOT + "Now rename a to b: def g(a): return a", "1"),
    chat_job(FEW_SHOT + "Now rename n to m: def h(n): return n + 1", "2"),
    chat_job("Something unrelated", "3"),
    chat_job("Something else entirely", "4", system="Another system prompt."),
]


@pytest.mark.parametrize("arch", ARCHS)
def test_pool_never_changes_results(model_dir, arch):
    path = model_dir(arch)
    without = engine_for(path, pool=False)
    with_pool = engine_for(path)
    with_pool.prewarm(SYSTEM, "test")
    for job in JOBS + JOBS[:2]:  # repeats hit the pool with a whole prompt
        a, b = without.run(job), with_pool.run(job)
        assert b.text == a.text, (arch, job.id)
        assert a.usage.cached_tokens == 0
    assert with_pool.pool.slots


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe", "qwen3_5"])
def test_padded_prompt_passes_change_nothing(model_dir, arch):
    """Pads (forced on here; a GPU's default) leave texts and cached counts as
    they are; qwen3_5's recurrent layers cannot drop pads, so it is not padded."""
    path = model_dir(arch)
    plain, padded = engine_for(path), engine_for(path, pad_prompts=True)
    for e in (plain, padded):
        e.prewarm(SYSTEM, "test")
    for job in JOBS:
        a, b = plain.run(job), padded.run(job)
        assert (b.text, b.usage.cached_tokens) == (a.text, a.usage.cached_tokens), (arch, job.id)
    expected = 0 if arch == "qwen3_5" else len({padded_length(n, 2048) for n in range(1, 513)})
    assert padded.prewarm_info["tail_shapes_warmed"] == expected


def test_padded_prefill_runs_power_of_two_passes_and_trims_the_pads(model_dir):
    engine = engine_for(model_dir("llama"), pool=False)
    lengths = []

    def model(chunk, cache):
        lengths.append(chunk.shape[1])
        return engine.model(chunk, cache=cache)

    tokens = engine.prompt_tokens(JOBS[0])[:37]
    cache = engine.make_cache(engine.config.kv)
    prefill(model, cache, tokens, step_size=2048, pad=True)
    assert lengths == [64] and cache[0].offset == 37
    reference = engine.make_cache(engine.config.kv)
    prefill(engine.model, reference, tokens, step_size=2048)
    for c, r in zip(cache, reference):  # every layer's entries, exactly
        for x, y in ((c.keys, r.keys), (c.values, r.values)):
            assert mx.array_equal(x[..., :37, :], y[..., :37, :]).item()
    lengths.clear()
    prefill(model, engine.make_cache(engine.config.kv), tokens, step_size=16, pad=True)
    assert lengths == [16, 16, 16]  # 37 = 16 + 16 + 5, the last chunk padded to 16


def test_padded_length_literals():
    assert [padded_length(n, 2048) for n in (0, 1, 16, 17, 64, 65, 256, 257, 300, 1100, 1500, 2047, 2048)] == [
        0, 16, 16, 32, 64, 128, 256, 512, 512, 1280, 1536, 2048, 2048]  # fmt: skip
    assert padded_length(100, 64) == 64 and padded_length(700, 512) == 512


def test_exact_cached_token_counts(model_dir):
    path = model_dir("qwen2")
    engine = engine_for(path)
    info = engine.prewarm(SYSTEM, "test")
    tok = [engine.prompt_tokens(j) for j in JOBS]
    system_prefix = info["tokens"]
    assert system_prefix == common_prefix_len(tok[0], tok[2]) > len(SYSTEM) // 8
    results = [engine.run(j) for j in JOBS]
    cached = [r.usage.cached_tokens for r in results]
    # job 1: the prewarmed system prefix; job 2: the system + few-shot prefix it
    # shares with job 1; job 3: the system prefix; job 4 (another system): only
    # the role header tokens it shares with the others
    assert cached[0] == system_prefix
    assert cached[1] == common_prefix_len(tok[0], tok[1]) > system_prefix
    assert cached[2] == max(common_prefix_len(tok[2], t) for t in tok[:2])
    assert cached[3] == max(common_prefix_len(tok[3], t) for t in tok[:3]) < 10
    assert results[0].stats.cache_hit_ratio == pytest.approx(system_prefix / len(tok[0]))
    # Without prewarm the first job starts cold; the pool still serves the second.
    cold = engine_for(path, prewarm=False)
    r1, r2 = cold.run(JOBS[0]), cold.run(JOBS[1])
    assert r1.usage.cached_tokens == 0 and r2.usage.cached_tokens == cached[1]


def test_prewarm_that_is_not_a_prefix_changes_nothing(model_dir):
    path = model_dir("llama")
    plain = engine_for(path, pool=False)
    odd = engine_for(path)
    odd.prewarm("A different system prompt that no job uses", "test")
    for job in JOBS:
        assert odd.run(job).text == plain.run(job).text


def test_byte_budget_is_respected_under_many_prefixes(model_dir):
    path = model_dir("qwen2")
    engine = engine_for(path, prewarm=False)
    one = engine.run(chat_job("x" * 40, "probe")).usage.prompt_tokens
    budget = 3 * engine.pool.slots[0].nbytes + 1
    engine.pool = PromptPool(max_bytes=budget)
    for i in range(12):
        engine.run(chat_job(f"{i} distinct prompt number {i} " * 2, f"d{i}", system=f"sys {i}"))
        assert engine.pool.nbytes <= budget
    assert 1 <= len(engine.pool.slots) <= 3 and one > 0


def test_untrimmable_cache_reuses_only_exact_prefixes(model_dir, caplog):
    path = model_dir("qwen3_5")
    engine = engine_for(path)
    with caplog.at_level(logging.INFO, logger="batchgen"):
        engine.prewarm(SYSTEM, "test")
    assert "cannot be trimmed" in caplog.text
    r = engine.run(JOBS[0])
    assert r.usage.cached_tokens == engine.prewarm_info["tokens"]
    # job 2 shares more than the prewarm with job 1, but job 1's slot holds all of
    # job 1's prompt (minus its last token) and cannot be cut back to the overlap
    r2 = engine.run(JOBS[1])
    assert r2.usage.cached_tokens == engine.prewarm_info["tokens"]


def test_persisted_prewarm_is_reused_and_rejected_for_another_model(model_dir, tmp_path, caplog):
    cache_dir = tmp_path / "pc"
    first = engine_for(model_dir("qwen2"), cache_dir=cache_dir)
    assert first.prewarm(SYSTEM, "test")["loaded"] is False
    files = list(cache_dir.iterdir())
    assert len(files) == 1
    second = engine_for(model_dir("qwen2"), cache_dir=cache_dir)
    assert second.prewarm(SYSTEM, "test")["loaded"] is True
    assert second.run(JOBS[0]).text == engine_for(model_dir("qwen2"), pool=False).run(JOBS[0]).text
    # Another model (same shapes, other weights) must not load that file.
    other = engine_for(model_dir("qwen2", seed=1), cache_dir=cache_dir)
    assert other.prewarm(SYSTEM, "test")["loaded"] is False
    # A file with the right name but another key inside is stale: ignored.
    stale = cache_dir / files[0].name
    other_file = [f for f in cache_dir.iterdir() if f != stale][0]
    stale.write_bytes(other_file.read_bytes())
    with caplog.at_level(logging.WARNING, logger="batchgen"):
        assert engine_for(model_dir("qwen2"), cache_dir=cache_dir).prewarm(SYSTEM, "test")["loaded"] is False
    assert "made for another model or prompt" in caplog.text
    # A corrupt file is ignored with a warning, then rewritten.
    stale.write_bytes(b"not a safetensors file")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="batchgen"):
        again = engine_for(model_dir("qwen2"), cache_dir=cache_dir)
        assert again.prewarm(SYSTEM, "test")["loaded"] is False
    assert "unreadable" in caplog.text
    assert engine_for(model_dir("qwen2"), cache_dir=cache_dir).prewarm(SYSTEM, "test")["loaded"] is True


def test_slots_are_not_changed_by_jobs(model_dir):
    engine = engine_for(model_dir("qwen2"))
    engine.prewarm(SYSTEM, "test")
    slot = engine.pool.slots[0]
    before = [mx.array(c.state[0]) for c in slot.cache]
    offsets = [c.offset for c in slot.cache]
    for job in JOBS:
        engine.run(job)
    assert [c.offset for c in slot.cache] == offsets
    for b, c in zip(before, slot.cache):
        assert mx.array_equal(b, c.state[0])


@pytest.mark.parametrize(
    "info, expected",
    [
        ({"memory_size": 64 << 30}, (64 << 30) // 10),  # Metal
        ({"total_memory": 140 << 30, "device_name": "NVIDIA H200"}, (140 << 30) // 10),  # CUDA
    ],
)
def test_default_pool_bytes_reads_the_device_memory(monkeypatch, info, expected):
    from batchgen.cache import pool as prompt_cache

    monkeypatch.setattr(prompt_cache.mx, "device_info", lambda: info)
    assert prompt_cache.default_pool_bytes() == expected


def test_forget_keeps_only_pinned_slots():
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from batchgen.cache.pool import PromptPool

    def cache():
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 3, 4)))
        return [c]

    pool = PromptPool(max_bytes=1 << 20)
    pool.insert([1, 2, 3], cache(), "fp16", pinned=True)
    pool.insert([1, 2, 4], cache(), "fp16")
    pool.forget()
    assert [s.tokens for s in pool.slots] == [[1, 2, 3]]
    assert pool.fetch([1, 2, 4, 5], "fp16").cached_tokens == 2
