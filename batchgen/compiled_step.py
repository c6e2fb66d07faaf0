"""A batch's decode step as one compiled function over fixed-shape buffers.

A one-token step of a small model is bound by the host, not the chip: building
the step's graph in Python and launching its few hundred kernels cost more than
the kernels take (0.5B shape on an H200: ~1.5-2.5 ms of graph building alone in
a 5-9 ms step, bench/batch_step.py). `mx.compile` records the step once and
replays it, fusing the elementwise ops between matmuls, but a recording holds
for fixed input shapes only, and a growing KV cache changes shape every step.

So the step here sees the batch cache's whole buffers (B, heads, capacity, D),
capacity rounded up to `CAPACITY_STEP` positions, and writes the new token's
keys and values at the write position given as an array
(`mx.slice_update`): every step of a run has the same shapes until the
capacity grows, and one recording serves them all. Attention reads each row
from its left padding to the write position (the CUDA kernel of
`attention.batch_decode_attention`, or a mask elsewhere), so the spare
capacity costs nothing on a GPU.

`StepCache` is the view the model's layers see inside the step; the batch's
own state stays in mlx-lm's `BatchKVCache` objects between steps.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

CAPACITY_STEP = 256  # positions: the step's buffers grow (and are recorded anew) in these


def capacity_for(positions: int) -> int:
    """Buffer positions for a write at index `positions - 1` (at least one spare).

    >>> [capacity_for(n) for n in (1, 256, 257, 600)]
    [256, 256, 512, 768]
    """
    return max(1, -(-positions // CAPACITY_STEP)) * CAPACITY_STEP


class StepCache:
    """One layer's batch cache inside the compiled step: full buffers, the
    write position `idx` (an int32 array of shape ()) and each row's left
    padding (B,). Row b's tokens are at positions left_padding[b] .. idx."""

    def __init__(self, keys: mx.array, values: mx.array, idx: mx.array, left_padding: mx.array):
        self.keys, self.values, self.idx, self.left_padding = keys, values, idx, left_padding

    @property
    def offset(self) -> mx.array:
        """Each row's position of the token being written (RoPE's offset)."""
        return self.idx - self.left_padding

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] != 1:
            raise ValueError(f"StepCache takes one token per row, got {keys.shape[2]}")
        start = self.idx.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        if window_size is not None:
            raise ValueError("StepCache has no sliding-window mask")
        cols = mx.arange(self.keys.shape[2])
        valid = (cols[None] >= self.left_padding[:, None]) & (cols[None] <= self.idx)
        return valid[:, None, None, :]  # (B, 1, 1, capacity)

    def end_and_capacity(self) -> mx.array:
        """[idx + 1, capacity] as int32: the attention kernel's bounds."""
        return mx.stack([self.idx + 1, mx.array(self.keys.shape[2], mx.int32)]).astype(mx.int32)

    @property
    def state(self):
        return self.keys, self.values

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def make_step(model, sample_rows: bool) -> Callable:
    """The compiled step: (inputs (B,), keys [layers], values [layers], idx (),
    left_padding (B,)) -> (greedy tokens (B,), logits (B, vocab) or None,
    new keys, new values). `sample_rows`: also return the logits (some rows
    sample); greedy-only batches read back B tokens and nothing more."""

    def step(inputs, keys, values, idx, left_padding):
        cache = [StepCache(k, v, idx, left_padding) for k, v in zip(keys, values)]
        logits = model(inputs[:, None], cache=cache)[:, -1, :]
        tokens = mx.argmax(logits, axis=-1)
        out_k = [c.keys for c in cache]
        out_v = [c.values for c in cache]
        return (tokens, logits, out_k, out_v) if sample_rows else (tokens, out_k, out_v)

    compiled = mx.compile(step)
    if sample_rows:
        return compiled

    def greedy(inputs, keys, values, idx, left_padding):
        tokens, out_k, out_v = compiled(inputs, keys, values, idx, left_padding)
        return tokens, None, out_k, out_v

    return greedy
