"""Forward passes shared by the decoders and the scheduler: prefill in chunks
(padded where the cache trims exactly), the logits of one position, and plain
one-token decoding.
"""

from __future__ import annotations

from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..cache.fp16 import Fp16Cache
from ..cache.pool import trim_cache
from ..stats import JobStats
from .sampling import pick

# A stream of our own for generation, as mlx-lm does, so async evaluation of
# the next step overlaps the host's work on the current token.
generation_stream = mx.new_thread_local_stream(mx.default_device())


def prefill(model: nn.Module, cache: list, tokens: list[int], step_size: int, pad: bool = False,
            logits: bool = False) -> mx.array | None:  # fmt: skip
    """Run `tokens` through the model into `cache`, in chunks, as mlx-lm does.

    `logits`: return the next-token logits (1, vocab) after the last token, so
    the first generated token needs no pass of its own (mlx-lm's loop feeds the
    prompt's last token as a separate one-token step: a whole forward pass;
    bench/RESULTS.md#prompt-pool-and-first-token).

    `pad`: the last chunk is padded to `padded_length` and the pads trimmed from
    the cache afterwards. Causal attention keeps the real tokens' entries exactly
    as without pads; the pass shapes repeat across jobs instead of being new for
    each prompt length (each new shape costs kernel and plan builds on MLX's CUDA
    backend: bench/RESULTS.md#short-pass-attention). Only for caches that trim
    exactly."""
    extra = padded_length(len(tokens) % step_size, step_size) - len(tokens) % step_size if pad and tokens else 0
    last = len(tokens) - 1
    tokens = list(tokens) + [tokens[-1]] * extra if extra else tokens
    out = None
    with mx.stream(generation_stream):
        for start in range(0, len(tokens), step_size):
            chunk = mx.array(tokens[start : start + step_size])[None]
            if logits and start + step_size >= len(tokens):
                out = logits_at(model, chunk, cache, last - start)
                mx.eval(out, [c.state for c in cache])
            else:
                model(chunk, cache=cache)
                mx.eval([c.state for c in cache])
            mx.clear_cache()
    if extra:
        trim_cache(cache, extra)
    return out


# mlx-lm causal LMs whose __call__ is exactly `head(backbone(inputs, cache))`:
# a prompt pass projects only the position it samples from onto the vocabulary
# (a 2k-token pass would otherwise compute 2k rows of logits to keep one).
_SPLIT_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe"})


def split_head(model: nn.Module):
    """(backbone, head) for a model of `_SPLIT_HEAD_TYPES`, else None."""
    if getattr(getattr(model, "args", None), "model_type", None) not in _SPLIT_HEAD_TYPES:
        return None
    inner = getattr(model, "language_model", model)
    if getattr(inner, "sharding_group", None) is not None:
        return None
    backbone = inner.model
    head = backbone.embed_tokens.as_linear if inner.args.tie_word_embeddings else inner.lm_head
    return backbone, head


def logits_at(model: nn.Module, inputs: mx.array, cache: list, index: int | list[int]) -> mx.array:
    """The model's logits (rows, vocab) at position `index` of a pass over
    `inputs` (rows, length); a list gives each row's own position."""
    if isinstance(index, int):
        pick_rows = lambda x: x[:, index, :]  # noqa: E731
    else:
        pick_rows = lambda x: x[mx.arange(len(index)), mx.array(index)]  # noqa: E731
    parts = split_head(model)
    if parts is None:
        return pick_rows(model(inputs, cache=cache))
    backbone, head = parts
    return head(pick_rows(backbone(inputs, cache)))


PAD_MIN = 16
PAD_POW2_MAX = 256  # the short-pass attention's range (attention.DEFAULT_MAX_QUERIES)
PAD_STEP = 256


def padded_length(n: int, step_size: int) -> int:
    """The pass length a chunk of n tokens is padded to: the next power of two
    (at least PAD_MIN) up to PAD_POW2_MAX, then the next multiple of PAD_STEP;
    at most step_size (0 stays 0).

    Short passes are bound by per-pass overhead, so a few repeating shapes pay.
    Longer ones are compute-bound and their attention builds per (queries, keys)
    pair anyway (mx.fast attention: the keys length is the cached prefix's), so
    they are padded only to a coarse step: a 1.1k-token prompt costs 1,280
    tokens of compute, not 2,048.

    >>> [padded_length(n, 2048) for n in (0, 1, 16, 17, 256, 257, 300, 1100, 2047)]
    [0, 16, 16, 32, 256, 512, 512, 1280, 2048]
    """
    if n <= 0:
        return 0
    if n > PAD_POW2_MAX:
        return min(step_size, -(-n // PAD_STEP) * PAD_STEP)
    return min(step_size, max(PAD_MIN, 1 << (n - 1).bit_length()))


def pads_exactly(cache: list) -> bool:
    """Plain KV caches only: their trim drops the pads and nothing else."""
    return all(type(c) in (KVCache, Fp16Cache) for c in cache)


def plain_tokens(model, cache, last: int, sampling, keys, stats: JobStats, t: int = 1) -> Iterator[int]:
    """Plain decoding after token `last` (the cache holds everything before it;
    `t` tokens were generated so far): one forward pass per token, the next pass
    queued (`async_eval`) before the current token is read back."""

    def step(y: mx.array) -> mx.array:
        nonlocal t
        logits = model(y[None], cache=cache)[:, -1, :]
        token = pick(logits, sampling, None if sampling.greedy else keys[t])
        t += 1
        stats.forward_passes += 1
        return token

    with mx.stream(generation_stream):
        y = step(mx.array([last]))
        mx.async_eval(y)
        while True:
            next_y = step(y)
            mx.async_eval(next_y)
            yield y.item()
            y = next_y
