"""A batch's decode step as one compiled function over fixed-shape buffers.

A one-token step of a small model is bound by the host, not the chip: building
the step's graph in Python and launching its few hundred kernels cost more than
the kernels take (bench/RESULTS.md#compiled-batch-step). `mx.compile` records the step once and
replays it, fusing the elementwise ops between matmuls, but a recording holds
for fixed input shapes only, and a growing KV cache changes shape every step.

So the step sees the batch cache's whole buffers (B, heads, capacity, D),
capacity rounded up to `CAPACITY_STEP` positions, and the write position as an
array: every step has the same shapes until the capacity grows.

Where the step's keys and values go: writing them into the big buffers inside
the step copied each whole buffer every step (MLX cannot update a buffer in
place while earlier steps still hold it, and the step's time grew with the
capacity: bench/RESULTS.md#compiled-batch-step). The step instead
writes into a small recent window of `WINDOW` positions per row; the window
is flushed into the big buffers once it is full (or before rows enter), one
copy per `WINDOW` steps. Row b's tokens are at positions left_padding[b] ..
base - 1 of the big buffers, then base .. base + used - 1 in the window; the
step's own token goes to position base + used (window slot `used`).

On CUDA one kernel (the `batch_step` op, kernels/attention.py) reads both parts
and the new token and writes the window; elsewhere the window is updated with
`mx.slice_update` and attention runs over both parts with a mask.

The batch layers (cache/fp16.py's `Fp16BatchCache`, cache/turboquant_rows.py's
`TurboQuantBatchLayer`) share what the step and the scheduler ask of them: big
buffers (`BUFFERS`, indexed by column on axis 2), per-row arrays (`ROWS`), the
write position, `left_padding`, `step_kind`, `step_arrays()`, `window_like()` and
`write_window()`.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from ..cache.turboquant_rows import TurboQuantStepCache
from ..kernels.attention import BATCH_FUSED_STEP, BATCH_STEP, kernel_takes
from .forward import make_step_forward

CAPACITY_STEP = 256  # positions: the big buffers grow (and the step is recorded anew) in these
WINDOW = 32  # positions of the recent window: the big buffers are written once per this many steps


def capacity_for(positions: int) -> int:
    """Big-buffer positions that hold `positions` (at least one).

    >>> [capacity_for(n) for n in (1, 256, 257, 600)]
    [256, 256, 512, 768]
    """
    return max(1, -(-positions // CAPACITY_STEP)) * CAPACITY_STEP


def held_positions(longest: int) -> int:
    """Positions per row the step's buffers hold for rows of at most `longest`
    tokens: big buffers of `capacity_for` that plus a window, and the window.

    >>> [held_positions(n) for n in (1, 224, 225, 1000)]
    [288, 288, 544, 1312]
    """
    return capacity_for(longest + WINDOW) + WINDOW


class StepCache:
    """One layer's batch cache inside the step: big buffers `keys`/`values`
    (B, heads, capacity, D), the recent window `rkeys`/`rvalues` (B, heads,
    WINDOW, D), `meta` int32 [base, used, capacity, WINDOW] and each row's
    left padding (B,). `kernel`: `attention` takes the step's token (`new`) and
    updates the window itself (CUDA)."""

    def __init__(self, keys, values, rkeys, rvalues, meta: mx.array, left_padding: mx.array, kernel: bool):
        self.keys, self.values, self.rkeys, self.rvalues = keys, values, rkeys, rvalues
        self.meta, self.left_padding, self.kernel = meta, left_padding, kernel
        self.new: tuple | None = None

    @property
    def offset(self) -> mx.array:
        """Each row's position of the token being written (RoPE's offset)."""
        return self.meta[0] + self.meta[1] - self.left_padding

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] != 1:
            raise ValueError(f"StepCache takes one token per row, got {keys.shape[2]}")
        if self.takes_kernel(keys, values):
            self.new = (keys, values)  # the kernel attends to them and writes the window
            return self.keys, self.values
        slot = self.meta[1:2]
        self.rkeys = mx.slice_update(self.rkeys, keys, slot, axes=(2,))
        self.rvalues = mx.slice_update(self.rvalues, values, slot, axes=(2,))
        return mx.concatenate([self.keys, self.rkeys], axis=2), mx.concatenate([self.values, self.rvalues], axis=2)

    def takes_kernel(self, *new) -> bool:
        """Whether the step kernel serves this layer, fed `new` (the step's keys
        and values, or the projection they come from): `kernel` on (CUDA) and
        `kernel_takes` over them and the buffers."""
        return self.kernel and BATCH_STEP.enabled() and kernel_takes(*new, self.keys, self.values, self.rkeys,
                                                                     self.rvalues)  # fmt: skip

    def attention(self, queries, keys, values, *, scale: float, mask=None, sinks=None):
        """The step kernel where `update_and_fetch` handed it the token; else the
        stock attention over what that returned, with `make_mask`."""
        if self.new is None or sinks is not None:
            return NotImplemented
        (k_new, v_new), self.new = self.new, None
        out, self.rkeys, self.rvalues = BATCH_STEP.kernel_form(queries, k_new, v_new, self.keys, self.values,
                                                               self.rkeys, self.rvalues, self.left_padding,
                                                               self.meta, scale)  # fmt: skip
        return out

    def fused_attention(self, roped: mx.array, heads: mx.array, scale: float) -> mx.array:
        """`step_forward`'s attention through the step kernel (`takes_kernel`): (B, Hq * D)."""
        out, self.rkeys, self.rvalues = BATCH_FUSED_STEP.kernel_form(roped, heads, self.keys, self.values, self.rkeys,
                                                                     self.rvalues, self.left_padding, self.meta,
                                                                     scale)  # fmt: skip
        return out

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """(B, 1, 1, capacity + WINDOW): the big buffers' columns, then the window's."""
        if window_size is not None:
            raise ValueError("StepCache has no sliding-window mask")
        base, used = self.meta[0], self.meta[1]
        big, recent = mx.arange(self.keys.shape[2]), mx.arange(self.rkeys.shape[2])
        position = mx.concatenate([big, base + recent])
        stored = mx.concatenate([big < base, recent <= used])
        valid = stored[None] & (position[None] >= self.left_padding[:, None])
        return valid[:, None, None, :]

    @property
    def state(self):
        return self.keys, self.values, self.rkeys, self.rvalues

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


def _step_cache(kind, arrays, rkeys, rvalues, meta, left_padding, kernel: bool, shared: dict):
    if kind == "fp16":
        return StepCache(*arrays, rkeys, rvalues, meta, left_padding, kernel)
    return TurboQuantStepCache(kind[1], arrays, rkeys, rvalues, meta, left_padding, shared, kernel)


def make_step(model, sample_rows: bool, kernel: bool, own_forward: bool = True, kinds: tuple | None = None,
              compiled: bool = True) -> Callable:  # fmt: skip
    """The compiled step: (inputs (B,), layers [each layer's `step_arrays()`],
    rkeys, rvalues [one per layer], meta, left_padding) ->
    (greedy tokens (B,), logits (B, vocab) or None, new rkeys, new rvalues).
    `sample_rows`: also return the logits (some rows sample); greedy-only
    batches read back B tokens and nothing more. `kernel`: attention through
    the step kernels (CUDA). `own_forward`:
    through `step_forward` where it covers the model (a third of the
    primitives), else the model's own layers. `kinds`: each layer's
    `step_kind` (None: fp16). `compiled`: False runs the same step unrecorded."""
    forward = make_step_forward(model) if own_forward else None

    def step(inputs, layers, rkeys, rvalues, meta, left_padding):
        shared: dict = {}  # what the layers of one step compute once (TurboQuant's masks)
        cache = [_step_cache("fp16" if kinds is None else kinds[i], arrays, rk, rv, meta, left_padding, kernel, shared)
                 for i, (arrays, rk, rv) in enumerate(zip(layers, rkeys, rvalues))]  # fmt: skip
        if forward is not None:
            logits = forward(inputs, cache, kernel)
        else:
            logits = model(inputs[:, None], cache=cache)[:, -1, :]
        tokens = mx.argmax(logits, axis=-1)
        out_k, out_v = [c.rkeys for c in cache], [c.rvalues for c in cache]
        return (tokens, logits, out_k, out_v) if sample_rows else (tokens, out_k, out_v)

    fn = mx.compile(step) if compiled else step
    if sample_rows:
        return fn

    def greedy(*args):
        tokens, out_k, out_v = fn(*args)
        return tokens, None, out_k, out_v

    return greedy


def fit_capacity(cache: list, at_least: int = 0) -> None:
    """Give the batch layers (`Fp16BatchCache`, or TurboQuant's) big
    buffers of `capacity_for` their write position plus a full window, or
    `at_least` (the step's shapes change only when this does; cutting spare
    positions is safe, none beyond the write position are used)."""
    first = getattr(cache[0], cache[0].BUFFERS[0])
    want, have = max(capacity_for(cache[0].write_position + WINDOW), at_least), first.shape[2]
    if have == want:
        return
    for c in cache:
        for name in c.BUFFERS:
            a = getattr(c, name)
            if have > want:
                a = a[:, :, :want]
            else:
                a = mx.pad(a, [(0, 0), (0, 0), (0, want - have)] + [(0, 0)] * (a.ndim - 3))
            setattr(c, name, a)


class CompiledSteps:
    """Steps a batch held in batch layers (`Fp16BatchCache`, or
    TurboQuant's: big buffers, `write_position`, `left_padding`) through
    the compiled step, keeping the recent window between steps. `recorded`:
    where the compiled steps are kept (a dict that outlives this object:
    recording costs). `own_forward`: see `make_step`. `compiled`: False steps
    unrecorded (a model the recording cannot take)."""

    def __init__(self, model, kernel: bool, recorded: dict, own_forward: bool = True):
        self.model, self.kernel, self.recorded, self.own_forward = model, kernel, recorded, own_forward
        self.compiled = True
        self.keys: list | None = None  # the window, one (B, heads, window, D) per layer
        self.values: list | None = None
        self.used = 0  # positions the window holds
        self.min_capacity = 0  # big buffers of at least this many positions (benchmarks)

    @staticmethod
    def window_size(cache: list) -> int:
        """Slots of the window: `WINDOW`, or a TurboQuant layer's exact window
        (flushed before any slot would be read from its codes)."""
        layout = cache[0].layout
        return WINDOW if layout is None else layout.window

    def __call__(self, cache: list, inputs: mx.array, sample: bool,
                 check: bool = False) -> tuple[mx.array, mx.array | None]:  # fmt: skip
        """Queue one step: (greedy tokens (B,), logits or None). `check`:
        evaluate it now, so that a step that cannot run raises here and leaves
        the window as it was."""
        window = self.window_size(cache)
        if self.used == window:
            self.flush(cache)
        fit_capacity(cache, self.min_capacity)
        self._ready(cache, window)
        kinds = tuple(c.step_kind for c in cache)
        key = (sample, self.kernel, self.own_forward, kinds, self.compiled)
        if key not in self.recorded:
            self.recorded[key] = make_step(self.model, sample_rows=sample, kernel=self.kernel,
                                           own_forward=self.own_forward, kinds=kinds, compiled=self.compiled)  # fmt: skip
        c0 = cache[0]
        meta = mx.array([c0.write_position, self.used, getattr(c0, c0.BUFFERS[0]).shape[2], window], mx.int32)
        layers = [c.step_arrays() for c in cache]
        tokens, logits, rkeys, rvalues = self.recorded[key](inputs, layers, self.keys, self.values, meta,
                                                             c0.left_padding)  # fmt: skip
        if check:
            mx.eval(tokens, rkeys, rvalues)
        self.keys, self.values = rkeys, rvalues
        self.used += 1
        return tokens, logits

    def _ready(self, cache: list, window: int) -> None:
        """Window buffers of the cache's rows, heads and dtype (new ones where those changed)."""
        B, H, dk, _, dtype = cache[0].window_like()
        shape = (B, H, window)
        if self.keys is None or self.keys[0].shape[:3] != shape or self.keys[0].dtype != dtype:
            likes = [c.window_like() for c in cache]
            self.keys = [mx.zeros(shape + (like[2],), like[4]) for like in likes]
            self.values = [mx.zeros(shape + (like[3],), like[4]) for like in likes]

    def flush(self, cache: list) -> None:
        """Write the window's positions at the write position and advance it
        (before rows are placed there or padding is cut, and when it is full)."""
        n = self.used
        if not n:
            return
        fit_capacity(cache, self.min_capacity)
        for c, rk, rv in zip(cache, self.keys, self.values):
            c.write_window(rk, rv, n)
        self.used = 0

    def select(self, rows: mx.array) -> None:
        """Keep only these rows (the batch shrank)."""
        if self.keys is not None:
            self.keys = [k[rows] for k in self.keys]
            self.values = [v[rows] for v in self.values]
