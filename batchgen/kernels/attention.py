"""The batch's one-query attention kernel ops (sources in cuda/).

Rows of different lengths share a left-padded buffer, and MLX's CUDA backend has no
fused one-query attention that takes a mask: each layer's step fell back to matmul +
mask + softmax + matmul (bench/RESULTS.md#batch-attention-kernel). These kernels read
each row from its own first position instead, a block per (row, query head), or for
the fp16 kernels on a wide grid a block per (row, kv head) serving all its query heads
(`group`):

    batch_decode         mlx-lm's BatchKVCache after its update
    batch_step           the compiled step's cache (step/compiled.py): big buffers, a
                         recent window, the step's own token written into the window
    batch_fused_step     the same fed by step/forward.py's fused q|k|v projection
    tq_rows_step         TurboQuant batch rows (cache/turboquant_rows.py): exact sinks,
                         tail and window, everything else read from its codes
    tq_rows_fused_step   the same fed by the fused projection

Each reference below is the same attention as plain MLX ops (float32 softmax).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..turboquant.codec import Rotation, codebook_arrays, levels, packed_words, quantize, rotation
from ..turboquant.reference import attention as reference_attention
from .registry import Op, constant, register

# Head sizes these kernels take: D / 8 lanes read a position, a power of two that
# divides a warp.
KERNEL_HEAD_SIZES = (32, 64, 128, 256)
UNROLL = 4
# Warps a block. A block is one (row, query head) and reads the row's positions
# WARPS x UNROLL x CPW columns a round. One job's step has only Hq blocks, which
# need many warps each to keep the GPU busy; a batch of many rows has blocks to
# spare, and there fewer warps a block ran faster: 256 rows of the 7B shape,
# whole batched runs at 4 warps, 6-11% more tokens/s (free, JSON and logprobs
# rows, both orders; H100, bench/RESULTS.md "Batch attention kernel"). WIDE_GRID:
# 2,048 blocks is under 256 rows of both measured shapes (7,168 and 3,584);
# smaller grids keep 16 warps, where nothing was measured to beat it, and so do
# the TurboQuant rows' kernels (`wide` off), not measured with fewer. Runs at 32
# to 128 rows, or of TurboQuant rows, at 4 and 16 warps would move these.
WARPS = 16
WIDE_WARPS = 4
WIDE_GRID = 2048
# Query heads a block on a wide grid (the fp16 kernels; attend.cuh's QB): all of a kv
# head's (QB = HQ / HKV), each key and value copied once into shared memory for them
# (attend_tiled.cuh), not read once per query head: whole batched runs ran faster with
# it on the 7B and 0.5B shapes, short and 1,024-token prompts (bench/RESULTS.md "Batch
# attention kernel"). One job's step (Hq blocks at most) keeps a block per query head:
# too few kv heads to fill the GPU. MAX_GROUP: a warp keeps QB / GROUP_WARPS heads' sums
# in registers; groups of more than 8 (no model measured) would want more warps.
# GROUP_WARPS: 8 took less time a step than 4 in the step sweep, but whole fresh-process
# runs put 4 ahead or level (1.01x at 7B, 1.04x at 0.5B, H100; bench/RESULTS.md "Fresh
# processes, as a cron user runs them"). A GPU whose step sweep and whole runs both favour
# 8 would change it.
GROUPED = True
MAX_GROUP = 8
GROUP_WARPS = 4


def warps(blocks: int, d: int, wide: bool = True, grouped: bool = False) -> int:
    """Warps a block for a launch of `blocks` (rows x query heads) blocks of head
    size `d` (`grouped`: blocks of several query heads, `GROUP_WARPS`): at least a
    thread per coordinate (the TurboQuant rows' kernels finish a head with one
    thread per coordinate).

    >>> warps(28, 128), warps(64 * 28, 128), warps(256 * 28, 128), warps(256 * 28, 256), warps(256 * 28, 128, False)
    (16, 16, 4, 8, 16)
    """
    w = GROUP_WARPS if grouped else WIDE_WARPS if wide and blocks >= WIDE_GRID else WARPS
    return max(w, d // 32)


def group(rows: int, q_heads: int, kv_heads: int) -> int:
    """Query heads a block of the fp16 batch kernels (`GROUPED`): all of a kv head's on
    a wide grid, else one.

    >>> group(256, 28, 4), group(8, 28, 4), group(256, 32, 2), group(256, 8, 8)
    (7, 1, 1, 1)
    """
    g = q_heads // kv_heads
    return g if GROUPED and 1 < g <= MAX_GROUP and rows * q_heads >= WIDE_GRID else 1


def wide_rows(q_heads: int) -> int:
    """The fewest batch rows whose steps launch a wide grid (`warps`).

    >>> wide_rows(28), wide_rows(14), wide_rows(4096)
    (74, 147, 1)
    """
    return -(-WIDE_GRID // q_heads)


def kernel_head_size(*arrays) -> bool:
    """What the batch attention kernels take: one head size over all these arrays,
    one of `KERNEL_HEAD_SIZES`.

    >>> [kernel_head_size(mx.zeros((1, d))) for d in (32, 64, 96, 128, 256, 512)]
    [True, True, False, True, True, False]
    """
    d = arrays[0].shape[-1]
    return all(a.shape[-1] == d for a in arrays) and d in KERNEL_HEAD_SIZES


def kernel_takes(*arrays) -> bool:
    """A step kernel's needs: one dtype (it picks each position's pointer from several
    buffers) and `kernel_head_size`."""
    return len({a.dtype for a in arrays}) == 1 and kernel_head_size(*arrays)


def launch(op: Op, queries: mx.array, kv_heads: int, inputs: dict, scale: float, also: dict,
           q_heads: int | None = None, flat: bool = False, template: tuple = (), wide: bool = True,
           grouped: bool = False) -> list:  # fmt: skip
    """Run `op` over q + `inputs` + scale: out (B, q_heads, 1, D) in the queries' dtype
    (the kernel rounds its float32 sums on the way out, which saves each layer of a step
    a cast of its own), then each output named in `also`, shaped like its array there.
    `q_heads`: the query heads, where `queries` holds more heads than that (HT: all of
    them). `flat`: out as (B, q_heads * D), the same memory (the output projection's
    input). `template`: constants besides the shapes. `wide`: fewer warps a block on a
    wide grid (`warps`). `grouped`: the op's source takes QB query heads a block
    (attend.cuh), as many as `group` gives."""
    B, all_heads, _, d = queries.shape
    n_heads = q_heads or all_heads
    scale_arr = constant(("scale", scale), lambda: mx.array([scale], mx.float32))
    qb = group(B, n_heads, kv_heads) if grouped else 1
    w = warps(B * n_heads, d, wide, grouped=qb > 1)
    threads = 32 * w
    return op.kernel()(
        inputs=[queries, *inputs.values(), scale_arr],
        template=[("D", d), ("HQ", n_heads), ("HKV", kv_heads), ("HT", all_heads), ("WARPS", w),
                  ("UNROLL", UNROLL), *((("QB", qb),) if grouped else ()), *template],  # fmt: skip
        grid=(B * n_heads // qb * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, n_heads * d) if flat else (B, n_heads, 1, d)] + [a.shape for a in also.values()],
        output_dtypes=[queries.dtype] + [a.dtype for a in also.values()],
    )


def masked_attention(q: mx.array, keys: mx.array, values: mx.array, valid: mx.array, scale: float) -> mx.array:
    """softmax(scale q k^T) v over the positions `valid` (B, n) marks, per row, in
    float32; a row with none gives zeros (as the kernels do). q (B, Hq, 1, D), keys /
    values (B, Hkv, n, D) -> (B, Hq, 1, D) in q's dtype."""
    B, n_heads, _, d = q.shape
    n_kv = keys.shape[1]
    qg = q.astype(mx.float32).reshape(B, n_kv, n_heads // n_kv, 1, d) * scale
    s = qg @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)  # (B, Hkv, G, 1, n)
    ok = valid[:, None, None, None, :]
    s = mx.where(ok, s, -mx.inf)
    m = mx.max(s, axis=-1, keepdims=True)
    e = mx.where(ok, mx.exp(s - mx.where(mx.isinf(m), 0, m)), 0)
    total = e.sum(-1, keepdims=True)
    out = (e @ values.astype(mx.float32)[:, :, None]) / mx.where(total > 0, total, 1)
    return out.reshape(B, n_heads, 1, -1).astype(q.dtype)


def _random(shape, seed: int, dtype) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


# --------------------------------------------------------------------------------------
# batch_decode


def _decode_kernel(q, k, v, left_padding, bounds, scale):
    return launch(BATCH_DECODE, q, k.shape[1], {"k": k, "v": v, "left_padding": left_padding.astype(mx.int32),
                                                "meta": bounds}, scale, {}, grouped=True)[0]  # fmt: skip


def _decode_reference(q, k, v, left_padding, bounds, scale):
    col = mx.arange(k.shape[2])[None]
    valid = (col >= left_padding[:, None]) & (col < bounds[0])
    return masked_attention(q, k, v, valid, scale)


def _decode_examples():
    # the last, as in the step's examples: the demo model's heads (pairs of query heads, head dim 32)
    out = []
    for d, (hq, hkv), dtype in ((64, (14, 2), mx.float32), (128, (8, 8), mx.float32), (64, (14, 2), mx.bfloat16),
                                (32, (8, 4), mx.bfloat16)):  # fmt: skip
        pads = mx.array([0, 299, 17, 150, 5])  # 299: a row holding one token
        k, v = (_random((5, hkv, 320, d), s, dtype) for s in (1, 2))
        q = _random((5, hq, 1, d), 3, dtype)
        out.append(((q, k, v, pads, mx.array([300, 320], mx.int32), d**-0.5), {}))
    return out


BATCH_DECODE = register(Op(
    "batch_decode", "batch_decode.cu", ("q", "k", "v", "left_padding", "meta", "scale"), ("out",),
    launch=_decode_kernel, reference=_decode_reference,
    runs=lambda q, k, v, *rest: kernel_head_size(q, k, v),
    examples=_decode_examples,
))  # fmt: skip


def batch_decode(q, k, v, left_padding, bounds, scale) -> mx.array:
    """softmax(q k^T * scale) v for one query per row, each row over its own positions
    left_padding[b] .. end - 1 of the buffers k, v (B, Hkv, capacity, D); `bounds`:
    int32 [end, capacity]. queries (B, Hq, 1, D) -> (B, Hq, 1, D) in their dtype."""
    return BATCH_DECODE(q, k, v, left_padding, bounds, scale)


# --------------------------------------------------------------------------------------
# batch_step, batch_fused_step: the compiled step's cache


def _step_kernel(q, kn, vn, k, v, rk, rv, left_padding, meta, scale):
    inputs = {"k": k, "v": v, "rk": rk, "rv": rv, "kn": kn, "vn": vn, "left_padding": left_padding.astype(mx.int32),
              "meta": meta}  # fmt: skip
    return tuple(launch(BATCH_STEP, q, rk.shape[1], inputs, scale, {"rk_out": rk, "rv_out": rv}, grouped=True))


def _write_slot(window: mx.array, x: mx.array, slot: mx.array) -> mx.array:
    return mx.slice_update(window, x.astype(window.dtype), slot.reshape(1), axes=(2,))


def _step_reference(q, kn, vn, k, v, rk, rv, left_padding, meta, scale):
    """The new token into window slot `used`; row b attends over its positions
    left_padding[b] .. base - 1 of the big buffers, then window slots 0 .. used.
    (Masks, no host reads: it also runs inside a recorded step.)"""
    base, used = meta[0], meta[1]
    rk, rv = _write_slot(rk, kn, used), _write_slot(rv, vn, used)
    col, slot = mx.arange(k.shape[2])[None], mx.arange(rk.shape[2])[None]
    valid = mx.concatenate([(col >= left_padding[:, None]) & (col < base),
                            mx.broadcast_to(slot <= used, (q.shape[0], rk.shape[2]))], axis=1)  # fmt: skip
    keys, values = mx.concatenate([k, rk], axis=2), mx.concatenate([v, rv], axis=2)
    return masked_attention(q, keys, values, valid, scale), rk, rv


def step_arguments(q_heads: int, kv_heads: int, d: int, dtype, seed: int = 0, pads=(0, 9, 3, 300)):
    """(q, kn, vn, k, v, rk, rv, left_padding, meta, scale) of one compiled step over
    rows with these paddings: 300 positions in the big buffers (capacity 512), 5 of 32
    window slots used."""
    B = len(pads)
    k, v = (_random((B, kv_heads, 512, d), seed + s, dtype) for s in (1, 2))
    rk, rv = (_random((B, kv_heads, 32, d), seed + s, dtype) for s in (3, 4))
    kn, vn = (_random((B, kv_heads, 1, d), seed + s, dtype) for s in (5, 6))
    q = _random((B, q_heads, 1, d), seed + 7, dtype)
    return q, kn, vn, k, v, rk, rv, mx.array(pads, mx.int32), mx.array([300, 5, 512, 32], mx.int32), d**-0.5


def _step_examples():
    return [(step_arguments(hq, hkv, d, dtype), {})
            for hq, hkv, d, dtype in ((14, 2, 64, mx.float32), (28, 4, 128, mx.float32), (14, 2, 64, mx.bfloat16),
                                      (8, 4, 32, mx.bfloat16))]  # fmt: skip


def _step_runs(q, kn, vn, k, v, rk, rv, *rest) -> bool:
    return kernel_takes(q, kn, vn, k, v, rk, rv)


BATCH_STEP = register(Op(
    "batch_step", "batch_step.cu", ("q", "k", "v", "rk", "rv", "kn", "vn", "left_padding", "meta", "scale"),
    ("out", "rk_out", "rv_out"),
    launch=_step_kernel, reference=_step_reference, runs=_step_runs, examples=_step_examples,
))  # fmt: skip


def _fused_kernel(roped, heads, k, v, rk, rv, left_padding, meta, scale):
    kv_heads = rk.shape[1]
    inputs = {"heads": heads, "k": k, "v": v, "rk": rk, "rv": rv, "left_padding": left_padding.astype(mx.int32),
              "meta": meta}  # fmt: skip
    return tuple(launch(BATCH_FUSED_STEP, roped, kv_heads, inputs, scale, {"rk_out": rk, "rv_out": rv},
                        q_heads=roped.shape[1] - 2 * kv_heads, flat=True, grouped=True))  # fmt: skip


def split_heads(roped: mx.array, heads: mx.array, kv_heads: int) -> tuple[mx.array, mx.array, mx.array]:
    """(q, k, v) of a fused q|k|v projection: q and k after RoPE (`roped`), v before it."""
    n_q = roped.shape[1] - 2 * kv_heads
    return roped[:, :n_q], roped[:, n_q : n_q + kv_heads], heads[:, n_q + kv_heads :]


def _fused_reference(roped, heads, k, v, rk, rv, left_padding, meta, scale):
    q, kn, vn = split_heads(roped, heads, rk.shape[1])
    out, rk, rv = _step_reference(q, kn, vn, k, v, rk, rv, left_padding, meta, scale)
    return out.reshape(out.shape[0], -1), rk, rv


def _fused_examples():
    out = []
    for (q, kn, vn, k, v, rk, rv, lp, meta, scale), _ in _step_examples():
        heads = mx.concatenate([q, kn, _random(vn.shape, 9, vn.dtype)], axis=1)
        roped = mx.concatenate([q, kn, _random(vn.shape, 10, vn.dtype)], axis=1)  # v's slot unused after RoPE
        out.append(((roped, heads, k, v, rk, rv, lp, meta, scale), {}))
    return out


BATCH_FUSED_STEP = register(Op(
    "batch_fused_step", "batch_fused_step.cu", ("q", "heads", "k", "v", "rk", "rv", "left_padding", "meta", "scale"),
    ("out", "rk_out", "rv_out"),
    launch=_fused_kernel, reference=_fused_reference,
    runs=lambda roped, heads, k, v, rk, rv, *rest: kernel_takes(roped, heads, k, v, rk, rv),
    examples=_fused_examples,
))  # fmt: skip


def batch_step(q, kn, vn, k, v, rk, rv, left_padding, meta, scale) -> tuple:
    """The compiled step's attention: each row over its positions in the big buffers
    k, v (B, Hkv, capacity, D), the recent window rk, rv (B, Hkv, W, D) and its own new
    token kn, vn (B, Hkv, 1, D), which goes into window slot `used`; meta int32 [base,
    used, capacity, W]. Returns (out (B, Hq, 1, D) in q's dtype, new rk, new rv)."""
    return BATCH_STEP(q, kn, vn, k, v, rk, rv, left_padding, meta, scale)


def batch_fused_step(roped, heads, k, v, rk, rv, left_padding, meta, scale) -> tuple:
    """`batch_step` for step/forward.py: `heads` (B, Hq + 2 Hkv, 1, D) is the fused
    q|k|v projection of the step's token, `roped` the same after RoPE; q and the new k
    are read from `roped`, the new v from `heads`. Returns (out (B, Hq * D), new rk,
    new rv)."""
    return BATCH_FUSED_STEP(roped, heads, k, v, rk, rv, left_padding, meta, scale)


# --------------------------------------------------------------------------------------
# tq_rows_step, tq_rows_fused_step: TurboQuant batch rows


TQ_ROWS_INPUTS = ("sk", "sv", "tk", "tv", "kcode", "knorm", "vcode", "vnorm", "rk", "rv")


def _tq_kernel(op: Op, q, new: dict, rows: tuple, tabs, signs, left_padding, meta, scale, template: tuple,
               flat: bool):  # fmt: skip
    rk, rv = rows[-2:]
    inputs = {**new, **dict(zip(TQ_ROWS_INPUTS, rows)), "tabs": tabs, "signs": signs,
              "left_padding": left_padding.astype(mx.int32), "meta": meta}  # fmt: skip
    q_heads = q.shape[1] - 2 * rk.shape[1] if flat else None
    return tuple(launch(op, q, rk.shape[1], inputs, scale, {"rk_out": rk, "rv_out": rv}, q_heads=q_heads, wide=False,
                        flat=flat, template=template))  # fmt: skip


def _tq_rows_kernel(q, kn, vn, rows, tabs, signs, left_padding, meta, scale, template):
    return _tq_kernel(TQ_ROWS_STEP, q, {"kn": kn, "vn": vn}, rows, tabs, signs, left_padding, meta, scale,
                      template, False)  # fmt: skip


def _tq_rows_reference(q, kn, vn, rows, tabs, signs, left_padding, meta, scale, template):
    """Each row by the reading rule (turboquant/reference.py): its position t = column
    - left_padding exact where t < S or within the window, decoded from its codes
    elsewhere; the exact vectors from the window (columns from `base` on, the new token
    in slot `used`), the sinks, or the tail (the E columns before `base`)."""
    t = dict(template)
    S, E, win, kb, vb = t["S"], t["E"], t["WIN"], t["KB"], t["VB"]
    sk, sv, tk, tv, kcode, knorm, vcode, vnorm, rk, rv = rows
    base, used, _, _ = (int(x) for x in np.array(meta))
    rk, rv = _write_slot(rk, kn, meta[1]), _write_slot(rv, vn, meta[1])
    p, d = base + used, q.shape[-1]
    rot = Rotation.from_signs(signs)
    outs = []
    for b, start in enumerate(np.array(left_padding).tolist()):
        cols = mx.arange(start, p + 1)

        def exact(window, sinks, tail):
            x = mx.zeros((window.shape[1], cols.shape[0], d), mx.float32)
            if E:
                x = mx.where((cols >= base - E)[:, None], tail[b][:, mx.clip(cols - base + E, 0, E - 1)], x)
            if S:
                x = mx.where((cols - start < S)[:, None], sinks[b][:, mx.clip(cols - start, 0, S - 1)], x)
            return mx.where((cols >= base)[:, None], window[b][:, mx.clip(cols - base, 0, window.shape[2] - 1)], x)

        def decoded(codes, norms, bits):
            c = mx.clip(cols, 0, codes.shape[2] - 1)
            x = rot.inverse(levels(codes[b][:, c], bits, d) * (norms[b][:, c].astype(mx.float32)[..., None] / math.sqrt(d)))
            return mx.where(((cols < base) & (cols - start >= S))[:, None], x, 0)

        out = reference_attention(q[b : b + 1], mx.array([p - start]), exact(rk, sk, tk)[None], exact(rv, sv, tv)[None],
                                  decoded(kcode, knorm, kb)[None], decoded(vcode, vnorm, vb)[None],
                                  sink_tokens=S, window=win, scale=scale)  # fmt: skip
        outs.append(out)
    return mx.concatenate(outs, axis=0).astype(q.dtype), rk, rv


def _tq_fused_kernel(roped, heads, rows, tabs, signs, left_padding, meta, scale, template):
    return _tq_kernel(TQ_ROWS_FUSED_STEP, roped, {"heads": heads}, rows, tabs, signs, left_padding, meta, scale,
                      template, True)  # fmt: skip


def _tq_fused_reference(roped, heads, rows, tabs, signs, left_padding, meta, scale, template):
    q, kn, vn = split_heads(roped, heads, rows[-1].shape[1])
    out, rk, rv = _tq_rows_reference(q, kn, vn, rows, tabs, signs, left_padding, meta, scale, template)
    return out.reshape(out.shape[0], -1), rk, rv


def tq_rows_arguments(q_heads: int, kv_heads: int, d: int, bits: tuple, dtype, seed: int = 0,
                      pads=(0, 9, 296)) -> tuple:  # fmt: skip
    """(q, kn, vn, rows, tabs, signs, left_padding, meta, scale, template) of one step
    of TurboQuant batch rows: 4 sinks, a window of 8 (7 tail positions), 300 columns in
    the big buffers (capacity 512), 3 of 8 window slots used."""
    kb, vb = bits
    B, S, E, W = len(pads), 4, 7, 8
    rot = rotation(d, seed)
    x = [_random((B, kv_heads, 512, d), seed + s, dtype) for s in (1, 2)]
    (kc, kq), (vc, vq) = quantize(x[0], kb, rot), quantize(x[1], vb, rot)
    sk, sv = (_random((B, kv_heads, S, d), seed + s, dtype) for s in (3, 4))
    tk, tv = (_random((B, kv_heads, E, d), seed + s, dtype) for s in (5, 6))
    rk, rv = (_random((B, kv_heads, W, d), seed + s, dtype) for s in (7, 8))
    kn, vn = (_random((B, kv_heads, 1, d), seed + s, dtype) for s in (9, 10))
    q = _random((B, q_heads, 1, d), seed + 11, dtype)
    tabs = mx.concatenate([codebook_arrays(kb)[0], codebook_arrays(vb)[0]])
    template = (("KB", kb), ("VB", vb), ("KW", packed_words(d, kb)), ("VW", packed_words(d, vb)), ("S", S),
                ("E", E), ("WIN", W))  # fmt: skip
    rows = (sk, sv, tk, tv, kc, kq, vc, vq, rk, rv)
    return q, kn, vn, rows, tabs, rot.signs, mx.array(pads, mx.int32), mx.array([300, 3, 512, W], mx.int32), \
        d**-0.5, template


def _tq_rows_examples():
    return [(tq_rows_arguments(hq, hkv, d, bits, dtype), {})
            for hq, hkv, d, bits, dtype in ((14, 2, 64, (5, 3), mx.float32), (28, 4, 128, (4, 2), mx.float32),
                                            (14, 2, 64, (5, 3), mx.bfloat16))]  # fmt: skip


def _tq_fused_examples():
    out = []
    for (q, kn, vn, rows, tabs, signs, lp, meta, scale, template), _ in _tq_rows_examples():
        heads = mx.concatenate([q, kn, vn], axis=1)
        roped = mx.concatenate([q, kn, _random(vn.shape, 12, vn.dtype)], axis=1)  # v's slot unused after RoPE
        out.append(((roped, heads, rows, tabs, signs, lp, meta, scale, template), {}))
    return out


def tq_rows_runs(template: tuple, *arrays) -> bool:
    """What the TurboQuant rows kernels take: `kernel_takes` over the exact arrays (and
    the step's new token), sinks and a tail (a window > 1)."""
    t = dict(template)
    return t["S"] > 0 and t["E"] > 0 and kernel_takes(*arrays)


def _exact(rows: tuple) -> tuple:
    sk, sv, tk, tv, _, _, _, _, rk, rv = rows
    return sk, sv, tk, tv, rk, rv


TQ_ROWS_STEP = register(Op(
    "tq_rows_step", "tq_rows_step.cu",
    ("q", "kn", "vn", *TQ_ROWS_INPUTS, "tabs", "signs", "left_padding", "meta", "scale"), ("out", "rk_out", "rv_out"),
    launch=_tq_rows_kernel, reference=_tq_rows_reference,
    runs=lambda q, kn, vn, rows, *rest: tq_rows_runs(rest[-1], q, kn, vn, *_exact(rows)),
    examples=_tq_rows_examples,
))  # fmt: skip
TQ_ROWS_FUSED_STEP = register(Op(
    "tq_rows_fused_step", "tq_rows_fused_step.cu",
    ("q", "heads", *TQ_ROWS_INPUTS, "tabs", "signs", "left_padding", "meta", "scale"), ("out", "rk_out", "rv_out"),
    launch=_tq_fused_kernel, reference=_tq_fused_reference,
    runs=lambda roped, heads, rows, *rest: tq_rows_runs(rest[-1], roped, heads, *_exact(rows)),
    examples=_tq_fused_examples,
))  # fmt: skip


def tq_rows_step(q, kn, vn, rows, tabs, signs, left_padding, meta, scale, template) -> tuple:
    """TurboQuant batch rows' step attention (the reading rule over each row's sinks,
    tail, window and codes; the new token into window slot `used`): rows = (sk, sv, tk,
    tv, kcode, knorm, vcode, vnorm, rk, rv); tabs the key then value codebook levels;
    signs the rotation's; template the layout's constants (KB, VB, KW, VW, S, E, WIN).
    Returns (out (B, Hq, 1, D), new rk, new rv)."""
    return TQ_ROWS_STEP(q, kn, vn, rows, tabs, signs, left_padding, meta, scale, template)


def tq_rows_fused_step(roped, heads, rows, tabs, signs, left_padding, meta, scale, template) -> tuple:
    """`tq_rows_step` fed the fused q|k|v projection (as `batch_fused_step`): out
    (B, Hq * D)."""
    return TQ_ROWS_FUSED_STEP(roped, heads, rows, tabs, signs, left_padding, meta, scale, template)
