"""Token selection: greedy, or seeded sampling with temperature/top-p/top-k/min-p.

Every sampled token draws from its own PRNG key, `keys[t]` for the job's t-th
generated token, made from the job's seed and t alone. A job therefore samples
the same tokens whatever else runs beside it (another job in a batch, a
different decoder), which a single global PRNG state could not promise.

The filters are mlx-lm's (`mlx_lm.sample_utils`), in mlx-lm's order (top-p,
min-p, top-k on the log-probabilities, then the temperature), written once for
rows that each have their own settings: a batch's sampling rows pick their
tokens in one pass of a few ops, where one pick per row cost a step of 256
rows about 120 ms on the H200 (bench/RESULTS.md#dataset-generation-features).
One job alone is a batch of one row, through the same ops, so a row samples
the token it would sample alone. The token is the Gumbel-max draw,
argmax(logits / T + g) with g Gumbel noise from the row's key, which is how
`mx.random.categorical` samples.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..config import SamplingConfig


def job_seed(sampling: SamplingConfig) -> int:
    """The job's seed, or a fresh random one when none was given."""
    if sampling.seed is not None:
        return sampling.seed
    return int.from_bytes(os.urandom(4), "little")


def make_keys(seed: int, n: int) -> mx.array:
    """PRNG keys for the first `n` generated tokens: row t is `(seed, t)`
    (uint32), so token t's key depends on the seed and t alone, never on how
    many keys were made (as `split(key, n)`'s would)."""
    n = max(n, 1)
    seed32 = mx.full((n,), seed % (1 << 32), dtype=mx.uint32)
    return mx.stack([seed32, mx.arange(n, dtype=mx.uint32)], axis=1)


def key_rows(seeds: list[int], ts: list[int]) -> mx.array:
    """Keys (rows, 2): row i is seed i's key for its token ts[i], the row
    `make_keys(seeds[i], n)[ts[i]]` holds.

    >>> key_rows([7, 9], [0, 3]).tolist()
    [[7, 0], [9, 3]]
    """
    return mx.array(np.stack([np.asarray(seeds, np.uint64) % (1 << 32), np.asarray(ts, np.uint64)], axis=1).astype(np.uint32))


@dataclass(frozen=True)
class Filters:
    """Each row's sampling settings as (rows, 1) arrays: a filter a row does not
    use is None when no row uses it, else its neutral value in that row (and
    `where`-ed off: a row's result never depends on the rows beside it)."""

    inv_temperature: mx.array  # 1 / T (float32)
    top_p: mx.array | None  # float32, 1.0 where off
    top_p_on: mx.array | None  # bool
    log_min_p: mx.array | None  # float32, -inf where off
    top_k: mx.array | None  # int32, vocabulary size where off


def make_filters(samplings: list[SamplingConfig], vocab: int) -> Filters:
    """The `Filters` of rows sampling with `samplings` (temperature > 0).

    >>> f = make_filters([SamplingConfig(temperature=0.5, top_p=0.9), SamplingConfig(temperature=1.0)], 100)
    >>> f.inv_temperature[:, 0].tolist(), f.top_p_on[:, 0].tolist(), f.log_min_p, f.top_k
    ([2.0, 1.0], [True, False], None, None)
    """
    col = lambda values, dtype: mx.array(np.asarray(values, dtype)[:, None])  # noqa: E731
    top_p = [s.top_p if 0 < s.top_p < 1.0 else 1.0 for s in samplings]
    min_p = [math.log(s.min_p) if s.min_p != 0.0 else -math.inf for s in samplings]
    top_k = [s.top_k if 0 < s.top_k < vocab else vocab for s in samplings]
    on = [p < 1.0 for p in top_p]
    return Filters(
        inv_temperature=col([1.0 / s.temperature for s in samplings], np.float32),
        top_p=col(top_p, np.float32) if any(on) else None,
        top_p_on=col(on, np.bool_) if any(on) else None,
        log_min_p=col(min_p, np.float32) if any(m > -math.inf for m in min_p) else None,
        top_k=col(top_k, np.int32) if any(k < vocab for k in top_k) else None,
    )


def filtered_logits(logits: mx.array, f: Filters) -> mx.array:
    """Logits (rows, vocab) of the distributions the rows sample from: the
    log-probabilities, filtered, divided by each row's temperature.

    Top-p keeps the most likely tokens whose mass reaches p (`num_dropped`
    counts the least likely tokens with at least p of the mass above them);
    min-p drops what is below p_max * min_p; top-k keeps what is at least the
    k-th largest (a tie at the k-th value keeps every tied token, where
    mlx-lm's `argpartition` keeps k of them). One ascending sort serves top-p
    and top-k: the filters before top-k only drop the least likely tokens, so
    its k-th largest is unchanged, or already dropped, when nothing finite
    falls below it anyway.

    >>> x = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05]]))
    >>> f = make_filters([SamplingConfig(temperature=1.0, top_p=0.8)], 4)
    >>> (filtered_logits(x, f) > -mx.inf).tolist()
    [[True, True, False, False]]
    """
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ascending = mx.sort(lp, axis=-1) if f.top_p is not None or f.top_k is not None else None
    if f.top_p is not None:
        probs = mx.exp(ascending.astype(mx.float32))
        mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
        total = mass_above[..., :1] + probs[..., :1]
        dropped = (mass_above >= f.top_p * total).sum(axis=-1, keepdims=True)
        threshold = mx.take_along_axis(ascending, dropped, axis=-1)
        lp = mx.where(f.top_p_on & (lp < threshold), -mx.inf, lp)
    if f.log_min_p is not None:
        lp = mx.where(lp < lp.max(axis=-1, keepdims=True) + f.log_min_p, -mx.inf, lp)
    if f.top_k is not None:
        kth = mx.take_along_axis(ascending, lp.shape[-1] - f.top_k, axis=-1)
        lp = mx.where(lp < kth, -mx.inf, lp)
    return lp * f.inv_temperature.astype(lp.dtype)


def sample_rows(logits: mx.array, f: Filters, keys: mx.array) -> mx.array:
    """One token per row of `logits` (rows, vocab), row i drawn with keys[i]; lazy."""
    noise = mx.vmap(lambda k: mx.random.gumbel(logits.shape[-1:], key=k))(keys)
    return mx.argmax(filtered_logits(logits, f) + noise, axis=-1)


def target_logits(logits: mx.array, s: SamplingConfig) -> mx.array:
    """Logits of the distribution a token is sampled from (rows, vocab), every
    row with settings `s` (PLD's verify rows)."""
    return filtered_logits(logits, make_filters([s], logits.shape[-1]))


def pick(logits: mx.array, s: SamplingConfig, key: mx.array | None) -> mx.array:
    """One token per row of `logits` (rows, vocab), every row drawn with `key`
    (one row: one job's token); lazy, not evaluated."""
    if s.greedy:
        return mx.argmax(logits, axis=-1)
    keys = mx.broadcast_to(key.reshape(1, 2), (logits.shape[0], 2)) if logits.ndim > 1 else key.reshape(1, 2)
    out = sample_rows(logits.reshape(-1, logits.shape[-1]), make_filters([s], logits.shape[-1]), keys)
    return out if logits.ndim > 1 else out[0]
