"""Logits processors, grammar masks and logprobs on literal arrays: penalties
as OpenAI and mlx-lm define them, the batch's device state equal to the one
job's definition row by row, masks bit for bit, logprobs as log_softmax."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors

from batchgen.config import LogitsConfig
from batchgen.decode.grammar import apply_masks
from batchgen.decode.logprobs import Entries, token_logprobs, top_k
from batchgen.logprob_entries import TokenPieces
from batchgen.decode.processors import LogitsState, processed

LOGITS = [[2.0, -1.0, 0.5, 3.0, -2.5, 0.0]]


def test_presence_and_frequency_follow_openai():
    """logit[t] -= count[t] * frequency + (count[t] > 0) * presence, counts over the output only."""
    cfg = LogitsConfig(presence_penalty=0.5, frequency_penalty=0.25)
    out = processed(mx.array(LOGITS), cfg, context=[4, 4, 4, 0, 3, 3], generated=[0, 3, 3]).tolist()[0]
    assert out == [2.0 - 0.25 - 0.5, -1.0, 0.5, 3.0 - 0.5 - 0.5, -2.5, 0.0]  # token 4 is prompt only: untouched


def test_negative_penalties_raise_logits():
    out = processed(mx.array(LOGITS), LogitsConfig(presence_penalty=-1.0), [1], [1]).tolist()[0]
    assert out[1] == 0.0 and out[0] == 2.0


def test_repetition_penalty_is_mlx_lms():
    """Sign-aware, each distinct token of the last context_size tokens of prompt and output once."""
    context = [5, 1, 1, 3, 2]
    cfg = LogitsConfig(repetition_penalty=2.0, repetition_context_size=3)
    ours = processed(mx.array(LOGITS), cfg, context, generated=[2]).tolist()[0]
    (theirs,) = make_logits_processors(repetition_penalty=2.0, repetition_context_size=3)
    assert ours == theirs(mx.array(context), mx.array(LOGITS)).tolist()[0]
    assert ours == [2.0, -2.0, 0.25, 1.5, -2.5, 0.0]


def test_logit_bias_adds_as_mlx_lm_does():
    cfg = LogitsConfig(logit_bias=((1, 5.0), (4, -100.0)))
    (theirs,) = make_logits_processors(logit_bias={1: 5.0, 4: -100.0})
    assert processed(mx.array(LOGITS), cfg, [0], []).tolist() == theirs(None, mx.array(LOGITS)).tolist()


def test_nothing_set_leaves_the_logits_as_they_are():
    x = mx.array(LOGITS)
    assert processed(x, LogitsConfig(), [1, 2], [2]) is x


def test_batch_state_equals_each_rows_own_processors():
    """Rows of different settings, tokens pushed step by step (one row replaced midway):
    every step, each row's processed logits equal `processed` of its own tokens."""
    vocab = 7
    configs = [
        LogitsConfig(presence_penalty=0.7, frequency_penalty=0.3),
        LogitsConfig(repetition_penalty=1.5, repetition_context_size=2),
        None,
        LogitsConfig(repetition_penalty=0.8, repetition_context_size=5, logit_bias=((2, 1.5),), frequency_penalty=-0.4),
    ]
    prompts = [[1, 2], [3, 3, 4], [0], [6, 5, 4, 3, 2, 1]]
    state = LogitsState(len(configs), vocab)
    generated = [[] for _ in configs]
    for i, (cfg, p) in enumerate(zip(configs, prompts)):
        if cfg is not None:
            state.set_row(i, cfg, p)
    rng = np.random.default_rng(0)
    for step in range(6):
        logits = mx.array(rng.normal(size=(len(configs), vocab)).astype(np.float32))
        got = state.apply(logits)
        for i, cfg in enumerate(configs):
            want = logits[i : i + 1] if cfg is None else processed(logits[i : i + 1], cfg, prompts[i] + generated[i], generated[i])
            assert np.allclose(np.array(got[i : i + 1]), np.array(want), atol=1e-6), (step, i)
        tokens = rng.integers(0, vocab, size=len(configs))
        state.push(mx.array(tokens), [True] * len(configs))
        for i in range(len(configs)):
            generated[i].append(int(tokens[i]))
        if step == 2:  # row 0 gets a new job: its state starts from that job's tokens
            configs[0], prompts[0], generated[0] = LogitsConfig(frequency_penalty=1.0), [5], [5]
            state.set_row(0, configs[0], prompts[0], generated[0])


def test_a_row_not_valid_for_a_step_keeps_its_state():
    state = LogitsState(2, 4)
    state.set_row(0, LogitsConfig(frequency_penalty=1.0), [0])
    state.set_row(1, LogitsConfig(frequency_penalty=1.0), [0])
    state.push(mx.array([3, 3]), [True, False])
    assert state.apply(mx.zeros((2, 4))).tolist() == [[0.0, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]]


def test_masks_allow_exactly_their_bits():
    vocab = 70  # three words, the last partly used
    allowed = [0, 5, 31, 32, 63, 64, 69]
    bits = np.zeros(70 + 26, bool)
    bits[allowed] = True
    words = np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32).view(np.int32)
    out = apply_masks(mx.zeros((1, vocab)), words.reshape(1, -1)).tolist()[0]
    assert [i for i, v in enumerate(out) if v == 0.0] == allowed
    assert all(v == -math.inf for i, v in enumerate(out) if i not in allowed)


def test_logprobs_are_log_softmax_of_the_raw_logits():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 4
    tokens = [7, 0, 49]
    chosen, ids, vals = token_logprobs(mx.array(logits), mx.array(tokens), 5)
    ref = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    assert np.allclose(np.array(chosen), ref[np.arange(3), tokens], atol=1e-5)
    assert np.array(ids).tolist() == np.argsort(-ref, axis=1)[:, :5].tolist()
    assert np.allclose(np.array(vals), np.sort(ref, axis=1)[:, ::-1][:, :5], atol=1e-5)


def test_top_k_in_slices_equals_a_full_sort():
    """Two stages (slice maxima, then the best slices' entries) against a full
    sort: literal rows with the k best in one slice, spread over slices, tied,
    and in the padded last slice (7 entries, slices of 2)."""
    rows = [[1, 9, 3, 7, 5, 8, 2], [9, 8, 7, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6],
            [4, 4, 4, 4, 4, 4, 4], [5, 5, 1, 5, 1, 1, 9], [-1, -2, -3, -4, -5, -6, 7]]  # fmt: skip
    ids, vals = top_k(mx.array(rows, mx.float32), 3, chunk=2)
    for row, i, v in zip(rows, ids.tolist(), vals.tolist()):
        assert v == sorted(row, reverse=True)[:3], row
        assert [row[j] for j in i] == v and len(set(i)) == 3, (row, i)
    assert ids.tolist()[:3] == [[1, 5, 3], [0, 1, 2], [6, 5, 4]]
    rng = np.random.default_rng(2)
    x = (rng.integers(0, 40, size=(8, 1500)) / 4).astype(np.float32)  # many ties
    ids, vals = top_k(mx.array(x), 20, chunk=64)
    assert np.array_equal(np.array(vals), -np.sort(-x, axis=1)[:, :20])
    assert np.array_equal(np.take_along_axis(x, np.array(ids), 1), np.array(vals))
    assert all(len(set(r)) == 20 for r in ids.tolist())


def test_entries_drop_a_closing_eos_and_keep_k_alternatives():
    class Text(TokenPieces):
        def __call__(self, t):
            return (chr(ord("a") + t), [ord("a") + t])

    e = Entries(Text(), k=1)
    e.add(0, -0.1, [0, 1], [-0.1, -2.0])
    e.add(2, -0.5, [2, 0], [-0.5, -1.0])
    assert e.result(eos={2}) == [{"token": "a", "logprob": -0.1, "bytes": [97],
                                  "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}]}]  # fmt: skip
    assert len(e.result(eos={9})) == 2


@pytest.mark.parametrize("bias", [((4096, 1.0),), ((0, 1.0), (99999, 2.0))])
def test_bias_past_the_vocabulary_is_named(bias):
    from batchgen.decode.processors import check_bias

    with pytest.raises(ValueError, match=str(bias[-1][0])):
        check_bias(LogitsConfig(logit_bias=bias), 4096)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_content_writes_the_entries_a_dict_per_token_would(k):
    """The line's JSON (`Content.json`, from cached pieces) against entries made as
    dicts from the same numbers: quotes, non-ASCII text and bytes, k of more
    alternatives than read back, and no alternatives at all."""
    import orjson

    texts = {0: ('say "hi"', [115, 97]), 1: ("é", [195, 169]), 2: ("\n", [10]), 3: ("\ufffd", [226])}

    class Text(TokenPieces):
        def __call__(self, t):
            return texts[t]

    ids, lps = [1, 0, 3, 2], [-0.25, -1e-07, -12.5, -3.0]
    tops = [[1, 0, 2, 3], [0, 2, 1, 3], [3, 1, 0, 2], [2, 3, 0, 1]]
    top_lps = [[-0.25, -2.0, -3.5, -4.0], [-1e-07, -18.0, -19.5, -20.0], [-12.5, -13.0, -14.0, -15.0], [-3.0, -3.5, -4.0, -4.5]]
    e = Entries(Text(), k)
    for row in zip(ids, lps, tops, top_lps):
        e.add(*row)
    want = [{"token": texts[t][0], "logprob": lp, "bytes": texts[t][1],
             "top_logprobs": [{"token": texts[a][0], "logprob": v, "bytes": texts[a][1]} for a, v in zip(top[:k], vals[:k])]}
            for t, lp, top, vals in zip(ids, lps, tops, top_lps)]  # fmt: skip
    content = e.result(eos={2})
    assert orjson.loads(content.json()) == want[:3] and len(content) == 3
    assert orjson.dumps(content, default=lambda c: orjson.Fragment(c.json())) == orjson.dumps(want[:3])
    assert list(content) == want[:3] and content[1]["token"] == 'say "hi"'
    assert Entries(Text(), k).result(eos=set()).json() == b"[]"
