"""Engine on tiny real models: greedy text equals mlx-lm's, stop/EOS/max_tokens
exact, seeded sampling reproducible. float32 on CPU, so equality is exact."""

import mlx.core as mx
import pytest
from mlx_lm import generate

from batchgen.config import DecodeConfig, EngineConfig, PromptCacheConfig, SamplingConfig
from batchgen.engine.core import Engine
from batchgen.jobs import NATIVE, Job

from tiny import ARCHS

USER_TEXTS = [
    "Rename the variable `count` to `total` in the function below.",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox",
]


def make_job(text=None, prompt=None, max_tokens=24, stop=(), sampling=None, draft=None, job_id="j"):
    messages = None if prompt is not None else ({"role": "user", "content": text},)
    return Job(
        id=job_id, line=1, format=NATIVE, messages=messages, prompt=prompt,
        max_tokens=max_tokens, sampling=sampling or SamplingConfig(), stop=tuple(stop), draft=draft,
    )  # fmt: skip


def make_engine(path, draft="none", pool=False, **kw):
    cfg = EngineConfig(
        model=str(path), fuse=False, decode=DecodeConfig(draft=draft),
        prompt_cache=PromptCacheConfig(enabled=pool, prewarm=pool), **kw,
    )  # fmt: skip
    return Engine.load(cfg)


def reference_text(engine, job):
    tokens = engine.prompt_tokens(job)
    return generate(engine.model, engine.tokenizer, prompt=tokens, max_tokens=job.max_tokens)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_text_equals_mlx_lm_generate(model_dir, arch):
    engine = make_engine(model_dir(arch))
    for text in USER_TEXTS:
        job = make_job(text)
        result = engine.run(job)
        assert result.ok, result.error
        assert result.text == reference_text(engine, job)
        assert result.usage.completion_tokens == job.max_tokens
        assert result.finish_reason == "length"


def test_draft_ceiling_follows_the_device_unless_given(model_dir, monkeypatch):
    """pld_max_lookup None takes the device's ceiling (32 on a GPU, 16 on a CPU) into the
    engine's config, where jobs' plans and the run summary read it; a given one stays."""
    import batchgen.engine.core as core
    from batchgen.config import CPU_PLD_MAX_LOOKUP, DEFAULT_PLD_MAX_LOOKUP

    path = model_dir("qwen2")
    engine = make_engine(path, draft="pld")
    assert engine.config.decode.pld_max_lookup == CPU_PLD_MAX_LOOKUP == 16  # these tests run on a CPU
    assert engine.plan(make_job("x")).decode.pld_max_lookup == 16
    given = Engine.load(EngineConfig(model=str(path), fuse=False, decode=DecodeConfig(pld_max_lookup=7)))
    assert given.config.decode.pld_max_lookup == 7
    monkeypatch.setattr(core.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert core.default_pld_max_lookup() == DEFAULT_PLD_MAX_LOOKUP == 32


def test_raw_prompt_is_not_templated(model_dir):
    engine = make_engine(model_dir("qwen2"))
    job = make_job(prompt="import os\nimport sys\n")
    result = engine.run(job)
    assert result.usage.prompt_tokens == len(engine.tokenizer.encode("import os\nimport sys\n"))
    assert result.text == generate(engine.model, engine.tokenizer, prompt="import os\nimport sys\n", max_tokens=24)


def test_stop_string_cuts_text_and_reports_stop(model_dir):
    engine = make_engine(model_dir("llama"))
    full = engine.run(make_job(USER_TEXTS[0], max_tokens=40)).text
    stop = full[10:13]
    assert stop and full.find(stop) >= 10 or full.find(stop) >= 0
    result = engine.run(make_job(USER_TEXTS[0], max_tokens=40, stop=[stop]))
    assert result.finish_reason == "stop"
    assert result.text == full[: full.find(stop)]
    assert result.usage.completion_tokens < 40


def test_eos_ends_job_without_text(model_dir):
    engine = make_engine(model_dir("qwen3"))
    job = make_job(USER_TEXTS[1], max_tokens=30)
    tokens = engine.prompt_tokens(job)
    ids = [r for r in _greedy_ids(engine, tokens, 30)]
    eos = ids[6]
    first = ids.index(eos)
    engine.tokenizer.add_eos_token(str(eos))
    try:
        result = engine.run(job)
        expected = reference_text(engine, job)
    finally:
        engine.tokenizer._eos_token_ids.discard(eos)
    assert result.finish_reason == "stop"
    assert result.usage.completion_tokens == first + 1  # EOS counted, not shown
    assert result.text == expected


def _greedy_ids(engine, tokens, n):
    from mlx_lm.generate import generate_step

    return [t for t, _ in generate_step(mx.array(tokens), engine.model, max_tokens=n)]


def test_max_tokens_is_exact(model_dir):
    engine = make_engine(model_dir("qwen2"))
    for n in (1, 2, 7):
        result = engine.run(make_job(USER_TEXTS[2], max_tokens=n))
        assert result.usage.completion_tokens == n
        assert result.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_seed_dependent(model_dir):
    engine = make_engine(model_dir("qwen2"))
    s7 = SamplingConfig(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    a = engine.run(make_job(USER_TEXTS[0], sampling=s7)).text
    b = engine.run(make_job(USER_TEXTS[0], sampling=s7)).text
    c = engine.run(make_job(USER_TEXTS[0], sampling=SamplingConfig(temperature=1.0, seed=8))).text
    assert a == b
    assert a != c


def test_prompt_longer_than_context_fails_alone(model_dir):
    engine = make_engine(model_dir("qwen2", max_position_embeddings=16))
    result = engine.run(make_job(USER_TEXTS[0]))
    assert result.error.type == "prompt_too_long"
    assert engine.run(make_job(prompt="ab", max_tokens=3)).ok


def test_stats_are_filled(model_dir):
    engine = make_engine(model_dir("qwen2"))
    r = engine.run(make_job(USER_TEXTS[0], max_tokens=10))
    s = r.stats
    assert s.prefill_s > 0 and s.decode_s > 0 and s.decode_tps > 0 and s.prompt_tps > 0
    assert s.kv_cache == "fp16" and s.kv_bytes > 0 and s.peak_memory_gb > 0
    assert s.forward_passes >= 10
    assert r.usage.prompt_tokens == len(engine.prompt_tokens(make_job(USER_TEXTS[0])))


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_engine_equals_unfused_mlx_lm(model_dir, arch):
    from mlx_lm import load

    path = model_dir(arch)
    cfg = EngineConfig(model=str(path), fuse=True, decode=DecodeConfig(draft="none"),
                       prompt_cache=PromptCacheConfig(enabled=False))  # fmt: skip
    engine = Engine.load(cfg)
    assert engine.fusion_report.qkv > 0
    model, tokenizer = load(str(path))
    for text in USER_TEXTS[:2]:
        job = make_job(text)
        want = generate(model, tokenizer, prompt=engine.prompt_tokens(job), max_tokens=job.max_tokens)
        assert engine.run(job).text == want


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tied", [False, True])
def test_logits_at_projects_one_position_exactly(model_dir, arch, tied):
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from batchgen.decode.passes import logits_at, split_head

    model, _ = load(str(model_dir(arch, tie_word_embeddings=tied)))
    assert split_head(model) is not None
    inputs = mx.array([[5, 9, 17, 3, 11, 30, 7]])
    full = model(inputs, cache=make_prompt_cache(model))
    for index in (3, 6):
        got = logits_at(model, inputs, make_prompt_cache(model), index)
        assert got.shape == (1, full.shape[-1])
        assert mx.array_equal(got, full[:, index, :]), (arch, tied, index)


def test_logits_at_falls_back_to_the_whole_pass_for_other_models(model_dir):
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from batchgen.decode.passes import logits_at, split_head

    model, _ = load(str(model_dir("llama")))
    model.args.model_type = "some_new_arch"  # its __call__ may do more than head(backbone(x))
    assert split_head(model) is None
    inputs = mx.array([[5, 9, 17, 3]])
    want = model(inputs, cache=make_prompt_cache(model))[:, 2, :]
    assert mx.array_equal(logits_at(model, inputs, make_prompt_cache(model), 2), want)


@pytest.mark.parametrize("pad", [False, True])
def test_prompt_pass_gives_the_first_token(model_dir, pad):
    """The prompt's last pass yields the first token: no one-token pass of its
    own; chunked, padded or not, the logits equal a single whole-prompt pass's."""
    from mlx_lm.models.cache import make_prompt_cache

    from batchgen.decode.passes import prefill

    engine = make_engine(model_dir("qwen2"))
    tokens = engine.prompt_tokens(make_job(USER_TEXTS[0]))
    want = engine.model(mx.array([tokens]), cache=make_prompt_cache(engine.model))[:, -1, :]
    cache = make_prompt_cache(engine.model)
    got = prefill(engine.model, cache, tokens, step_size=16, pad=pad, logits=True)
    assert cache[0].offset == len(tokens)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5)  # chunked: other reduction sizes
    one = prefill(engine.model, make_prompt_cache(engine.model), tokens, step_size=2048, pad=pad, logits=True)
    assert mx.array_equal(one, want)
    r = engine.run(make_job(USER_TEXTS[0], max_tokens=1))
    assert (r.usage.completion_tokens, r.stats.forward_passes, r.finish_reason) == (1, 1, "length")


@pytest.mark.parametrize("module,examples", [("decode.passes", 1), ("engine.entering", 4), ("engine.scheduler", 1), ("step.compiled", 2), ("kernels.attention", 1)])
def test_docstring_examples(module, examples):
    import doctest
    import importlib

    failures, tried = doctest.testmod(importlib.import_module(f"batchgen.{module}"))
    assert tried >= examples and failures == 0


def test_collector_is_quieter_during_a_run_and_restored_after(model_dir):
    """`run_all` freezes the startup heap and raises the young threshold while it
    runs, batched or one at a time, and puts both back when it ends, when its
    consumer stops early, and when it fails."""
    import gc

    from batchgen.engine import collector

    before = gc.get_threshold()
    seen = []
    for rows in (1, 4):
        engine = make_engine(model_dir("qwen2"), batch_size=rows)
        jobs = [make_job(USER_TEXTS[i % 3], max_tokens=4, job_id=f"j{i}") for i in range(3)]
        for _ in engine.run_all(jobs, total=len(jobs)):
            seen.append((gc.get_threshold()[0], gc.get_freeze_count() > 0))
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
        results = engine.run_all(jobs, total=len(jobs))
        next(results)
        results.close()  # the consumer stopped after one line
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    assert seen == [(collector.YOUNG_THRESHOLD, True)] * 6

    def failing():
        yield make_job(USER_TEXTS[0], max_tokens=4)
        raise OSError("the job file went away")

    with pytest.raises(OSError):
        list(engine.run_all(failing(), total=2))
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_collector_nests_and_leaves_a_disabled_collector_alone():
    import gc

    from batchgen.engine.collector import YOUNG_THRESHOLD, fewer_collections

    before = gc.get_threshold()
    with fewer_collections():
        with fewer_collections():
            assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD and gc.get_freeze_count() > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with fewer_collections():
            assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    finally:
        gc.enable()
