"""Sampling rows together: each row's filters are mlx-lm's, and a row draws the
token it draws alone (float32, CPU)."""

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from batchgen.config import SamplingConfig
from batchgen.decode.sampling import (
    filtered_logits,
    key_rows,
    make_filters,
    make_keys,
    pick,
    sample_rows,
)

SETTINGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_p=0.9),
    SamplingConfig(temperature=1.3, top_k=5),
    SamplingConfig(temperature=0.5, min_p=0.05),
    SamplingConfig(temperature=0.9, top_p=0.5, min_p=0.1, top_k=20),
    SamplingConfig(temperature=2.0, top_p=0.99, top_k=3),
]


def logits(rows: int, vocab: int = 64, seed: int = 0) -> mx.array:
    return mx.random.normal((rows, vocab), key=mx.random.key(seed)) * 3


def mlx_lm_kept(x: mx.array, s: SamplingConfig) -> list[bool]:
    """The tokens mlx-lm's filters keep, in its order (top-p, min-p, top-k)."""
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    if 0 < s.top_p < 1.0:
        lp = apply_top_p(lp, s.top_p)
    if s.min_p != 0.0:
        lp = apply_min_p(lp, s.min_p)
    if s.top_k > 0:
        lp = apply_top_k(lp, s.top_k)
    return (lp > -mx.inf).tolist()


@pytest.mark.parametrize("s", SETTINGS, ids=range(len(SETTINGS)))
def test_a_row_keeps_the_tokens_mlx_lms_filters_keep(s):
    x = logits(4, seed=3)
    got = (filtered_logits(x, make_filters([s] * 4, x.shape[-1])) > -mx.inf).tolist()
    assert got == mlx_lm_kept(x, s)


def test_rows_with_different_settings_filter_as_each_would_alone():
    x = logits(len(SETTINGS), seed=1)
    together = filtered_logits(x, make_filters(SETTINGS, x.shape[-1]))
    for i, s in enumerate(SETTINGS):
        alone = filtered_logits(x[i : i + 1], make_filters([s], x.shape[-1]))
        assert mx.array_equal(together[i : i + 1], alone).item(), s


def test_the_temperature_divides_the_kept_log_probabilities():
    x = mx.log(mx.array([[0.5, 0.3, 0.2]]))
    out = filtered_logits(x, make_filters([SamplingConfig(temperature=0.5)], 3))
    assert mx.allclose(out, x * 2.0, atol=1e-6).item()


def test_a_batch_of_rows_draws_each_rows_own_token():
    """Every row's token equals `pick` on that row alone with its key, whatever its neighbours' settings."""
    x = logits(len(SETTINGS) * 3, seed=2)
    settings = SETTINGS * 3
    seeds, ts = list(range(40, 40 + len(settings))), [i % 4 for i in range(len(settings))]
    drawn = sample_rows(x, make_filters(settings, x.shape[-1]), key_rows(seeds, ts)).tolist()
    alone = [pick(x[i : i + 1], s, make_keys(seeds[i], 8)[ts[i]]).item() for i, s in enumerate(settings)]
    assert drawn == alone


def test_key_rows_are_the_rows_make_keys_makes():
    assert mx.array_equal(key_rows([9] * 5, list(range(5))), make_keys(9, 5)).item()
    assert key_rows([(1 << 32) + 3], [2]).tolist() == [[3, 2]]


def test_draws_follow_the_distribution():
    """Many keys over one row: the sampled frequencies match softmax(x / T) within 3 sigma."""
    x = mx.log(mx.array([[0.6, 0.3, 0.1]]))
    s = SamplingConfig(temperature=1.0)
    n = 4000
    drawn = sample_rows(mx.broadcast_to(x, (n, 3)), make_filters([s] * n, 3), key_rows([5] * n, list(range(n))))
    freq = [drawn.tolist().count(k) / n for k in range(3)]
    for f, p in zip(freq, [0.6, 0.3, 0.1]):
        assert abs(f - p) < 3 * (p * (1 - p) / n) ** 0.5, freq


def test_a_top_k_row_never_draws_outside_its_top_k():
    x = logits(1, vocab=50, seed=4)
    top = set(mx.argsort(-x[0])[:3].tolist())
    s = SamplingConfig(temperature=5.0, top_k=3)
    n = 300
    drawn = sample_rows(mx.broadcast_to(x, (n, 50)), make_filters([s] * n, 50), key_rows([1] * n, list(range(n)))).tolist()
    assert set(drawn) <= top and len(set(drawn)) == 3
