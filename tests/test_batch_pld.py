"""Prompt lookup in a batch: the pure pieces on literal data, then batched
float32 greedy texts with drafts verified in batch passes equal to each job's
plain text alone."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache

from batchgen.engine.batch_pld import BatchDraftPolicy, accepted_prefix, cut_rejected, verify_inputs
from batchgen.config import DecodeConfig, EngineConfig, PromptCacheConfig, SamplingConfig
from batchgen.engine.core import Engine
from batchgen.jobs import NATIVE, BadJob

from test_batch import LENGTHS, TEXTS
from test_engine import make_job

LOOPY = ["ab ab ab ab ab", "import os\nimport os\nimport", "for i in range(10):\n    print(i * i)\n" * 2]


# -- pure pieces ------------------------------------------------------------------


def test_accepted_prefix_stops_at_the_first_disagreement():
    assert accepted_prefix([5, 6, 7], [5, 6, 9, 2]) == 2
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 2]) == 3
    assert accepted_prefix([5, 6, 7], [1, 6, 7, 2]) == 0  # later agreement does not count
    assert accepted_prefix([], [3]) == 0


def test_verify_inputs_pad_each_row_to_the_width():
    assert verify_inputs([3, 8, 4], [[1, 2], [], [9, 9, 9]], 4) == [[3, 1, 2, 3], [8, 8, 8, 8], [4, 9, 9, 9]]


def test_cut_rejected_keeps_rows_right_aligned():
    """Rows of 2 and 3 tokens (padding 2 and 1) got a pass of width 3 at
    positions 3..5; row 0 keeps 1 of them, row 1 all 3."""
    c = BatchKVCache([2, 1])
    cols = mx.arange(6, dtype=mx.float32)
    c.keys = mx.stack([cols + 10, cols + 20])[:, None, :, None]  # (2, 1, 6, 1): value = column (+ row tag)
    c.values = -c.keys
    c._idx, c.offset = 6, mx.array([4, 5])
    cut_rejected([c], [2, 0])
    row0, row1 = c.keys[0, 0, :, 0].tolist(), c.keys[1, 0, :, 0].tolist()
    assert row0[4:] == [12, 13]  # its tokens (2, 3), then its kept pass position (3)
    assert row0[2:] == [10, 11, 12, 13] and c.left_padding.tolist() == [4, 1]
    assert row1 == [20, 21, 22, 23, 24, 25]
    assert c.offset.tolist() == [2, 5]
    assert (c.values == -c.keys).all().item()
    assert c._idx == 6


def test_cut_rejected_rolls_every_head_of_every_row():
    """Against mlx-lm's `dynamic_roll` (an element-wise gather), on heads and
    head sizes that differ between keys and values."""
    from mlx_lm.models.cache import dynamic_roll

    c = BatchKVCache([0, 0, 0])
    c.keys, c.values = mx.random.normal((3, 2, 7, 4)), mx.random.normal((3, 2, 7, 5))
    c.offset = mx.array([7, 7, 7])
    keys, values, shifts = c.keys, c.values, mx.array([3, 0, 5])
    cut_rejected([c], [3, 0, 5])
    assert mx.array_equal(c.keys, dynamic_roll(keys, shifts[:, None], axis=2))
    assert mx.array_equal(c.values, dynamic_roll(values, shifts[:, None], axis=2))
    assert c.left_padding.tolist() == [3, 0, 5] and c.offset.tolist() == [4, 7, 2]


def test_policy_verifies_while_kept_tokens_beat_plain_steps():
    p = BatchDraftPolicy(min_plain_steps=2, explore_every=3)
    assert p.worth(8, 4)  # nothing measured: try
    p.verified(5.0, 10, 5)  # the first pass builds kernels: its seconds are not counted
    assert p.verify_pass_s.value is None and p.worth(8, 4)
    p.stepped(0.010)
    p.verified(0.015, 10, 5)  # half the drafts kept
    assert p.worth(8, 16)  # (8 + 8) / 0.015 > 1.05 * 8 / 0.010
    assert not p.worth(8, 4)  # (8 + 2) / 0.015 < 1.05 * 8 / 0.010
    assert not p.look_now()  # a skip: plain steps first
    p.stepped(0.010)
    p.stepped(None)
    assert p.look_now()
    assert not p.worth(8, 4)
    assert p.worth(8, 4)  # the third skip explores


def test_policy_looks_less_often_while_passes_do_not_pay():
    p = BatchDraftPolicy(min_plain_steps=2, max_plain_steps=8, explore_every=100)
    p.verified(1.0, 10, 0)
    p.verified(0.030, 10, 0)  # nothing kept: a pass gives 8 tokens in 30 ms, a step 8 in 10
    p.stepped(0.010)
    waits = []
    for _ in range(4):
        assert not p.worth(8, 4)
        steps = 0
        while not p.look_now():
            p.stepped(0.010)
            steps += 1
        waits.append(steps)
    assert waits == [2, 4, 8, 8]
    p.verified(0.030, 10, 10)  # a pass ran (explored): look again right after it
    assert p.look_now()


def test_no_draft_is_a_skip_too():
    p = BatchDraftPolicy(min_plain_steps=3)
    assert not p.worth(8, 0) and not p.look_now()


def test_a_policy_that_is_not_adaptive_verifies_every_draft():
    p = BatchDraftPolicy(adaptive=False)
    p.stepped(0.001)
    p.verified(1.0, 10, 0)
    assert p.look_now() and p.worth(8, 1) and not p.worth(8, 0)


# -- exactness on tiny models -----------------------------------------------------


def engine(path, batch_size, draft="pld", compiled=True, pool=True, max_lookup=5, short_attention=None):
    cfg = EngineConfig(
        model=str(path), fuse=False, batch_size=batch_size, compiled_batch_step=compiled, short_attention=short_attention,
        decode=DecodeConfig(draft=draft, pld_adaptive=False, pld_max_lookup=max_lookup, pld_in_batch=True),
        prompt_cache=PromptCacheConfig(enabled=pool, prewarm=False),
    )  # fmt: skip
    return Engine.load(cfg)


def jobs(sampling=None, max_tokens=None):
    texts = TEXTS + LOOPY
    lengths = LENGTHS + [40, 33, 48]
    return [make_job(t, max_tokens=max_tokens or n, job_id=f"j{i}", sampling=sampling)
            for i, (t, n) in enumerate(zip(texts, lengths))]  # fmt: skip


def check_equal(got, seq):
    assert sorted(r.id for r in got) == sorted(seq)
    for r in got:
        assert r.ok, r.error
        assert r.text == seq[r.id].text, r.id
        assert r.usage.completion_tokens == seq[r.id].usage.completion_tokens, r.id
        assert r.finish_reason == seq[r.id].finish_reason, r.id


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("batch_size,compiled", [(3, True), (8, True), (4, False)])
def test_batched_pld_greedy_equals_plain_greedy(model_dir, arch, batch_size, compiled):
    path = model_dir(arch)
    seq = {r.id: r for r in engine(path, 1, draft="none").run_all(jobs())}
    e = engine(path, batch_size, compiled=compiled)
    got = list(e.run_all(jobs()))
    check_equal(got, seq)
    report = e.batch_report
    assert report["verify_passes"] > 0 and report["drafted"] > 0
    assert sum(r.stats.pld_drafted for r in got) == report["drafted"]
    assert sum(r.stats.pld_accepted for r in got) == report["accepted"]
    assert all(r.stats.draft == "pld" for r in got)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_batched_pld_through_short_attention(model_dir, arch):
    """The plain-op attention that serves verify passes on CUDA (one
    `BatchKVCache` pass of width positions a row) keeps the texts exact."""
    from batchgen.kernels.attention import uninstall_short_attention

    path = model_dir(arch)
    seq = {r.id: r for r in engine(path, 1, draft="none").run_all(jobs())}
    e = engine(path, 4, short_attention=True)
    calls = []
    from batchgen.kernels import attention

    real = attention.short_attention
    attention.short_attention = lambda q, *a: calls.append(q.shape[2]) or real(q, *a)
    try:
        got = list(e.run_all(jobs()))
    finally:
        attention.short_attention = real
        uninstall_short_attention(e.model)
    check_equal(got, seq)
    assert 6 in calls  # the passes went through it


def test_batched_pld_on_a_repeating_model_keeps_drafts_and_saves_passes(model_dir):
    path = model_dir("qwen2", repeater=True)
    seq = {r.id: r for r in engine(path, 1, draft="none").run_all(jobs(max_tokens=40))}
    e = engine(path, 4)
    got = list(e.run_all(jobs(max_tokens=40)))
    check_equal(got, seq)
    assert e.batch_report["accepted"] >= 0.8 * e.batch_report["drafted"] > 0
    for r in got:
        if r.usage.completion_tokens >= 20:
            assert r.stats.forward_passes < r.usage.completion_tokens / 2, r.id


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 13])
def test_max_tokens_inside_a_kept_draft(model_dir, max_tokens):
    path = model_dir("qwen2", repeater=True)
    seq = {r.id: r for r in engine(path, 1, draft="none").run_all(jobs(max_tokens=max_tokens))}
    got = list(engine(path, 3).run_all(jobs(max_tokens=max_tokens)))
    check_equal(got, seq)
    assert all(r.usage.completion_tokens == max_tokens and r.finish_reason == "length" for r in got)


@pytest.mark.parametrize("stop_len", [1, 3, 6])
def test_stop_string_inside_a_kept_draft(model_dir, stop_len):
    path = model_dir("qwen2", repeater=True)
    plain = engine(path, 1, draft="none")
    full = plain.run(make_job("hello hello", max_tokens=20)).text
    stop = [full[2 : 2 + stop_len]]
    batch = [make_job(t, max_tokens=20, stop=stop, job_id=f"s{i}") for i, t in enumerate(["hello hello"] + LOOPY)]
    seq = {r.id: r for r in plain.run_all(batch)}
    got = list(engine(path, 4).run_all(batch))
    check_equal(got, seq)
    assert got[0].finish_reason == "stop" or any(r.finish_reason == "stop" for r in got)


def test_sampling_rows_ride_along_with_their_own_samples(model_dir):
    """Greedy rows draft; seeded sampling rows in the same passes draw what
    they draw alone with plain decoding."""
    path = model_dir("qwen2")
    mixed = jobs()
    for i in (1, 4, 8):
        mixed[i] = make_job(mixed[i].messages[0]["content"], max_tokens=12, job_id=mixed[i].id,
                            sampling=SamplingConfig(temperature=0.8, seed=i))  # fmt: skip
    seq = {r.id: r for r in engine(path, 1, draft="none").run_all(mixed)}
    e = engine(path, 4)
    got = list(e.run_all(mixed))
    check_equal(got, seq)
    assert e.batch_report["verify_passes"] > 0
    assert {r.id for r in got if r.stats.draft == "none"} == {"j1", "j4", "j8"}


def test_failing_job_fails_alone_beside_drafting_rows(model_dir):
    path = model_dir("qwen2", max_position_embeddings=80)
    items = jobs(max_tokens=20)
    items.insert(2, make_job("long " * 90, max_tokens=5, job_id="too-long"))
    items.insert(4, BadJob("bad", 99, NATIVE, "invalid_json", "not valid JSON"))
    seq = {r.id: r for r in engine(path, 1, draft="none").run_all(items)}
    e = engine(path, 3)
    got = {r.id: r for r in e.run_all(items)}
    assert got["too-long"].error.type == "prompt_too_long" and got["bad"].error.type == "invalid_json"
    assert e.batch_report["verify_passes"] > 0
    check_equal([r for r in got.values() if r.ok], {k: r for k, r in seq.items() if r.ok})


def test_batched_rows_decode_plainly_unless_asked(model_dir):
    path = model_dir("qwen2")
    cfg = EngineConfig(model=str(path), fuse=False, batch_size=4, decode=DecodeConfig(draft="pld", pld_adaptive=False),
                       prompt_cache=PromptCacheConfig(enabled=False))  # fmt: skip
    e = Engine.load(cfg)
    got = list(e.run_all(jobs()))
    assert all(r.ok and r.stats.draft == "none" and r.stats.pld_drafted == 0 for r in got)
    assert "verify_passes" not in e.batch_report and e.batch_report["steps"] > 0


def test_rows_cut_back_by_rejections_are_compacted(model_dir, monkeypatch):
    """Every pass grows the padding of rows that rejected drafts; the part all
    rows share is cut, so each pass starts with the buffers less than
    compaction's threshold past the longest row."""
    from batchgen.engine import scheduler as batch

    path = model_dir("llama")
    long = [make_job(t, max_tokens=90, job_id=f"l{i}") for i, t in enumerate(LOOPY)]
    seq = {r.id: r for r in engine(path, 1, draft="none").run_all(long)}
    excess = []
    real = batch.BatchScheduler._verify

    def spy(self):
        held = [len(r.tokens) + r.text.completion_tokens - 1 for r in self.rows if r is not None]  # the last is fed next
        excess.append(self.cache[0]._idx + self.stepper.used - max(held))  # (the window not yet flushed)
        return (yield from real(self))

    monkeypatch.setattr(batch.BatchScheduler, "_verify", spy)
    e = engine(path, 3, max_lookup=8)
    got = list(e.run_all(long))
    check_equal(got, seq)
    assert e.batch_report["verify_passes"] > 20
    assert e.batch_report["accepted"] < e.batch_report["drafted"]  # rows were cut back
    assert 0 <= min(excess) and max(excess) < batch._COMPACT_PAD
