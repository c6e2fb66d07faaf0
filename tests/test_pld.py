"""Prompt-lookup decoding: the pure draft search on literal token lists, and
exactness against plain greedy decoding on tiny real models (float32, CPU)."""

import mlx.core as mx
import numpy as np
import pytest

from batchgen.config import DecodeConfig, EngineConfig, PromptCacheConfig, SamplingConfig
from batchgen.engine import Engine
from batchgen.pld import DraftPolicy, _Ema, find_draft

from test_engine import USER_TEXTS, make_job
from tiny import ARCHS


# -- find_draft: pure function, literal data ---------------------------------


def test_find_draft_worked_example():
    tokens = [5, 1, 2, 3, 9, 7, 1, 2, 3, 4, 6, 8, 1, 2, 3]
    assert find_draft(tokens, 3, 3) == [4, 6, 8]


def test_find_draft_prefers_longer_ngram():
    # [2, 3] occurs at 1 and 6; only the one at 6 is preceded by 1 -> 3-gram [1, 2, 3]
    tokens = [0, 2, 3, 7, 7, 1, 2, 3, 8, 9, 1, 2, 3]
    assert find_draft(tokens, 3, 2) == [8, 9]
    assert find_draft(tokens, 1, 2) == [8, 9]  # 1-gram [3]: most recent, equal context
    assert find_draft([0, 2, 3, 7, 5, 2, 3], 2, 1) == [7]


def test_find_draft_ranks_by_agreeing_context_then_recency():
    # [4, 5] occurs at 1 (preceded by 9, 9) and at 5 (preceded by 0, 9); the
    # suffix is preceded by 9, 9 -> the earlier occurrence agrees for longer.
    tokens = [9, 4, 5, 1, 0, 4, 5, 2, 9, 9, 4, 5]
    assert find_draft(tokens, 2, 1) == [1]


def test_find_draft_falls_back_to_shorter_ngrams_and_limits():
    assert find_draft([1, 2, 3], 2, 5) == []
    assert find_draft([7, 8, 9, 7], 3, 5) == [8, 9, 7, 8, 9]
    assert find_draft([7, 8, 9, 7], 3, 2) == [8, 9]
    assert find_draft([7, 8, 9, 7], 3, 0) == []
    assert find_draft([], 3, 5) == []
    assert find_draft([4], 3, 5) == []
    # a match overlapping the suffix continues periodically (overlapping copy)
    assert find_draft([1, 1, 1, 1], 2, 5) == [1, 1, 1, 1, 1]
    assert find_draft([8, 1, 2, 1, 2], 2, 5) == [1, 2, 1, 2, 1]
    assert find_draft([3, 1, 2, 9, 1, 2], 2, 4) == [9, 1, 2, 9]


# -- the adaptive policy --------------------------------------------------------


def test_policy_skips_drafts_that_do_not_pay():
    p = DraftPolicy()
    p.plain_s.add(0.010)
    p.verify_s[6] = _Ema(0.030)  # a verify pass costs 3 plain steps
    assert p.best_length(5, rate=0.2, pad_to=6) == 0  # 1.25 tokens per 30 ms: no
    assert p.best_length(5, rate=0.95, pad_to=6) == 5  # 5.7 tokens per 30 ms: yes


def test_policy_picks_draft_length_from_costs():
    p = DraftPolicy()
    p.plain_s.add(0.010)
    p.verify_s[2] = _Ema(0.012)
    p.verify_s[6] = _Ema(0.040)  # cost grows with length (a CPU)
    # at rate 0.6 a short draft pays best: 1.6 tok/12 ms > 2.2 tok/40 ms
    assert p.best_length(5, rate=0.6, pad_to=None) == 1


def test_policy_acceptance_blends_job_and_run():
    p = DraftPolicy(accepted=90, rejected=10)
    assert p.acceptance() == pytest.approx(91 / 102)
    assert p.acceptance(0, 8) < 0.5


# -- exactness on tiny models -----------------------------------------------------


def pld_engine(path, static=False, adaptive=False, pipeline=True):
    cfg = EngineConfig(
        model=str(path), fuse=False,
        decode=DecodeConfig(draft="pld", pld_static_shapes=static, pld_adaptive=adaptive, pld_pipeline=pipeline),
        prompt_cache=PromptCacheConfig(enabled=False),
    )  # fmt: skip
    return Engine.load(cfg)


LOOPY = ["ab ab ab ab ab", "import os\nimport os\nimport", "for i in range(10):\n    print(i * i)\n" * 2]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("static, pipeline", [(False, True), (True, True), (False, False), (True, False)])
def test_pld_greedy_equals_plain_greedy(model_dir, arch, static, pipeline):
    engine = pld_engine(model_dir(arch), static=static, pipeline=pipeline)
    drafted = 0
    for text in USER_TEXTS + LOOPY:
        plain = engine.run(make_job(text, max_tokens=40, draft="none"))
        fast = engine.run(make_job(text, max_tokens=40, draft="pld"))
        assert fast.ok, fast.error
        assert fast.text == plain.text
        assert fast.usage.completion_tokens == plain.usage.completion_tokens
        assert fast.stats.draft == "pld"
        drafted += fast.stats.pld_drafted
    assert drafted > 0  # drafts were verified, not just skipped


@pytest.mark.parametrize("pipeline", [True, False])
def test_pld_on_a_repeating_model_accepts_and_cuts_passes(model_dir, pipeline):
    engine = pld_engine(model_dir("qwen2", repeater=True), pipeline=pipeline)
    plain = engine.run(make_job("hello hello", max_tokens=40, draft="none"))
    fast = engine.run(make_job("hello hello", max_tokens=40, draft="pld"))
    assert fast.text == plain.text
    assert fast.stats.pld_accepted >= 30
    assert fast.stats.forward_passes <= 12 < plain.stats.forward_passes


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 13, 26])
@pytest.mark.parametrize("pipeline", [True, False])
def test_max_tokens_inside_an_accepted_draft(model_dir, max_tokens, pipeline):
    engine = pld_engine(model_dir("qwen2", repeater=True), pipeline=pipeline)
    plain = engine.run(make_job("hello hello", max_tokens=max_tokens, draft="none"))
    fast = engine.run(make_job("hello hello", max_tokens=max_tokens, draft="pld"))
    assert fast.usage.completion_tokens == plain.usage.completion_tokens == max_tokens
    assert fast.text == plain.text
    assert fast.finish_reason == "length"


@pytest.mark.parametrize("stop_len", [1, 3, 6, 15])
@pytest.mark.parametrize("pipeline", [True, False])
def test_stop_string_inside_an_accepted_draft(model_dir, stop_len, pipeline):
    engine = pld_engine(model_dir("qwen2", repeater=True), pipeline=pipeline)
    full = engine.run(make_job("hello hello", max_tokens=20, draft="none")).text
    stop = full[2 : 2 + stop_len]
    plain = engine.run(make_job("hello hello", max_tokens=20, stop=[stop], draft="none"))
    fast = engine.run(make_job("hello hello", max_tokens=20, stop=[stop], draft="pld"))
    assert fast.finish_reason == plain.finish_reason == "stop"
    assert fast.text == plain.text
    assert fast.usage.completion_tokens == plain.usage.completion_tokens


def test_pld_on_hybrid_recurrent_model_restores_state(model_dir):
    # qwen3_5 mixes linear-attention (recurrent, untrimmable) and attention layers
    engine = pld_engine(model_dir("qwen3_5"))
    assert any(not c.is_trimmable() for c in engine.make_cache(engine.config.kv))
    total = 0
    for text in LOOPY + USER_TEXTS:
        plain = engine.run(make_job(text, max_tokens=32, draft="none"))
        fast = engine.run(make_job(text, max_tokens=32, draft="pld"))
        assert fast.text == plain.text
        total += fast.stats.pld_drafted - fast.stats.pld_accepted
    assert total > 0  # some drafts were rejected, so state was rolled back


# -- sampling: the output distribution is unchanged ---------------------------------


def test_sampled_verify_keeps_the_target_distribution(model_dir):
    """Accept draft d with p(d), else sample p without d: the first token's
    distribution must be p whatever the draft, checked over 3000 seeds."""
    from batchgen.pld import PLDDecoder
    from batchgen.sampling import make_keys
    from batchgen.stats import JobStats

    vocab = 6
    logits = mx.array([[1.0, 0.5, 0.0, -0.5, 2.0, 0.2], [0.3, 0.1, 0.0, 1.5, -1.0, 0.0]])
    s = SamplingConfig(temperature=1.0, seed=0)
    p = np.array(mx.softmax(logits[0]).tolist())
    dec = PLDDecoder.__new__(PLDDecoder)
    dec.sampling, dec.ctx, dec.prompt_len = s, [0], 1
    n_trials = 3000
    for draft in ([4, 3], [2, 0]):  # a likely and an unlikely first draft token
        counts = np.zeros(vocab)
        for seed in range(n_trials):
            dec.keys = make_keys(seed, 4)
            n, bonus = dec._accept_sampled(logits, draft)
            first = draft[0] if n >= 1 else bonus
            counts[first] += 1
        freq = counts / n_trials
        # 4 sigma of a binomial proportion at n=3000 is below 0.037
        assert np.abs(freq - p).max() < 0.037, (draft, freq, p)


def test_pld_sampling_is_reproducible_per_seed(model_dir):
    engine = pld_engine(model_dir("qwen2"))
    s = SamplingConfig(temperature=0.8, seed=11)
    a = engine.run(make_job(LOOPY[0], sampling=s, draft="pld", max_tokens=30))
    b = engine.run(make_job(LOOPY[0], sampling=s, draft="pld", max_tokens=30))
    assert a.text == b.text and a.ok
