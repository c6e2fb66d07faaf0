"""TurboQuant KV cache for mlx-lm models: one job's cache.

What it stores (turboquant/codec.py): the first `sink_tokens` positions exact, every
later position as codes (~4 bits a coordinate), and exact copies of the last few
positions; what a query reads (turboquant/reference.py): its own window of `window`
positions and the sinks exactly, everything else from the codes. Every token is encoded
once, on arrival, from its own vector only, so codes never depend on chunking. The exact
copies of the last `window - 1 + trim_reserve` tokens make trims of up to `trim_reserve`
tokens (a rejected prompt-lookup draft) exact too.

Attention (`TurboQuantKVCache.attention`, reached through transforms/attention.py's
dispatch) rotates the L_q queries instead of un-rotating all L keys and values, applies
the stored scales to the L_q x L scores and probabilities instead of to the L x d keys
and values (q.k_j = scale_j / sqrt(d) * q.c_j), and reads each query's own window
exactly: the same result for any chunking. `update_and_fetch` also returns the keys and
values dequantized to the model's dtype, so a model whose attention does not go through
the dispatch still works (MLX is lazy: with the dispatch that fetch is never computed).
Long multi-query passes (prefill chunks) on CUDA take mx.fast's fused attention with the
reading rule as a mask (`fused_prefill`), which never holds the L_q x L float32 scores.

`TurboQuantStepKVCache` (cache/turboquant_step.py) is this cache on CUDA with one-token
decode steps as one kernel; cache/factory.py's `make_turboquant_cache` picks the type.

Bytes per token per kv head and layer: (kb + vb) * d / 8 for codes + 4 for the two
scales, against 4 * d for fp16 (0.266x at d=64, 0.258x at d=128, bits=4), plus
sink_tokens + window - 1 + trim_reserve exact tokens (11 by default; the engine's jobs
with prompt lookup keep 17 or 23). `nbytes` counts allocated bytes, capacity in 256-token
steps like mlx-lm's KVCache. mlx-lm's affine 4-bit cache holds 9 bits per coordinate
pair in fp16 (0.281x); against it: bench/RESULTS.md#turboquant-quality-on-models-it-was-not-tuned-on.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from ..kernels.registry import available
from ..kernels.turboquant import encode
from ..transforms.attention import routed_modules
from ..turboquant.codec import (
    CODEBOOKS,
    DEFAULT_SINK_TOKENS,
    DEFAULT_TRIM_RESERVE,
    DEFAULT_WINDOW,
    SUPPORTED_BITS,
    Rotation,
    dequantize_rotated,
    packed_words,
    resolve_bits,
    rotation,
)
from .turboquant_attention import (
    FUSED_PREFILL_QUERIES,
    CodedHistory,
    forget_prefill_mask,
    fused_attention,
    query_block,
    rotated_attention,
)


def detach(x: Optional[mx.array]) -> Optional[mx.array]:
    """A slice that owns its memory: a plain slice is a view that would keep the whole
    source buffer (e.g. a 2048-token prefill chunk) alive."""
    return None if x is None else mx.contiguous(x)


class TurboQuantKVCache(_BaseCache):
    """KV cache holding TurboQuant codes (see the module docstring).

    Args:
        bits: nominal bits per coordinate (`BIT_SPLITS` maps it to key/value bits).
        key_bits, value_bits: override the split (any of `SUPPORTED_BITS`).
        sink_tokens: leading tokens kept uncompressed (model dtype).
        window: each query reads its `window` most recent tokens (itself included)
            uncompressed; the cache keeps exact copies of the last
            `window - 1 + trim_reserve` tokens for that.
        trim_reserve: trims up to this many tokens keep the window exact (prompt-lookup
            decoding rejects at most its draft length); larger trims still work, the
            window then reads codes for the tokens whose copies are gone.
        seed: rotation seed; `make_turboquant_cache` gives each layer its own.
        fused_prefill: multi-query passes through mx.fast's fused attention with the
            reading rule as a mask: None where that reaches cuDNN (CUDA, fp16/bf16,
            head dims <= 128) for passes of `FUSED_PREFILL_QUERIES` or more; True for
            every multi-query pass; False for none.
        routed: whether the model's attention calls `attention` (transforms/attention.py
            routed it): `update_and_fetch` then hands the exact chunk to that call.
            Cleared by itself after one update if no call comes.
    """

    step = 256

    def __init__(
        self,
        bits: int = 4,
        *,
        key_bits: Optional[int] = None,
        value_bits: Optional[int] = None,
        sink_tokens: int = DEFAULT_SINK_TOKENS,
        window: int = DEFAULT_WINDOW,
        trim_reserve: int = DEFAULT_TRIM_RESERVE,
        seed: int = 0,
        fused_prefill: Optional[bool] = None,
        routed: bool = False,
    ):
        default_k, default_v = resolve_bits(bits)
        # Not `bits`: mlx-lm's attention treats any cache with a `bits` attribute as
        # its own affine-quantized cache.
        self.nominal_bits = bits
        self.key_bits = key_bits or default_k
        self.value_bits = value_bits or default_v
        for name, b in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            if b not in CODEBOOKS:
                raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {b!r}")
        for name, n in (
            ("sink_tokens", sink_tokens),
            ("window", window),
            ("trim_reserve", trim_reserve),
        ):
            if not isinstance(n, int) or n < 0:
                raise ValueError(f"{name} must be an int >= 0, got {n!r}")
        self.sink_tokens = sink_tokens
        self.window = window
        self.trim_reserve = trim_reserve
        self.seed = int(seed)
        self.offset = 0
        self.dtype_name = ""
        self.key_dim = 0
        self.value_dim = 0
        # Uncompressed leading tokens (B, H, <= sink_tokens, d), model dtype.
        self.sink_keys = None
        self.sink_values = None
        # Codes of every token from position sink_tokens on, (B, H, capacity, words)
        # uint32, and their scales (B, H, capacity) float16; capacity grows in steps.
        self.key_codes = None
        self.key_norms = None
        self.value_codes = None
        self.value_norms = None
        # Exact copies of the most recent tokens (positions offset - n .. offset - 1).
        self.recent_keys = None
        self.recent_values = None
        self.fused_prefill = fused_prefill
        self.routed = routed
        self._chunk = None  # the exact chunk update_and_fetch handed to `attention`

    # -- helpers ---------------------------------------------------------------------

    @property
    def _n_sink(self) -> int:
        return min(self.offset, self.sink_tokens)

    @property
    def _n_coded(self) -> int:
        return max(0, self.offset - self.sink_tokens)

    @property
    def _n_recent(self) -> int:
        return 0 if self.recent_keys is None else self.recent_keys.shape[2]

    @property
    def _recent_capacity(self) -> int:
        # A window of 1 (the query's own token) is always in the chunk at hand.
        return 0 if self.window <= 1 else self.window - 1 + self.trim_reserve

    @property
    def dtype(self):
        return getattr(mx, self.dtype_name) if self.dtype_name else mx.float16

    def _rotation(self, dim: int) -> Rotation:
        return rotation(dim, self.seed)

    def _check(self, keys: mx.array, values: mx.array):
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                "TurboQuantKVCache expects keys/values of shape (B, n_kv_heads, L, "
                f"head_dim), got {keys.shape} and {values.shape}"
            )
        if self.key_dim and (
            keys.shape[-1] != self.key_dim or values.shape[-1] != self.value_dim
        ):
            raise ValueError(
                f"head dims changed: cache has {self.key_dim}/{self.value_dim}, got "
                f"{keys.shape[-1]}/{values.shape[-1]}"
            )

    def _grow(self, B: int, H: int, used: int, needed: int):
        """Room for `needed` coded tokens, keeping the first `used` (amortised growth
        in steps of `step` tokens, like mlx-lm's KVCache)."""
        have = 0 if self.key_codes is None else self.key_codes.shape[2]
        if needed <= have:
            return
        keep = min(used, have)
        new_cap = -(-needed // self.step) * self.step

        def grow(buf, tail_shape, dtype):
            fresh = mx.zeros((B, H, new_cap - keep, *tail_shape), dtype)
            if buf is None or keep == 0:
                return fresh
            return mx.concatenate([buf[:, :, :keep], fresh], axis=2)

        kw = packed_words(self.key_dim, self.key_bits)
        vw = packed_words(self.value_dim, self.value_bits)
        self.key_codes = grow(self.key_codes, (kw,), mx.uint32)
        self.value_codes = grow(self.value_codes, (vw,), mx.uint32)
        self.key_norms = grow(self.key_norms, (), mx.float16)
        self.value_norms = grow(self.value_norms, (), mx.float16)

    def _append_sinks(self, keys, values, prev: int, n: int):
        sk, sv = keys[:, :, :n], values[:, :, :n]
        if prev > 0 and self.sink_keys is not None:
            sk = mx.concatenate([self.sink_keys[:, :, :prev], sk], axis=2)
            sv = mx.concatenate([self.sink_values[:, :, :prev], sv], axis=2)
        self.sink_keys, self.sink_values = detach(sk), detach(sv)

    def _append_codes(self, keys, values, start: int):
        B, H, L, _ = keys.shape
        self._grow(B, H, start, start + L)
        kc, kn = encode(keys, self.key_bits, self._rotation(self.key_dim))
        vc, vn = encode(values, self.value_bits, self._rotation(self.value_dim))
        stop = start + L
        self.key_codes[:, :, start:stop] = kc
        self.key_norms[:, :, start:stop] = kn
        self.value_codes[:, :, start:stop] = vc
        self.value_norms[:, :, start:stop] = vn

    def _exact_tail(self, keys, values):
        """Exact K/V of the new chunk plus the window - 1 tokens before it."""
        w0 = min(self.window - 1, self._n_recent)
        if w0 <= 0:
            return keys, values
        rk = self.recent_keys[:, :, self._n_recent - w0 :]
        rv = self.recent_values[:, :, self._n_recent - w0 :]
        return mx.concatenate([rk, keys], 2), mx.concatenate([rv, values], 2)

    def _keep_recent(self, keys, values):
        """Keep exact copies of the last window - 1 + trim_reserve tokens."""
        cap, L, n_old = self._recent_capacity, keys.shape[2], self._n_recent
        if cap == 0:
            return
        if L < cap and n_old:
            lo = max(0, n_old - (cap - L))
            keys = mx.concatenate([self.recent_keys[:, :, lo:], keys], axis=2)
            values = mx.concatenate([self.recent_values[:, :, lo:], values], axis=2)
        self.recent_keys = detach(keys[:, :, -cap:])
        self.recent_values = detach(values[:, :, -cap:])

    # -- protocol --------------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store the chunk; return all keys/values, dequantized to the model dtype.

        The chunk's own tokens and the window - 1 before it come back exact (for one
        token at a time that is exactly "the last `window` tokens exact").
        """
        self._arrive(keys, values)
        return self._update(keys, values)

    def _arrive(self, keys: mx.array, values: mx.array) -> None:
        """Checks and bookkeeping before a chunk is stored."""
        self._check(keys, values)
        if not self.dtype_name:
            self.dtype_name = str(keys.dtype).split(".")[-1]
            self.key_dim, self.value_dim = keys.shape[-1], values.shape[-1]
        if self._chunk is not None:
            # The last chunk was never read by `attention`: this model's attention
            # does not go through the dispatch, so stop handing chunks over.
            self.routed = False
            self._chunk = None

    def _settle(self) -> None:
        """Back to the layout the rest of the class reads (the step type keeps a
        window of its own between steps)."""

    def _update(self, keys: mx.array, values: mx.array):
        prev, L = self.offset, keys.shape[2]
        n_sink = max(0, min(self.sink_tokens, prev + L) - prev)
        if n_sink:
            self._append_sinks(keys, values, prev, n_sink)
        if L > n_sink:
            start = max(0, prev - self.sink_tokens)
            self._append_codes(keys[:, :, n_sink:], values[:, :, n_sink:], start)
        tail = None
        if self.window:
            tail = self._exact_tail(keys, values)
            self._keep_recent(keys, values)
        self.offset += L
        self._chunk = tail if (self.routed and tail is not None) else None
        return self._fetch(tail)

    def _fetch(self, tail):
        keys, values = self.keys_and_values()
        if tail is None:
            return keys, values
        n = min(tail[0].shape[2], self.offset)
        if n == self.offset:
            return tail
        cut = self.offset - n
        return (
            mx.concatenate([keys[:, :, :cut], tail[0][:, :, -n:]], 2),
            mx.concatenate([values[:, :, :cut], tail[1][:, :, -n:]], 2),
        )

    def _coded(self):
        n = self._n_coded
        return (
            self.key_codes[:, :, :n],
            self.key_norms[:, :, :n],
            self.value_codes[:, :, :n],
            self.value_norms[:, :, :n],
        )

    def keys_and_values(self, rotated: bool = False):
        """All `offset` keys and values as stored: exact sinks, then decoded codes.

        Model dtype; `rotated=True` gives float32 in the rotated domain (R k, R v) for
        attention that rotates the query instead.
        """
        self._settle()
        s = self._n_sink
        parts_k, parts_v = [], []
        if s:
            sk, sv = self.sink_keys[:, :, :s], self.sink_values[:, :, :s]
            if rotated:
                sk = self._rotation(self.key_dim).forward(sk.astype(mx.float32))
                sv = self._rotation(self.value_dim).forward(sv.astype(mx.float32))
            parts_k.append(sk)
            parts_v.append(sv)
        if self._n_coded:
            kc, kn, vc, vn = self._coded()
            k = dequantize_rotated(kc, kn, self.key_bits, self.key_dim)
            v = dequantize_rotated(vc, vn, self.value_bits, self.value_dim)
            if not rotated:
                k = self._rotation(self.key_dim).inverse(k).astype(self.dtype)
                v = self._rotation(self.value_dim).inverse(v).astype(self.dtype)
            parts_k.append(k)
            parts_v.append(v)
        if len(parts_k) == 1:
            return parts_k[0], parts_v[0]
        return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self._settle()
        n = min(self.offset, n)
        self.offset -= n
        self._chunk = None
        # Codes past the new offset stay allocated and are overwritten by the next
        # update; sinks are cut on their next append.
        keep = self._n_recent - n
        if keep <= 0:
            self.recent_keys = self.recent_values = None
        elif n:
            self.recent_keys = self.recent_keys[:, :, :keep]
            self.recent_values = self.recent_values[:, :, :keep]
        return n

    def make_mask(
        self, N: int, return_array: bool = False, window_size: Optional[int] = None
    ):
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    @property
    def nbytes(self) -> int:
        """Bytes held: sinks, codes and norms (allocated capacity), recent copies."""
        arrays = (
            self.sink_keys,
            self.sink_values,
            self.key_codes,
            self.key_norms,
            self.value_codes,
            self.value_norms,
            self.recent_keys,
            self.recent_values,
            *self._extra_arrays(),
        )
        return sum(a.nbytes for a in arrays if a is not None)

    # -- state (mlx-lm's save_prompt_cache / load_prompt_cache) -----------------------

    _META = (
        "offset",
        "nominal_bits",
        "key_bits",
        "value_bits",
        "sink_tokens",
        "window",
        "trim_reserve",
        "seed",
        "key_dim",
        "value_dim",
    )

    @property
    def meta_state(self) -> Tuple[str, ...]:
        return tuple(str(getattr(self, k)) for k in self._META) + (self.dtype_name,)

    @meta_state.setter
    def meta_state(self, v):
        *ints, dtype_name = v
        if len(ints) != len(self._META):
            raise ValueError(
                f"TurboQuantKVCache meta_state needs {len(self._META) + 1} items"
            )
        for k, x in zip(self._META, ints):
            setattr(self, k, int(x))
        self.dtype_name = str(dtype_name)
        # A cache rebuilt from its state (a loaded prompt cache, a copy) serves a model
        # routed through the dispatch if any is; a model that is not clears it itself.
        self.routed = bool(routed_modules())
        self.fused_prefill = getattr(self, "fused_prefill", None)
        self._chunk = None
        self._reset_transient()

    def _reset_transient(self) -> None:
        """Forget what lives between two calls only (the step type's window)."""

    def _extra_arrays(self) -> tuple:
        """Arrays held besides the stored layout (the step type's window)."""
        return ()

    @property
    def state(self):
        """Arrays cut to what is in use, then the meta state (strings).

        mlx-lm 0.32's save_prompt_cache stores `state` alone (strings included) and
        load_prompt_cache rebuilds with `from_state(state)`.
        """
        self._settle()
        s = self._n_sink
        sink_k = None if self.sink_keys is None else self.sink_keys[:, :, :s]
        sink_v = None if self.sink_values is None else self.sink_values[:, :, :s]
        coded = (None,) * 4 if self.key_codes is None else self._coded()
        recent = (self.recent_keys, self.recent_values)
        return (sink_k, sink_v, *coded, *recent, *self.meta_state)

    @state.setter
    def state(self, v):
        sink_k, sink_v, kc, kn, vc, vn, rk, rv, *meta = v
        self.meta_state = meta
        self.sink_keys, self.sink_values = sink_k, sink_v
        self.key_codes, self.key_norms = kc, kn
        self.value_codes, self.value_norms = vc, vn
        self.recent_keys, self.recent_values = rk, rv

    # -- rows of one prompt pass (`entering`) -----------------------------------------

    def repeated(self, rows: int, reserve: int) -> "TurboQuantKVCache":
        """This one-row cache's tokens in `rows` rows, for one pass over several
        prompts' tails after them, each right-padded: it keeps `reserve` more
        exact recent copies, so that cutting up to that many pads off a row
        (`row`) leaves what a pass of the row's own would (codes never depend on
        chunking; the copies are what a trim would lose)."""
        out = self._mapped(lambda a: mx.repeat(a, rows, axis=0))
        out.trim_reserve += reserve
        return out

    def row(self, r: int, length: int, reserve: int) -> "TurboQuantKVCache":
        """Row r of a `repeated` cache (`reserve` as given there) after its pass,
        cut to its first `length` tokens, as a one-row cache (copied: it must not
        keep the pass's arrays alive)."""
        out = self._mapped(lambda a: mx.contiguous(a[r : r + 1]))
        out.trim(self.offset - length)
        out.trim_reserve -= reserve
        extra = out._n_recent - out._recent_capacity  # copies beyond what a pass of its own keeps
        if extra > 0:
            out.recent_keys, out.recent_values = out.recent_keys[:, :, extra:], out.recent_values[:, :, extra:]
        if not out._n_coded:  # all of it in the sinks: no codes, as a pass of its own leaves it
            out.key_codes = out.key_norms = out.value_codes = out.value_norms = None
        return out

    def _mapped(self, fn) -> "TurboQuantKVCache":
        """A cache of this one's meta state holding fn(a) for each of its arrays."""
        out, state = type(self)(self.nominal_bits), self.state
        out.state = [None if a is None else fn(a) for a in state[:8]] + list(state[8:])
        out.routed, out.fused_prefill = self.routed, self.fused_prefill
        return out

    # -- attention in the rotated domain ----------------------------------------------

    def attention(
        self,
        queries: mx.array,
        keys: Optional[mx.array] = None,
        values: Optional[mx.array] = None,
        *,
        scale: float,
        mask=None,
        sinks: Optional[mx.array] = None,
    ) -> mx.array:
        """softmax(q K^T * scale) V over everything cached, straight from the codes.

        (R q).(R k) == q.k for orthogonal R, and sum_j p_j R v_j == R (sum_j p_j v_j):
        the L_q queries and outputs are rotated instead of all `offset` keys and
        values. A coded key is norm_j / sqrt(d) * c_j (c_j the codebook values), so
        q.k_j = norm_j / sqrt(d) * (q.c_j): the norms scale the L_q x L scores and the
        probabilities, not the L x d keys and values. Query i reads keys
        i - window < j <= i exactly (the chunk handed over by update_and_fetch, or the
        recent copies) and sinks exactly -- the same for any chunking of the sequence.
        `keys` and `values` (the dequantized fetch the dispatch passes along) are not
        read, so MLX's lazy graph never computes them.
        """
        if sinks is not None:
            raise ValueError("TurboQuantKVCache attention does not take `sinks`")
        if queries.shape[2] == 1:
            forget_prefill_mask()
        dtype = queries.dtype
        q = self._rotation(self.key_dim).forward(queries.astype(mx.float32))
        tail, self._chunk = self._chunk, None
        if tail is None and self.window and self._n_recent:
            tail = (self.recent_keys, self.recent_values)
        parts = self._rotated_parts(tail, dtype)
        if self._flash(queries, mask):
            out = fused_attention(q.astype(dtype), parts, self.offset, self.window, scale)
        else:
            out = self._blocked_attention((q * scale).astype(dtype), parts, mask)
        out = self._rotation(self.value_dim).inverse(out.astype(mx.float32))
        return out.astype(dtype)

    def _flash(self, queries: mx.array, mask) -> bool:
        """Whether a multi-query pass takes `fused_attention` (`fused_prefill`)."""
        if self.fused_prefill is False or queries.shape[2] == 1 or isinstance(mask, mx.array):
            return False
        if self.fused_prefill is None:  # where mx.fast takes it to cuDNN's fused attention
            dims_ok = all(d % 8 == 0 and d <= 128 for d in (self.key_dim, self.value_dim))
            # Short passes (prompt-lookup verify) stay blocked: cuDNN builds a plan per
            # (queries, keys) shape, and a verify pass's shape changes every round.
            long_pass = queries.shape[2] >= FUSED_PREFILL_QUERIES
            return long_pass and dims_ok and queries.dtype in (mx.float16, mx.bfloat16) and available()
        return True

    def _blocked_attention(self, q: mx.array, parts, mask) -> mx.array:
        """`rotated_attention` over blocks of queries (q scaled and rotated)."""
        L_q = q.shape[2]
        outs = []
        # Blocks of queries bound the (L_q x offset) scores of long prefill chunks.
        block = query_block(q.shape[1], self.offset)
        for lo in range(0, L_q, block):
            hi = min(L_q, lo + block)
            m = mask[..., lo:hi, :] if isinstance(mask, mx.array) else mask
            end = self.offset - (L_q - hi)
            outs.append(rotated_attention(q[:, :, lo:hi], parts, end, self.window, m))
            if block < L_q:
                # One block at a time: left lazy, MLX runs the blocks' graphs side by
                # side and holds all their scores at once; merely ordered (mx.depends)
                # they still did (bench/RESULTS.md#turboquant-prefill).
                mx.eval(outs[-1])
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    def _rotated_parts(self, tail, dtype):
        """Sinks, codebook values with per-token scales, exact tail; rotated domain."""
        rot_k = self._rotation(self.key_dim)
        rot_v = self._rotation(self.value_dim)

        def rotate(x, rot):
            return rot.forward(x.astype(mx.float32)).astype(dtype)

        s = self._n_sink
        sinks = None
        if s:
            sinks = (
                rotate(self.sink_keys[:, :, :s], rot_k),
                rotate(self.sink_values[:, :, :s], rot_v),
            )
        coded = CodedHistory(self, dtype) if self._n_coded else None
        if tail is not None:
            n = min(tail[0].shape[2], self.offset)
            tail = (
                rotate(tail[0][:, :, -n:], rot_k),
                rotate(tail[1][:, :, -n:], rot_v),
            )
        return sinks, coded, tail
