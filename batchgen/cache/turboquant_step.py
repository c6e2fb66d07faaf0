"""TurboQuant's cache on CUDA: one-token decode steps as one kernel each.

On the ops path a decode step is dozens of small ops per layer, and a GPU step of a
small model is bound by their count, not by bytes (bench/RESULTS.md#turboquant-step-kernel).
Here `update_and_fetch` of one token only hands the token over; `attention` runs the
`tq_step` kernel op (kernels/turboquant.py), which encodes it into the next slot of a
small window and attends over sinks + codes + window by the reading rule. The window's
arrays: wx the slots' exact keys and values, wc their key and value codes, wq their
scales (slots on axis 2); slot 0 holds position `_win_r0`, `_win_n` slots are in use,
codes below position `_win_cb` are in the big buffers, above it in the window;
`_win_exact` is the first position the ordinary layout would still hold exactly (its
recent copies), so that the kernel reads exactly what the ops path reads. Every
`STEP_BLOCK` steps the window's codes go into the big buffers (a few ops).

A short multi-token pass (a prompt-lookup verify pass, up to `STEP_QUERIES` tokens) runs
as one launch a layer for each `window` tokens of it: the reading rule gives each query
the same keys whatever the chunking, and with at most `window` tokens a launch's queries
read its tokens exactly, never as the codes it writes; one launch instead of one a token
made a 6-token pass 1.6-2.3x faster (bench/RESULTS.md#turboquant-one-job-passes). A trim that
stays inside the window only moves its marks back. Anything else (a long update, a deeper
trim, the state, a mask) first settles the cache back into the ordinary layout
(`_settle`), so the base class never sees a window.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import mlx.core as mx

from ..kernels.registry import constant
from ..kernels.turboquant import (
    STEP,
    STEP_TOKENS,
    step_books,
    step_chunks,
    step_counters,
    step_meta,
    step_supported,
)
from ..turboquant.codec import codebook_arrays, packed_words, rotation
from .turboquant import TurboQuantKVCache, detach, forget_prefill_mask


class TurboQuantStepKVCache(TurboQuantKVCache):
    """`TurboQuantKVCache` whose one-token decode steps run as one kernel (module
    docstring); the same stored layout between steps and the same reading rule."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._reset_transient()

    def _reset_transient(self) -> None:
        self._step_new = None  # the tokens handed over by update_and_fetch
        self._win = None
        self._win_r0 = self._win_n = self._win_cb = self._win_exact = 0
        self._counters = None  # the step kernel's, this window's own (`step_counters`)

    def _extra_arrays(self) -> tuple:
        return self._win or ()

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self._step_new is not None:
            # The last token was never read by `attention`: this model's attention
            # does not go through the dispatch; store it the ordinary way.
            self.routed = False
            self._absorb_step()
        self._arrive(keys, values)
        if keys.shape[2] <= self.STEP_QUERIES and self._steps():
            # Step mode: `attention` stores the tokens (a kernel launch each); nothing here.
            self._step_new = (keys, values)
            self.offset += keys.shape[2]
            return keys, values
        self._leave_step()
        return self._update(keys, values)

    def attention(self, queries, keys=None, values=None, *, scale: float, mask=None, sinks=None):
        if self._step_new is not None:
            if sinks is None and self._step_fits(queries, mask):
                forget_prefill_mask()
                return self._step_attention(queries, scale)
            self._absorb_step()
        return super().attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    STEP_BLOCK = 32
    # Passes of up to this many tokens run as step launches (a TurboQuant job's verify
    # pass feeds at most TURBOQUANT_MAX_LOOKUP + 1 = 6); longer ones (prompt chunks) take
    # the ops path or cuDNN's fused attention, a launch or a few ops for all their queries.
    # (How many tokens one launch takes is `_launch_tokens`, a separate bound.)
    STEP_QUERIES = 16

    def _steps(self) -> bool:
        """Whether an update of up to `STEP_QUERIES` tokens takes step mode."""
        return (
            self.routed
            and self.window >= 1
            and self.offset >= self.sink_tokens
            and self.key_dim == self.value_dim
            and STEP.enabled()
            and step_supported(self.key_dim, 1, self.key_bits, self.value_bits)
        )

    def _step_fits(self, queries: mx.array, mask) -> bool:
        _, n_heads, L, dim = queries.shape
        kv_heads = self._step_new[0].shape[1]
        return (
            L == self._step_new[0].shape[2]
            and not isinstance(mask, mx.array)
            and n_heads % kv_heads == 0
            and step_supported(dim, n_heads // kv_heads, self.key_bits, self.value_bits)
        )

    def _absorb_step(self):
        """The token handed to step mode goes the ordinary way instead."""
        if self._step_new is None:
            return
        keys, values = self._step_new
        self._step_new = None
        self.offset -= keys.shape[2]
        self._leave_step()
        self._chunk = None
        self._update(keys, values)

    def _settle(self):
        """Back to the ordinary layout: every token coded in the big buffers, the
        recent exact copies in recent_keys / recent_values."""
        self._absorb_step()
        self._leave_step()

    def _enter_step(self, B: int, H: int, dtype, p: int):
        """Into step mode before the token at position p."""
        n, slots, dim = self._n_recent, self._recent_capacity + self.STEP_BLOCK, self.key_dim

        exact = mx.zeros((B, H, slots, 2, dim), dtype)
        if n:
            recent = mx.stack([self.recent_keys[:, :, -n:], self.recent_values[:, :, -n:]], axis=3)
            exact = mx.concatenate([recent.astype(dtype), exact[:, :, n:]], axis=2)
        words = packed_words(dim, self.key_bits) + packed_words(dim, self.value_bits)
        self._win = (exact, mx.zeros((B, H, slots, words), mx.uint32), mx.zeros((B, H, slots, 2), mx.float16))
        self._counters = step_counters(B * H * self._launch_tokens)
        self._win_r0, self._win_n, self._win_cb, self._win_exact = p - n, n, p, p - n
        self.recent_keys = self.recent_values = None
        if self.key_codes is None:
            self._grow(B, H, 0, 1)
        # The kernel indexes these as dense arrays (a loaded or cloned state may hold
        # views); flushes and sink appends keep them dense from here on.
        for name in ("key_codes", "key_norms", "value_codes", "value_norms", "sink_keys", "sink_values"):
            if getattr(self, name) is not None:
                setattr(self, name, mx.contiguous(getattr(self, name)))

    def _flush_window(self):
        """The window's codes for positions cb .. r0 + n - 1 into the big buffers."""
        _, wc, wq = self._win
        r0, n, cb = self._win_r0, self._win_n, self._win_cb
        lo = cb - r0
        if n > lo:
            t0 = cb - self.sink_tokens
            t1 = t0 + n - lo
            kw = self.key_codes.shape[-1]
            self._grow(wc.shape[0], wc.shape[1], t0, t1)
            self.key_codes[:, :, t0:t1] = wc[:, :, lo:n, :kw]
            self.value_codes[:, :, t0:t1] = wc[:, :, lo:n, kw:]
            self.key_norms[:, :, t0:t1] = wq[:, :, lo:n, 0]
            self.value_norms[:, :, t0:t1] = wq[:, :, lo:n, 1]
        self._win_cb = r0 + n

    def _kept_slots(self, keep: int) -> Optional[mx.array]:
        """The window's exact keys and values of the last `keep` slots in use, (B, H,
        keep, 2, D); None if none."""
        n = self._win_n
        return self._win[0][:, :, n - keep : n] if keep else None

    def _shift_window(self):
        """Room for the next token: flush, then move the kept slots to the front."""
        self._flush_window()
        wx, *coded = self._win
        kept = self._kept_slots(min(self._win_n, self._recent_capacity))
        keep = 0 if kept is None else kept.shape[2]
        fresh = mx.zeros((*wx.shape[:2], wx.shape[2] - keep, *wx.shape[3:]), wx.dtype)
        self._win = (fresh if kept is None else mx.concatenate([kept, fresh], axis=2), *coded)
        self._win_r0 += self._win_n - keep
        self._win_n = keep

    def _leave_step(self):
        if self._win is None:
            return
        self._flush_window()
        # The recent copies the ordinary layout would hold: from `_win_exact` on.
        kept = self._kept_slots(self._win_r0 + self._win_n - self._win_exact)
        self.recent_keys = None if kept is None else detach(kept[..., 0, :])
        self.recent_values = None if kept is None else detach(kept[..., 1, :])
        self._win = None

    def trim(self, n: int) -> int:
        """A trim that leaves the window's first slot in use only moves its marks back
        (the slots past the new offset are written over by the next tokens); deeper
        ones, and one with tokens handed over, settle first (the base class)."""
        n = min(self.offset, n)
        to = self.offset - n
        if self._win is None or self._step_new is not None or to < max(self._win_r0, self.sink_tokens):
            return super().trim(n)
        self.offset = to
        self._chunk = None
        self._win_n = to - self._win_r0
        self._win_cb = min(self._win_cb, to)  # codes from here on are read from the slots
        self._win_exact = min(self._win_exact, to)
        return n

    @property
    def _launch_tokens(self) -> int:
        """The most tokens one launch takes: the window's (module docstring)."""
        return max(1, min(self.window, STEP_TOKENS))

    def _step_attention(self, queries: mx.array, scale: float) -> mx.array:
        keys, values = self._step_new
        self._step_new = None
        B, H, L = keys.shape[:3]
        first = self.offset - L
        if self._win is None:
            self._enter_step(B, H, keys.dtype, first)
        n = self._launch_tokens
        if L <= n:
            return self._step_launch(queries, keys, values, first, scale)
        outs = []
        for i in range(0, L, n):
            t = slice(i, i + n)
            outs.append(self._step_launch(queries[:, :, t], keys[:, :, t], values[:, :, t], first + i, scale))
        return mx.concatenate(outs, axis=2)

    def _step_launch(self, queries, keys, values, p: int, scale: float) -> mx.array:
        """One kernel launch: the L tokens from position p (keys, values (B, H, L, D),
        L <= `_launch_tokens`) into their slots, and the attention of their queries."""
        B, H, L = keys.shape[:3]
        if p - self._win_r0 + L > self._win[0].shape[2]:
            self._shift_window()
        r0, S = self._win_r0, self.sink_tokens
        chunks, span = step_chunks(p + L, B * H * L, self.key_dim)
        if S:
            sinks = (self.sink_keys, self.sink_values)
        else:
            sinks = (constant(("nosink", B, H, self.key_dim, keys.dtype),
                                    lambda: mx.zeros((B, H, 1, self.key_dim), keys.dtype)),) * 2  # fmt: skip
        # Exact: the query's window, as far back as the ordinary layout's copies reach.
        e0 = max(S, p - self.window + 1, self._win_exact)
        fields = (p, S, self.key_codes.shape[2], self._win_cb, r0, chunks, e0, self._win[0].shape[2],
                  sinks[0].shape[2], span, self.window)  # fmt: skip
        meta = step_meta(fields)
        coded = (self.key_codes, self.key_norms, self.value_codes, self.value_norms)
        books = _step_books(self.key_dim, self.seed, self.key_bits, self.value_bits, scale)
        out, self._win = STEP.kernel_form(queries, (keys, values), sinks, coded, self._win, books, meta, chunks,
                                       (self.key_bits, self.value_bits), counters=self._counters)  # fmt: skip
        self._win_n = p - r0 + L
        # The ordinary layout keeps the last `_recent_capacity` tokens' copies.
        self._win_exact = max(self._win_exact, p + L - self._recent_capacity)
        return out


@lru_cache(maxsize=None)
def _step_books(dim: int, seed: int, key_bits: int, value_bits: int, scale: float) -> mx.array:
    """`kernels.turboquant.step_books` of a layer (keys and values share its rotation)."""
    books = step_books(rotation(dim, seed).signs, *codebook_arrays(key_bits), *codebook_arrays(value_bits), scale)
    mx.eval(books)
    return books
