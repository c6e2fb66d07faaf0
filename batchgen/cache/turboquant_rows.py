"""TurboQuant's codes as the KV cache of a continuous batch.

A batch of long jobs holds B rows of KV: in fp16 that, not the weights, bounds
how many rows fit. Here each layer keeps every row's positions as TurboQuant
codes (`turboquant.quantize`: ~0.27x the bytes at 4 bits) in buffers laid out
as the fp16 batch's: rows right-aligned at the write position (`write_position`), row b's
position j at column left_padding[b] + j, capacity grown in `CAPACITY_STEP`s.

Attention reads what `TurboQuantKVCache` reads, so a job's greedy text is the
one it gets alone: position j < S (the sinks) and the query's window
p - window < j <= p exactly, every other position from its codes. The exact
copies that takes are small per row: `sink_keys`/`sink_values` (B, H, S, D),
`tail_keys`/`tail_values` (B, H, window - 1, D) for the columns just before
`write_position`, and the step's own window of `window` slots (`compiled_step`), which is
encoded into the big buffers each time it fills. Flushing that often means no
window slot is ever old enough to be read from its codes: within a step the
codes come from the big buffers alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from ..kernels.attention import TQ_ROWS_FUSED_STEP, TQ_ROWS_STEP, tq_rows_runs
from ..kernels.turboquant import encode
from ..turboquant.codec import codebook_arrays, dequantize, packed_words, rotation
from .turboquant import TurboQuantKVCache
from .turboquant_attention import CodedHistory


@dataclass(frozen=True)
class Layout:
    """One layer's codec settings, read off a job's `TurboQuantKVCache`."""

    key_bits: int
    value_bits: int
    sink_tokens: int
    window: int  # exact positions a query reads, itself included (>= 1)
    seed: int
    key_dim: int
    value_dim: int
    dtype: mx.Dtype

    @classmethod
    def of(cls, c: TurboQuantKVCache) -> "Layout":
        if c.window < 1:  # every position from codes, the query's own too: not a layout the step reads
            raise ValueError(f"TurboQuant rows need a window of 1 or more, got {c.window}")
        return cls(c.key_bits, c.value_bits, c.sink_tokens, c.window, c.seed, c.key_dim, c.value_dim, c.dtype)

    @property
    def tail(self) -> int:
        """Exact positions kept before the write position (the window's older part)."""
        return self.window - 1

    def code_bytes(self, heads: int) -> int:
        """Bytes of one position's codes and scales over `heads` heads."""
        words = packed_words(self.key_dim, self.key_bits) + packed_words(self.value_dim, self.value_bits)
        return heads * (4 * words + 2 * 2)

    def exact_bytes(self, heads: int) -> int:
        """Bytes of one position held exactly (a sink, tail or window slot)."""
        return heads * (self.key_dim + self.value_dim) * self.dtype.size

    @property
    def kernel_constants(self) -> tuple:
        """The rows' step kernels' template constants (kernels/attention.py)."""
        return (("KB", self.key_bits), ("VB", self.value_bits), ("KW", packed_words(self.key_dim, self.key_bits)),
                ("VW", packed_words(self.value_dim, self.value_bits)), ("S", self.sink_tokens), ("E", self.tail),
                ("WIN", self.window))  # fmt: skip


class TurboQuantBatchLayer:
    """One layer of a batch's TurboQuant KV (see the module docstring).

    `BUFFERS` are indexed by column on axis 2 (the scheduler pads, cuts and
    grows them as the fp16 batch's keys and values); `ROWS` are per row only."""

    BUFFERS = ("key_codes", "key_norms", "value_codes", "value_norms")
    ROWS = ("sink_keys", "sink_values", "tail_keys", "tail_values")

    def __init__(self, rows: int):
        self.left_padding = mx.zeros((rows,), mx.int32)
        self.offset = mx.zeros((rows,), mx.int32)  # unused in compiled steps; kept beside left_padding
        self.write_position = 0  # the buffers' column the next token of every row goes to
        self.layout: Layout | None = None
        for name in self.BUFFERS + self.ROWS:
            setattr(self, name, None)

    @property
    def empty(self) -> bool:
        return self.key_codes is None

    @property
    def heads(self) -> int:
        return self.key_codes.shape[1]

    @property
    def step_kind(self) -> tuple:
        return ("turboquant", self.layout)

    def _allocate(self, rows: int, heads: int, columns: int) -> None:
        lay = self.layout
        kw, vw = packed_words(lay.key_dim, lay.key_bits), packed_words(lay.value_dim, lay.value_bits)
        self.key_codes = mx.zeros((rows, heads, columns, kw), mx.uint32)
        self.value_codes = mx.zeros((rows, heads, columns, vw), mx.uint32)
        self.key_norms = mx.zeros((rows, heads, columns), mx.float16)
        self.value_norms = mx.zeros((rows, heads, columns), mx.float16)
        self.sink_keys = mx.zeros((rows, heads, lay.sink_tokens, lay.key_dim), lay.dtype)
        self.sink_values = mx.zeros((rows, heads, lay.sink_tokens, lay.value_dim), lay.dtype)
        self.tail_keys = mx.zeros((rows, heads, lay.tail, lay.key_dim), lay.dtype)
        self.tail_values = mx.zeros((rows, heads, lay.tail, lay.value_dim), lay.dtype)

    def place(self, index: int, job: TurboQuantKVCache, n: int, rows: int) -> None:
        """Write the first n positions of a job's cache into row `index`,
        ending at the write position."""
        if self.layout is None:
            self.layout = Layout.of(job)
        elif Layout.of(job) != self.layout:
            raise ValueError(f"a job's TurboQuant cache {Layout.of(job)} differs from the batch's {self.layout}")
        sink_k, sink_v, kc, kn, vc, vn, *_ = job.state  # (settled: no step-mode window)
        if self.empty:
            self._allocate(rows, sink_k.shape[1], self.write_position)
        idx, lay, r = self.write_position, self.layout, slice(index, index + 1)
        s = min(n, lay.sink_tokens)
        if s:
            self.sink_keys[r, :, :s] = sink_k[:, :, :s]
            self.sink_values[r, :, :s] = sink_v[:, :, :s]
        coded = n - s
        if coded:
            cols = slice(idx - coded, idx)
            self.key_codes[r, :, cols], self.key_norms[r, :, cols] = kc[:, :, :coded], kn[:, :, :coded]
            self.value_codes[r, :, cols], self.value_norms[r, :, cols] = vc[:, :, :coded], vn[:, :, :coded]
        if lay.tail:
            tk, tv = self._job_tail(job, n)
            self.tail_keys[r], self.tail_values[r] = tk, tv
        self.left_padding[index] = idx - n
        self.offset[index] = n

    def _job_tail(self, job: TurboQuantKVCache, n: int) -> tuple[mx.array, mx.array]:
        """The exact copies of a job's last `tail` positions, (1, H, tail, D):
        its recent copies, or where a trim dropped them, its decoded codes (what
        the job alone would read there). Sink positions and positions before
        its first are zeros (never read: the sinks serve them)."""
        lay = self.layout
        lo = max(n - lay.tail, lay.sink_tokens)  # the tail's positions read at all: lo .. n - 1

        def part(codes, norms, bits, dim, recent):
            have = 0 if recent is None or job.offset != n else min(recent.shape[2], n - lo)
            parts = [recent[:, :, -have:].astype(lay.dtype)] if have else []
            if have < n - lo:  # decoded only where no recent copy is left (a graph of ~50 ops a layer)
                cols = slice(lo - lay.sink_tokens, n - have - lay.sink_tokens)
                parts.insert(0, dequantize(codes[:, :, cols], norms[:, :, cols], bits, rotation(dim, lay.seed),
                                           lay.dtype))  # fmt: skip
            x = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
            return mx.pad(x, [(0, 0), (0, 0), (lay.tail - (n - lo), 0), (0, 0)])

        if lo >= n:
            shape = (1, job.sink_keys.shape[1], lay.tail)
            return mx.zeros(shape + (lay.key_dim,), lay.dtype), mx.zeros(shape + (lay.value_dim,), lay.dtype)
        return (part(job.key_codes, job.key_norms, lay.key_bits, lay.key_dim, job.recent_keys),
                part(job.value_codes, job.value_norms, lay.value_bits, lay.value_dim, job.recent_values))

    def window_like(self) -> tuple[int, int, int, int, mx.Dtype]:
        """(rows, heads, key dim, value dim, dtype) of the step's window."""
        lay = self.layout
        return self.key_codes.shape[0], self.heads, lay.key_dim, lay.value_dim, lay.dtype

    def write_window(self, rkeys: mx.array, rvalues: mx.array, n: int) -> None:
        """Encode the window's first n slots into the big buffers at the write
        position (capacity made beforehand) and advance it; they become the
        tail's newest exact copies, and where a row's position is below S, its
        sink."""
        lay, idx = self.layout, self.write_position
        k, v = rkeys[:, :, :n], rvalues[:, :, :n]
        kc, kn = encode(k, lay.key_bits, rotation(lay.key_dim, lay.seed))
        vc, vn = encode(v, lay.value_bits, rotation(lay.value_dim, lay.seed))
        cols = slice(idx, idx + n)
        self.key_codes[:, :, cols], self.key_norms[:, :, cols] = kc, kn
        self.value_codes[:, :, cols], self.value_norms[:, :, cols] = vc, vn
        if lay.tail:  # dense (the step kernel would copy a view every step)
            self.tail_keys = mx.contiguous(mx.concatenate([self.tail_keys, k], axis=2)[:, :, -lay.tail :])
            self.tail_values = mx.contiguous(mx.concatenate([self.tail_values, v], axis=2)[:, :, -lay.tail :])
        if lay.sink_tokens:
            # slot of sink s in this window: its column minus the write position
            slot = self.left_padding[:, None] + mx.arange(lay.sink_tokens)[None] - idx  # (B, S)
            inside = ((slot >= 0) & (slot < n))[:, None, :, None]
            at = mx.clip(slot, 0, n - 1)[:, None, :, None]
            self.sink_keys = mx.where(inside, mx.take_along_axis(k, at, axis=2), self.sink_keys)
            self.sink_values = mx.where(inside, mx.take_along_axis(v, at, axis=2), self.sink_values)
        self.write_position += n

    def step_arrays(self) -> tuple:
        """What the compiled step takes of this layer."""
        return tuple(getattr(self, name) for name in self.BUFFERS + self.ROWS)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in self.BUFFERS + self.ROWS if getattr(self, n) is not None)


class TurboQuantStepCache:
    """One layer of the batch inside the compiled step (`compiled_step.make_step`):
    the big buffers' codes, the rows' sinks and tails, and the step's window
    (B, H, window, D), `meta` int32 [base, used, capacity, window] as the fp16
    `StepCache`'s. `update_and_fetch` writes the token into window slot
    `used` (or, `kernel` on, hands it to the kernel, which writes it);
    `attention` (through the attention dispatch) and `fused_attention`
    (`step_forward`) attend by the reading rule."""

    def __init__(self, layout: Layout, arrays, rkeys, rvalues, meta, left_padding, shared: dict, kernel: bool = False):
        (self.key_codes, self.key_norms, self.value_codes, self.value_norms,
         self.sink_keys, self.sink_values, self.tail_keys, self.tail_values) = arrays  # fmt: skip
        self.layout, self.rkeys, self.rvalues = layout, rkeys, rvalues
        self.meta, self.left_padding, self.shared, self.kernel = meta, left_padding, shared, kernel
        self.new: tuple | None = None  # the step's token, where the kernel writes it
        # what `CodedHistory` reads: every column (the mask says which count)
        self.key_bits, self.value_bits = layout.key_bits, layout.value_bits
        self.key_dim, self.value_dim = layout.key_dim, layout.value_dim
        self._n_coded = self.key_codes.shape[2]

    @property
    def offset(self) -> mx.array:
        """Each row's position of the token being written (RoPE's offset)."""
        return self.meta[0] + self.meta[1] - self.left_padding

    def takes_kernel(self, *new) -> bool:
        """Whether the rows' step kernel serves this layer (CUDA, `kernel` on), fed
        `new` (the step's keys and values, or the projection they come from)."""
        exact = (*new, self.sink_keys, self.sink_values, self.tail_keys, self.tail_values, self.rkeys, self.rvalues)
        return self.kernel and TQ_ROWS_STEP.enabled() and tq_rows_runs(self.layout.kernel_constants, *exact)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None  # `attention` applies the reading rule itself

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] != 1:
            raise ValueError(f"TurboQuantStepCache takes one token per row, got {keys.shape[2]}")
        if self.takes_kernel(keys, values):
            self.new = (keys, values)
            return keys, values
        slot = self.meta[1:2]
        self.rkeys = mx.slice_update(self.rkeys, keys.astype(self.rkeys.dtype), slot, axes=(2,))
        self.rvalues = mx.slice_update(self.rvalues, values.astype(self.rvalues.dtype), slot, axes=(2,))
        return keys, values  # not read: `attention` reads the layer's own arrays

    def _rows(self) -> tuple:
        return (self.sink_keys, self.sink_values, self.tail_keys, self.tail_values, self.key_codes, self.key_norms,
                self.value_codes, self.value_norms, self.rkeys, self.rvalues)  # fmt: skip

    def _kernel_args(self) -> tuple:
        lay = self.layout
        return (self._rows(), _tables(lay), rotation(lay.key_dim, lay.seed).signs, self.left_padding, self.meta)

    def fused_attention(self, roped: mx.array, heads: mx.array, scale: float) -> mx.array:
        """`step_forward`'s attention through the rows' fused step kernel, q and the new
        k read from `roped`, the new v from `heads`: (B, Hq * D)."""
        out, self.rkeys, self.rvalues = TQ_ROWS_FUSED_STEP.kernel_form(
            roped, heads, *self._kernel_args(), scale, self.layout.kernel_constants)
        return out

    def _masks(self) -> tuple[mx.array, mx.array]:
        """(exact (B, 1, 1, 1, S + tail + window), coded (B, 1, 1, 1, capacity)):
        which columns a row's query reads, shared by every layer of the step."""
        if "masks" not in self.shared:
            lay, lp = self.layout, self.left_padding[:, None]
            base, used = self.meta[0], self.meta[1]
            p, S, W = base + used, lay.sink_tokens, self.rkeys.shape[2]
            first_coded = lp + S  # a row's columns below this are sinks (or padding)
            sinks = lp + mx.arange(S)[None] < base  # in the big buffers (else still in the window)
            tail_col = base - lay.tail + mx.arange(lay.tail)[None]
            tail = (tail_col >= first_coded) & (tail_col > p - lay.window)
            window = mx.broadcast_to(mx.arange(W)[None] <= used, (lp.shape[0], W))
            col = mx.arange(self.key_codes.shape[2])[None]
            coded = (col >= first_coded) & (col < base) & (col <= p - lay.window)
            exact = mx.concatenate([sinks, tail, window], axis=1)
            self.shared["masks"] = (exact[:, None, None, None, :], coded[:, None, None, None, :])
        return self.shared["masks"]

    def attention(self, queries: mx.array, keys=None, values=None, *, scale: float, mask=None, sinks=None) -> mx.array:
        """softmax over the exact columns (plain domain) and the coded ones
        (rotated: (R q).(R k) = q.k, and the values' sum comes back through
        R^-1): queries (B, Hq, 1, D) -> (B, Hq, 1, D)."""
        if sinks is not None:
            raise ValueError("TurboQuantStepCache attention does not take `sinks`")
        if self.new is not None:
            (k_new, v_new), self.new = self.new, None
            out, self.rkeys, self.rvalues = TQ_ROWS_STEP.kernel_form(queries, k_new, v_new, *self._kernel_args(), scale,
                                                                     self.layout.kernel_constants)  # fmt: skip
            return out
        lay = self.layout
        B, n_heads, _, D = queries.shape
        H = self.key_codes.shape[1]
        dtype = queries.dtype
        q = (queries * scale).reshape(B, H, n_heads // H, 1, D)
        keys = mx.concatenate([self.sink_keys, self.tail_keys, self.rkeys], axis=2).astype(dtype)
        values = mx.concatenate([self.sink_values, self.tail_values, self.rvalues], axis=2).astype(dtype)
        exact_mask, coded_mask = self._masks()
        q_rot = rotation(lay.key_dim, lay.seed).forward(q.astype(mx.float32)).astype(dtype)
        coded = CodedHistory(self, dtype)
        exact_scores = (q @ keys[:, :, None].swapaxes(-1, -2)).astype(mx.float32)
        scores = mx.concatenate([mx.where(exact_mask, exact_scores, -mx.inf),
                                 mx.where(coded_mask, coded.scores(q_rot), -mx.inf)], axis=-1)  # fmt: skip
        p = mx.softmax(scores, axis=-1, precise=True)
        n = keys.shape[2]
        out = p[..., :n].astype(dtype) @ values[:, :, None]
        rotated = coded.values(p[..., n:])
        out = out + rotation(lay.value_dim, lay.seed).inverse(rotated.astype(mx.float32)).astype(dtype)
        return out.reshape(B, n_heads, 1, -1)


@lru_cache(maxsize=None)
def _tables(layout: Layout) -> mx.array:
    """The key codebook's levels, then the value codebook's (float32)."""
    tables = mx.concatenate([codebook_arrays(layout.key_bits)[0], codebook_arrays(layout.value_bits)[0]])
    mx.eval(tables)
    return tables


def batch_layer_for(cache_layer, rows: int):
    """The batch layer for one layer of a job's cache kind (None: not TurboQuant)."""
    return TurboQuantBatchLayer(rows) if isinstance(cache_layer, TurboQuantKVCache) else None
