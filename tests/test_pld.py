"""Prompt-lookup decoding: the pure draft search on literal token lists, and
exactness against plain greedy decoding on tiny real models (float32, CPU)."""

import mlx.core as mx
import numpy as np
import pytest

from batchgen.config import DecodeConfig, EngineConfig, PromptCacheConfig, SamplingConfig
from batchgen.engine.core import Engine
from batchgen.decode.drafts import DraftPolicy, Survival, find_draft

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


def policy(plain_s, passes: dict, kept: list[int] = (), reached: list[int] = ()) -> DraftPolicy:
    """A policy that measured a plain token at `plain_s`, verify passes by tokens
    fed ({fed: seconds}), and the run's survival counts by draft position."""
    p = DraftPolicy()
    p.plain_token_s.add(plain_s)
    for fed, seconds in passes.items():
        p.add_pass(fed, seconds)
    p.survival = Survival(list(reached), list(kept))
    return p


def test_policy_verifies_only_when_tokens_per_second_beat_plain():
    # 9 of 10 first draft tokens kept, then half: E(1) = 1.9 tokens a pass
    run = dict(reached=[10, 9], kept=[9, 4])
    # a pass costs 3 plain tokens at any length: 1.9 / 30 ms < 1.05 / 10 ms
    p = policy(0.010, {2: 0.030, 17: 0.030}, **run)
    assert p.draft_length(Survival(), found=1, skipped=1) == 0
    # the same pass at 1.5 plain tokens: 1.9 / 15 ms > 1.05 / 10 ms
    assert policy(0.010, {2: 0.015, 17: 0.015}, **run).draft_length(Survival(), 1, 1) == 1
    # a job whose own drafts were all kept outweighs the run's record:
    # E(3) = 1 + .972 + .884 + .810 = 3.67 tokens / 30 ms > 1.05 / 10 ms
    job = Survival([20, 20, 20], [20, 20, 20])
    assert p.draft_length(job, found=3, skipped=1) == 3


def test_policy_picks_the_draft_length_by_cost():
    # every token kept 90% of the time; a pass costs by its tokens (a CPU) ...
    run = dict(reached=[100] * 8, kept=[90] * 8)
    by_tokens = {2: 0.020, 9: 0.090}  # 10 ms a token fed
    p = policy(0.012, by_tokens, **run)
    # E(L) / cost(L+1) is largest at L = 1: 1.89 tokens / 20 ms > 1.05 / 12 ms
    assert p.draft_length(Survival(), found=8, skipped=1) == 1
    # ... or the same whatever its length (a GPU): the whole draft
    flat = policy(0.012, {2: 0.008, 9: 0.008}, **run)
    assert flat.draft_length(Survival(), found=8, skipped=1) == 8
    # static shapes: every pass is fed pad_to tokens, so its cost is that length's
    assert p.draft_length(Survival(), found=8, skipped=1, pad_to=9) == 0


def test_policy_explores_and_starts_optimistic():
    p = policy(0.010, {2: 0.030}, reached=[10], kept=[0])
    assert p.draft_length(Survival(), 3, skipped=63) == 0
    assert p.draft_length(Survival(), 3, skipped=64) == 3
    assert DraftPolicy().draft_length(Survival(), 3, 1) == 3  # nothing measured: try drafting
    assert DraftPolicy(adaptive=False).draft_length(Survival(), 3, 1) == 3
    fresh = DraftPolicy()
    fresh.plain_token_s.add(0.01)
    assert fresh.draft_length(Survival(), 3, 1) == 3  # no verify cost known yet


def test_policy_records_job_and_run():
    p, job = DraftPolicy(), Survival()
    p.record(job, 4, 2)  # positions 0, 1 kept, 2 rejected, 3 never reached
    p.record(job, 1, 1)
    assert (job.reached, job.kept) == ([2, 1, 1], [2, 1, 0])
    assert p.survival == job


def test_best_start_ranks_as_a_plain_scan_does():
    """Against the rule written out: the most agreeing context (up to 32 back),
    the latest on ties; periodic text (many full agreements) and random text."""
    import random

    from batchgen.decode.drafts import _RANK_CONTEXT, _best_start

    def reference(a, starts, n):
        def agree(s):
            k = 0
            while k < _RANK_CONTEXT and s - k - 1 >= 0 and a[s - k - 1] == a[len(a) - n - k - 1]:
                k += 1
            return k

        return max(reversed(starts), key=agree)  # max keeps the first of equals: the latest

    rng = random.Random(7)
    for trial in range(300):
        period = rng.choice([1, 2, 3, 7, 40])
        base = [rng.randrange(4) for _ in range(period)]
        a = [base[i % period] if rng.random() > 0.05 * (trial % 3) else rng.randrange(4) for i in range(rng.randrange(2, 200))]
        n = min(rng.randrange(1, 4), len(a) - 1)
        starts = [i for i in range(len(a) - n) if a[i : i + n] == a[-n:]][-64:]
        if starts:
            start, agreement = _best_start(a, starts, n)
            assert start == reference(a, starts, n), (a, n)
            assert a[start - agreement : start + n] == a[len(a) - n - agreement :]  # the agreement is real
            assert agreement == _RANK_CONTEXT or start == agreement or a[start - agreement - 1] != a[-n - agreement - 1]


def test_ngram_index_equals_find_draft_on_random_sequences():
    import random

    from batchgen.decode.drafts import NgramIndex

    rng = random.Random(0)
    for trial in range(30):
        alphabet = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 200))]
        n, k = rng.randrange(1, 5), rng.randrange(0, 7)
        index = NgramIndex(tokens[:1], n)
        for i in range(1, len(tokens)):
            assert index.draft(k) == find_draft(tokens[:i], n, k), (trial, i)
            index.extend(tokens[i : i + 1])
        # truncate restores an earlier state exactly
        cut = rng.randrange(1, len(tokens) + 1)
        index.truncate(cut)
        assert index.tokens == tokens[:cut] and index.draft(k) == find_draft(tokens[:cut], n, k)
        index.extend(tokens[cut:])
        assert index.draft(k) == find_draft(tokens, n, k)


def test_follow_drafts_from_another_list_as_a_plain_scan_does():
    """`NgramIndex.follow` against the rule written out over a second list (a
    predicted output): the longest n-gram of the context's end found with a token
    after it, the most agreeing context before it (latest on ties), the tokens
    after it; and what it reports as matched is the real common run."""
    import random

    from batchgen.decode.drafts import _RANK_CONTEXT, NgramIndex

    def reference(src, ctx, ngram, k):
        for n in range(min(ngram, len(ctx)), 0, -1):
            starts = [s for s in range(len(src) - n) if src[s : s + n] == ctx[-n:]][-64:]
            if starts:
                def agree(s):
                    j = 0
                    while j < _RANK_CONTEXT and s - j - 1 >= 0 and len(ctx) - n - j - 1 >= 0 and src[s - j - 1] == ctx[-n - j - 1]:
                        j += 1
                    return j

                best = max(reversed(starts), key=agree)
                return n + agree(best), src[best + n : best + n + k]
        return 0, []

    rng = random.Random(3)
    for trial in range(300):
        alphabet = rng.choice([2, 3, 6])
        src = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 80))]
        ctx = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 60))]
        if rng.random() < 0.5:  # the context ends inside a copy of the list
            cut = rng.randrange(1, len(src) + 1)
            ctx += src[:cut]
        ngram, k = rng.randrange(1, 4), rng.randrange(1, 6)
        assert NgramIndex(src, ngram).follow(ctx, k) == reference(src, ctx, ngram, k), (src, ctx, ngram, k)


def test_a_prediction_is_drafted_from_where_it_agrees_more_with_the_output():
    from batchgen.decode.drafts import NgramIndex, predicted_draft

    # the output so far: 1 2 3 4; the context (prompt + output) also holds 3 4 then 9 9
    context = [3, 4, 9, 9, 0, 1, 2, 3, 4]
    prediction = NgramIndex([0, 1, 2, 3, 4, 5, 6], 3)  # the prompt's last token 0, then the predicted output
    own = NgramIndex(context, 3).match(4)
    assert own == (2, [9, 9, 0, 1])  # only "3 4" agrees before the context's own draft
    assert prediction.follow(context, 4) == (3 + 2, [5, 6])  # "2 3 4", and the "0 1" before it, agree
    assert predicted_draft(own, prediction.follow(context, 4)) == [5, 6]
    # where the output has left the prediction, the context's own draft wins ("5 1 2 3" against "1 2 3")
    context = [5, 1, 2, 3, 8, 8, 5, 1, 2, 3]
    assert predicted_draft(NgramIndex(context, 3).match(2), NgramIndex([6, 1, 2, 3, 4], 3).follow(context, 2)) == [8, 8]


def test_prediction_usage_counts_the_prediction_s_tokens_found_in_the_output():
    from batchgen.decode.drafts import prediction_usage

    assert prediction_usage([1, 2, 3], [1, 2, 3, 2]) == (3, 0)  # all of it, in order
    assert prediction_usage([1, 2, 3, 4, 5, 6], [1, 2, 7, 7, 5, 6]) == (4, 2)  # 3 4 replaced
    assert prediction_usage([1, 2, 3], [3, 2, 1]) == (1, 2)  # in order: one of them
    assert prediction_usage([5, 5, 5, 5], [5, 5]) == (2, 2)  # each output token matched once
    assert prediction_usage([1, 2], [3, 4]) == (0, 2)
    rng = np.random.default_rng(0)
    for _ in range(50):
        p, o = rng.integers(0, 4, rng.integers(0, 30)).tolist(), rng.integers(0, 4, rng.integers(0, 30)).tolist()
        accepted, rejected = prediction_usage(p, o)
        assert accepted + rejected == len(p) and 0 <= accepted <= min(len(p), len(o))


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


@pytest.mark.parametrize("static, pipeline", [(False, False), (True, False), (True, True)])
def test_turboquant_trims_stay_within_the_exact_reserve(model_dir, monkeypatch, static, pipeline):
    """A TurboQuant job's cache keeps exact copies for the trims its verify can
    make: a pass (6: a recurrent model's rollback trims it whole), or, pipelined,
    two passes (12); PLD then trims no further back than that, and gives plain
    decoding's text (recurrent models: tests/test_compose.py)."""
    from batchgen.cache.turboquant import TurboQuantKVCache
    from batchgen.config import KVConfig

    trims = []
    trim = TurboQuantKVCache.trim
    monkeypatch.setattr(TurboQuantKVCache, "trim", lambda self, n: trims.append(n) or trim(self, n))
    cfg = EngineConfig(
        model=str(model_dir("qwen2")), fuse=False, kv=KVConfig(kind="turboquant"),
        decode=DecodeConfig(draft="pld", pld_static_shapes=static, pld_adaptive=False, pld_pipeline=pipeline),
        prompt_cache=PromptCacheConfig(enabled=False),
    )  # fmt: skip
    engine = Engine.load(cfg)
    reserve = engine.make_cache(cfg.kv)[0].trim_reserve
    assert reserve == (12 if pipeline else 6)
    drafted = 0
    for text in LOOPY:
        plain = engine.run(make_job(text, max_tokens=40, draft="none"))
        fast = engine.run(make_job(text, max_tokens=40, draft="pld"))
        assert fast.text == plain.text and fast.stats.kv_cache == "turboquant"
        drafted += fast.stats.pld_drafted
    assert drafted > 0 and trims and max(trims) <= reserve


@pytest.mark.parametrize("pipeline", [True, False])
def test_pld_on_a_repeating_model_accepts_and_cuts_passes(model_dir, pipeline):
    engine = pld_engine(model_dir("qwen2", repeater=True), pipeline=pipeline)
    plain = engine.run(make_job("hello hello", max_tokens=40, draft="none"))
    fast = engine.run(make_job("hello hello", max_tokens=40, draft="pld"))
    assert fast.text == plain.text
    assert fast.stats.pld_accepted >= 30
    assert fast.stats.forward_passes <= 12 < plain.stats.forward_passes


@pytest.mark.parametrize("static, pipeline", [(False, True), (True, True), (False, False)])
def test_a_prediction_never_changes_the_text(model_dir, static, pipeline):
    """A job's `prediction` (OpenAI's predicted outputs) is a second source of drafts,
    all verified: given the output itself, text that is not the output, or another
    prompt's output, the text is plain decoding's."""
    from dataclasses import replace

    engine = pld_engine(model_dir("qwen2"), static=static, pipeline=pipeline)
    for text in USER_TEXTS[:2]:
        plain = engine.run(make_job(text, max_tokens=40, draft="none"))
        other = engine.run(make_job(text + " again", max_tokens=40, draft="none")).text
        for prediction in (plain.text, "def f(x):\n    return x\n", other, plain.text[: len(plain.text) // 2] + "zz"):
            fast = engine.run(replace(make_job(text, max_tokens=40, draft="pld"), prediction=prediction))
            assert fast.ok, fast.error
            assert (fast.text, fast.usage.completion_tokens) == (plain.text, plain.usage.completion_tokens)
            u, predicted = fast.usage, engine.prediction_tokens(replace(make_job(text), prediction=prediction))
            assert u.accepted_prediction_tokens + u.rejected_prediction_tokens == len(predicted) > 0, prediction
        assert plain.usage.accepted_prediction_tokens is None  # no prediction, no figure


@pytest.mark.parametrize("pipeline", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_predicted_output_cuts_the_passes_of_edits(pipeline):
    """The demo model (float32) on edit jobs: with each job's expected answer as its
    prediction, more tokens come from verified drafts and fewer passes run than with
    prompt lookup alone; with another job's answer, the text is the same as ever."""
    from dataclasses import replace
    import json
    from pathlib import Path

    from batchgen.config import DEMO_MODEL_DIR

    root = Path(__file__).resolve().parents[1]
    answers = {a["id"]: a["answer"] for a in map(json.loads, (root / "jobs/answers/edits.jsonl").read_text().splitlines())}
    from test_demo_model import demo_jobs

    jobs = [j for j in demo_jobs() if j.id in ("rename-021", "rename-026", "remove_comments-006")]
    cfg = EngineConfig(model=str(DEMO_MODEL_DIR), dtype="float32",
                       decode=DecodeConfig(draft="pld", pld_adaptive=False, pld_pipeline=pipeline),
                       prompt_cache=PromptCacheConfig(enabled=False))  # fmt: skip
    engine = Engine.load(cfg)
    alone = told = 0
    for job, wrong in zip(jobs, jobs[1:] + jobs[:1]):
        plain = engine.run(job)
        right = engine.run(replace(job, prediction=f"```python\n{answers[job.id]}\n```"))
        misled = engine.run(replace(job, prediction=f"```python\n{answers[wrong.id]}\n```"))
        assert right.text == plain.text == misled.text, job.id
        alone += plain.stats.forward_passes
        told += right.stats.forward_passes
        assert right.stats.pld_accepted > plain.stats.pld_accepted, job.id
        # the right answer is found in the output nearly whole; another job's far less
        assert right.usage.rejected_prediction_tokens < 0.1 * right.usage.accepted_prediction_tokens, job.id
        assert misled.usage.accepted_prediction_tokens < right.usage.accepted_prediction_tokens, job.id
    assert told < 0.7 * alone, (told, alone)


class PrefixPolicy(DraftPolicy):
    """Verifies at most `most` tokens of every draft (0: none), as the adaptive
    policy does where short prefixes pay."""

    def __init__(self, most: int):
        super().__init__(calibrated=True)
        self.most = most

    def draft_length(self, job, found, skipped, pad_to=None):
        return min(found, self.most)


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("static", [False, True])
def test_pld_verifies_the_prefix_the_policy_picks(model_dir, pipeline, static):
    engine = pld_engine(model_dir("qwen2", repeater=True), static=static, adaptive=True, pipeline=pipeline)
    plain = engine.run(make_job("hello hello", max_tokens=40, draft="none"))
    for most in (0, 1, 2):
        engine.draft_policy = PrefixPolicy(most)
        fast = engine.run(make_job("hello hello", max_tokens=40, draft="pld"))
        assert fast.text == plain.text and fast.usage.completion_tokens == 40
        # every verify pass took at most `most` draft tokens, all kept on this model:
        # each pass yields most + 1 tokens where plain steps yield 1
        assert fast.stats.pld_accepted == fast.stats.pld_drafted
        verify_passes = fast.stats.pld_drafted // most if most else 0
        assert fast.stats.pld_drafted <= most * fast.stats.forward_passes
        if most:
            assert verify_passes >= 10 and fast.stats.forward_passes < plain.stats.forward_passes
        else:
            assert fast.stats.pld_drafted == 0


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
    from batchgen.decode.pld import accept_sampled
    from batchgen.decode.sampling import make_keys

    vocab = 6
    logits = mx.array([[1.0, 0.5, 0.0, -0.5, 2.0, 0.2], [0.3, 0.1, 0.0, 1.5, -1.0, 0.0]])
    s = SamplingConfig(temperature=1.0, seed=0)
    p = np.array(mx.softmax(logits[0]).tolist())
    n_trials = 3000
    for draft in ([4, 3], [2, 0]):  # a likely and an unlikely first draft token
        counts = np.zeros(vocab)
        for seed in range(n_trials):
            n, bonus = accept_sampled(logits, draft, s, make_keys(seed, 4), 0)
            first = draft[0] if n >= 1 else bonus
            counts[first] += 1
        freq = counts / n_trials
        # 4 sigma of a binomial proportion at n=3000 is below 0.037
        assert np.abs(freq - p).max() < 0.037, (draft, freq, p)


def test_sampled_verify_keeps_the_second_token_distribution():
    """Given the first draft token was kept, the second token follows the
    model's next distribution (row 1), whether the second draft is kept or not."""
    from batchgen.decode.pld import accept_sampled
    from batchgen.decode.sampling import make_keys

    logits = mx.array([[0.0, 0.0, 0.0, 0.0, 3.0, 0.0], [0.3, 0.1, 0.0, 1.5, -1.0, 0.0], [0.0] * 6])
    s = SamplingConfig(temperature=1.0, seed=0)
    p1 = np.array(mx.softmax(logits[1]).tolist())
    counts, kept_first = np.zeros(6), 0
    for seed in range(3000):
        n, bonus = accept_sampled(logits, [4, 3], s, make_keys(seed, 4), 0)
        if n >= 1:
            kept_first += 1
            counts[3 if n == 2 else bonus] += 1
    freq = counts / kept_first
    sigma4 = 4 * np.sqrt(p1 * (1 - p1) / kept_first)
    assert kept_first > 2000 and np.all(np.abs(freq - p1) < sigma4 + 1e-3), (freq, p1)


def test_pld_sampling_is_reproducible_per_seed(model_dir):
    engine = pld_engine(model_dir("qwen2"))
    s = SamplingConfig(temperature=0.8, seed=11)
    a = engine.run(make_job(LOOPY[0], sampling=s, draft="pld", max_tokens=30))
    b = engine.run(make_job(LOOPY[0], sampling=s, draft="pld", max_tokens=30))
    assert a.text == b.text and a.ok


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_short_attention_path_keeps_pld_exact(model_dir, arch):
    """The plain-op attention used for short passes on CUDA gives the same
    greedy text as the fused kernel (float32)."""
    from batchgen.cache.fp16 import Fp16Cache

    path = model_dir(arch)
    reference = pld_engine(path)
    cfg = EngineConfig(model=str(path), fuse=False, short_attention=True,
                       decode=DecodeConfig(draft="pld", pld_adaptive=False, pld_static_shapes=True),
                       prompt_cache=PromptCacheConfig(enabled=True, prewarm=False))  # fmt: skip
    engine = Engine.load(cfg)
    assert all(c.max_queries > 1 for c in engine.make_cache(engine.config.kv) if isinstance(c, Fp16Cache))
    for text in LOOPY + USER_TEXTS[:2]:
        a = reference.run(make_job(text, max_tokens=40, draft="none"))
        b = engine.run(make_job(text, max_tokens=40))
        assert b.text == a.text, (arch, text)


def test_short_attention_matches_fused_kernel():
    from batchgen.cache.fp16 import short_attention

    mx.random.seed(0)
    for heads, kv_heads, L, S in [(4, 2, 6, 37), (8, 8, 2, 2), (6, 2, 17, 300)]:
        q = mx.random.normal((1, heads, L, 16))
        k, v = mx.random.normal((1, kv_heads, S, 16)), mx.random.normal((1, kv_heads, S, 16))
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
        got = short_attention(q, k, v, 0.25, "causal")
        assert mx.allclose(got, want, atol=1e-5).item()
        boolmask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
        assert mx.allclose(short_attention(q, k, v, 0.25, boolmask), want, atol=1e-5).item()


def test_short_attention_over_left_padded_rows_stays_finite():
    """A batch pass's mask (B, 1, L, S): a row's padding positions see no key
    at all; they come out finite (NaN there would reach the row's real
    queries through its cache), and the real positions as the fused kernel gives."""
    from mlx_lm.models.base import create_causal_mask

    from batchgen.cache.fp16 import short_attention

    mx.random.seed(1)
    q, k, v = mx.random.normal((2, 4, 6, 16)), mx.random.normal((2, 2, 6, 16)), mx.random.normal((2, 2, 6, 16))
    mask = create_causal_mask(6, left_padding=mx.array([0, 3]))  # (2, 1, 6, 6): row 1's first 3 see nothing
    got = short_attention(q, k, v, 0.25, mask)
    assert mx.isfinite(got).all().item()
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert mx.allclose(got[0], want[0], atol=1e-5).item()
    assert mx.allclose(got[1, :, 3:], want[1, :, 3:], atol=1e-5).item()
