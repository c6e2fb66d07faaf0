"""Token selection: greedy, or seeded sampling with temperature/top-p/top-k/min-p.

Every sampled token draws from its own PRNG key, `keys[t]` for the job's t-th
generated token, split once from the job's seed. A job therefore samples the
same tokens whatever else runs beside it (another job in a batch, a different
decoder), which a single global PRNG state could not promise.

The filters are mlx-lm's own (`mlx_lm.sample_utils`), applied in mlx-lm's
order, so the distribution is the one `mlx_lm.generate` samples from.
"""

from __future__ import annotations

import os

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..config import SamplingConfig


def job_seed(sampling: SamplingConfig) -> int:
    """The job's seed, or a fresh random one when none was given."""
    if sampling.seed is not None:
        return sampling.seed
    return int.from_bytes(os.urandom(4), "little")


def make_keys(seed: int, n: int) -> mx.array:
    """PRNG keys for the first `n` generated tokens: row t is
    `mx.random.key((seed << 32) | t)`, so token t's key depends on the seed and
    t alone, never on how many keys were made (as `split(key, n)`'s would)."""
    n = max(n, 1)
    seed32 = mx.full((n,), seed % (1 << 32), dtype=mx.uint32)
    return mx.stack([seed32, mx.arange(n, dtype=mx.uint32)], axis=1)


def target_logits(logits: mx.array, s: SamplingConfig) -> mx.array:
    """Logits of the distribution a token is sampled from (last axis = vocab).

    mlx-lm filters log-probabilities, then divides by the temperature; the
    same here, so both sample from the same distribution.
    """
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < s.top_p < 1.0:
        logprobs = apply_top_p(logprobs, s.top_p)
    if s.min_p != 0.0:
        logprobs = apply_min_p(logprobs, s.min_p)
    if s.top_k > 0:
        logprobs = apply_top_k(logprobs, s.top_k)
    return logprobs * (1.0 / s.temperature)


def pick(logits: mx.array, s: SamplingConfig, key: mx.array | None) -> mx.array:
    """One token per row of `logits` (shape (..., vocab)); lazy, not evaluated."""
    if s.greedy:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(target_logits(logits, s), key=key)
