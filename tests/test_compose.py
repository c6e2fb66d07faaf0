"""The techniques compose: PLD over a TurboQuant cache gives TurboQuant's own
greedy text, and so does the prompt-cache pool holding TurboQuant slots
(float32, CPU: exact)."""

import pytest

from batchgen.config import DecodeConfig, EngineConfig, KVConfig, PromptCacheConfig

from test_engine import USER_TEXTS, make_job
from test_pld import LOOPY
from test_prompt_cache import JOBS, SYSTEM
from tiny import ARCHS


def tq_engine(path, draft="none", pool=False, static=False, bits=4):
    from batchgen.engine.core import Engine

    cfg = EngineConfig(
        model=str(path), fuse=True, kv=KVConfig(kind="turboquant", bits=bits),
        decode=DecodeConfig(draft=draft, pld_adaptive=False, pld_static_shapes=static),
        prompt_cache=PromptCacheConfig(enabled=pool, prewarm=pool),
    )  # fmt: skip
    return Engine.load(cfg)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("static", [False, True])
def test_pld_over_turboquant_equals_turboquant(model_dir, arch, static):
    path = model_dir(arch)
    plain, fast = tq_engine(path), tq_engine(path, draft="pld", static=static)
    drafted = 0
    for text in LOOPY + USER_TEXTS[:2]:
        a = plain.run(make_job(text, max_tokens=40))
        b = fast.run(make_job(text, max_tokens=40))
        assert a.ok and b.ok, (a.error, b.error)
        assert b.text == a.text, (arch, text)
        assert a.stats.kv_cache == b.stats.kv_cache == "turboquant"
        drafted += b.stats.pld_drafted
    assert drafted > 0


def test_pld_over_turboquant_on_a_repeating_model(model_dir):
    path = model_dir("qwen2", repeater=True)
    a = tq_engine(path).run(make_job("hello hello", max_tokens=40))
    b = tq_engine(path, draft="pld").run(make_job("hello hello", max_tokens=40))
    assert b.text == a.text and b.stats.pld_accepted >= 30


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_pool_with_turboquant_slots_equals_no_pool(model_dir, arch):
    path = model_dir(arch)
    without, with_pool = tq_engine(path), tq_engine(path, pool=True)
    info = with_pool.prewarm(SYSTEM, "test")
    assert info["tokens"] > 0 and with_pool.pool.slots[0].kind == "turboquant-4"
    hits = 0
    for job in JOBS + JOBS[:2]:
        a, b = without.run(job), with_pool.run(job)
        assert b.text == a.text, (arch, job.id)
        hits += b.usage.cached_tokens
    assert hits > 0


def test_turboquant_holds_under_a_third_of_fp16_bytes(model_dir):
    from batchgen.engine.core import Engine

    path = model_dir("qwen2", max_position_embeddings=4096)
    long_text = "def add(a, b):\n    return a + b\n" * 60
    fp16 = Engine.load(EngineConfig(model=str(path), decode=DecodeConfig(draft="none"),
                                    prompt_cache=PromptCacheConfig(enabled=False)))  # fmt: skip
    a = fp16.run(make_job(long_text, max_tokens=8))
    b = tq_engine(path).run(make_job(long_text, max_tokens=8))
    assert a.usage.prompt_tokens >= 512
    assert b.stats.kv_bytes <= 0.30 * a.stats.kv_bytes
