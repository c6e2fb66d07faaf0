"""batchgen's uncompressed KV caches: mlx-lm's KVCache and BatchKVCache, answering for
their own attention (transforms/attention.py's dispatch calls `attention`).

`Fp16Cache` (one job): passes of 2 .. `max_queries` queries (a prompt-lookup verify
pass, a prompt's uncached tail) as plain matmul + softmax. On MLX's CUDA backend the
fused attention builds a kernel for every new (queries, keys) shape, and decoding only
ever sees new lengths: a 6-token verify pass at a new length cost tens of milliseconds
against a few for the same pass at a length it had seen
(bench/RESULTS.md#short-pass-attention). One-token steps and long prefill chunks keep
the fused kernel. `max_queries = 0` keeps every pass on it (Metal, CPU: no per-shape
builds there).

`Fp16BatchCache` (a batch): the same for multi-query passes, and one-query steps through
the `batch_decode` kernel (each row from its own first position, no mask); its write
position is `write_position`, and it has the members the compiled step and the
scheduler ask of a batch layer (`step/compiled.py`: `BUFFERS`, `step_arrays`, ...).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from ..kernels.attention import BATCH_DECODE
from ..kernels.registry import constant

DEFAULT_MAX_QUERIES = 256


def short_attention(queries, keys, values, scale: float, mask) -> mx.array:
    """Attention of L queries (the last L positions) over S keys, as plain ops.

    queries (B, Hq, L, D); keys/values (B, Hkv, S, D); grouped-query heads share
    their key head. `mask`: "causal", None, or a boolean/additive array.
    """
    B, n_heads, L, D = queries.shape
    n_kv, S = keys.shape[1], keys.shape[2]
    q = (queries * scale).reshape(B, n_kv, n_heads // n_kv, L, D)
    scores = q @ keys[:, :, None].swapaxes(-1, -2)  # (B, Hkv, G, L, S)
    if isinstance(mask, mx.array):
        if mask.ndim == 4:
            mask = mask[:, :, None] if mask.shape[1] > 1 else mask[:, None]
        # The lowest finite score, not -inf: a query with every key masked (a left-padded
        # row's padding in a batch pass) then averages instead of turning NaN, and NaN
        # written into its cache entries would reach other queries through 0 * NaN.
        low = mx.array(mx.finfo(scores.dtype).min, scores.dtype)
        scores = mx.where(mask, scores, low) if mask.dtype == mx.bool_ else scores + mask
    elif mask is not None or L > 1:  # "causal": query i sits at position S - L + i
        causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
        scores = mx.where(causal, scores, -mx.inf)
    probs = mx.softmax(scores.astype(mx.float32), axis=-1, precise=True).astype(values.dtype)
    return (probs @ values[:, :, None]).reshape(B, n_heads, L, -1)


class Fp16Cache(KVCache):
    """mlx-lm's KVCache with short passes' attention as plain ops (module docstring)."""

    max_queries = 0  # what a cache rebuilt from its state has until told (`as_fp16`)

    def __init__(self, max_queries: int = DEFAULT_MAX_QUERIES):
        super().__init__()
        self.max_queries = max_queries

    def attention(self, queries, keys, values, *, scale: float, mask=None, sinks=None):
        if sinks is None and 1 < queries.shape[2] <= self.max_queries:
            return short_attention(queries, keys, values, scale, mask)
        return NotImplemented


class Fp16BatchCache(BatchKVCache):
    """mlx-lm's BatchKVCache as a batch layer (module docstring). `kernels`: one-query
    steps through `batch_decode` and short passes as plain ops (where the engine takes
    its CUDA paths); off, every pass takes mlx-lm's attention."""

    step_kind = "fp16"  # what the compiled step records per layer (TurboQuant's: ("turboquant", layout))
    BUFFERS = ("keys", "values")  # arrays indexed by column on axis 2
    ROWS = ()  # arrays indexed by row only
    layout = None  # TurboQuant rows' layout (its window sets the step's)

    def __init__(self, left_padding: list[int], kernels: bool = False):
        super().__init__(left_padding)
        self.kernels = kernels

    @property
    def write_position(self) -> int:
        """The buffers' column the next token of every row goes to."""
        return self._idx

    @write_position.setter
    def write_position(self, value: int) -> None:
        self._idx = value

    def attention(self, queries, keys, values, *, scale: float, mask=None, sinks=None):
        if sinks is not None or not self.kernels:
            return NotImplemented
        L = queries.shape[2]
        if 1 < L <= DEFAULT_MAX_QUERIES:
            return short_attention(queries, keys, values, scale, mask)
        if L == 1 and self.keys is not None and BATCH_DECODE.takes(queries, self.keys, self.values):
            return BATCH_DECODE.kernel_form(queries, self.keys, self.values, self.left_padding, self.bounds(), scale)
        return NotImplemented

    def bounds(self) -> mx.array:
        """int32 [write position, capacity] of the buffers (shared by every layer of a step)."""
        idx, capacity = self._idx, self.keys.shape[2]
        return constant(("bounds", idx, capacity), lambda: mx.array([idx, capacity], mx.int32))

    # -- the batch layer members (step/compiled.py) --------------------------------

    def step_arrays(self) -> tuple:
        return self.keys, self.values

    def window_like(self) -> tuple:
        """(rows, heads, key dim, value dim, dtype) of the step's window."""
        k, v = self.keys, self.values
        return (*k.shape[:2], k.shape[3], v.shape[3], k.dtype)

    def write_window(self, rkeys: mx.array, rvalues: mx.array, n: int) -> None:
        """The window's first n positions into the buffers at the write position."""
        i = self._idx
        self.keys[..., i : i + n, :] = rkeys[..., :n, :]
        self.values[..., i : i + n, :] = rvalues[..., :n, :]
        self._idx += n


def make_fp16_cache(model, max_queries: int = DEFAULT_MAX_QUERIES) -> list:
    """The model's cache list (mlx-lm's `make_prompt_cache`) with every plain KVCache
    an `Fp16Cache`; other layer kinds (rotating, recurrent) as the model makes them."""
    from mlx_lm.models.cache import make_prompt_cache

    return [as_fp16(c, max_queries) for c in make_prompt_cache(model)]


def as_fp16(c, max_queries: int = DEFAULT_MAX_QUERIES):
    """A plain KVCache as an `Fp16Cache` holding the same arrays, an `Fp16Cache`
    attending passes of up to `max_queries` (a loaded prompt cache); anything else as
    it is."""
    if type(c) is Fp16Cache:
        c.max_queries = max_queries
        return c
    if type(c) is not KVCache:
        return c
    out = Fp16Cache(max_queries)
    out.keys, out.values, out.offset = c.keys, c.values, c.offset
    return out


def empty_like(c) -> Fp16Cache:
    """An empty `Fp16Cache` attending as `c` does (a copy's rows, a pass's group)."""
    return Fp16Cache(getattr(c, "max_queries", 0))
