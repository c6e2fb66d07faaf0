"""Where a batched decode step's time goes, on a model of a real shape.

    python bench/batch_step.py --shape qwen2.5-0.5b --rows 1,8,32 --context 512 --out r.json

Per batch size, pipelined steps (the next queued before the current is read),
steady state, ms per step:
- `plain_cache`: mlx-lm's KVCache with B rows of equal length (no mask);
- `batch_cache`: BatchKVCache with rows left-padded to different lengths (the
  mask batchgen's scheduler and mlx-lm's batch_generate decode with);
- `batch_kernel`: the same through batchgen's `batch_decode_attention` (the
  hook installed, the cache marked);
- `kernel_int_offset`: as `batch_kernel`, with one offset for all rows (an int,
  as a plain cache has; timing only: padded rows get wrong positions), to
  see what per-row RoPE offsets cost;
- `graph_build`: building one step's graph in Python, not evaluated;
- `compiled`: the batch step as batchgen's scheduler runs it: one compiled
  function over fixed-capacity buffers (`batchgen.compiled_step`, the kernel
  hook installed, through `batchgen.step_forward` where it covers the model:
  with `fused`);
- `*_cap{N}`: the same over buffers of N positions (same rows and context):
  time that grows with N is time spent copying whole buffers;
- `fused`: the batch step with fused QKV / gate-up weights (batchgen's default).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from batchgen.kernels.attention import install_short_attention, mark_cache, uninstall_short_attention
from batchgen.bench import random_model
from batchgen.step.compiled import CompiledSteps
from batchgen.kernels.turboquant import available as cuda_available
from batchgen.transforms.fusion import fuse_model


def step_model(shape: str):
    """(model, config): random bf16 weights of a real shape, projections fused and
    the attention hook installed, as the scheduler steps a batch."""
    model, config = random_model(shape, "bfloat16", None, 0)
    fuse_model(model)
    install_short_attention(model)
    return model, config


def _filled(model, rows: int, context: int, batch: bool, marked: bool = False, int_offset: bool = False) -> list:
    """Caches with `rows` rows; batch: rows of lengths context/2 .. context, left-padded."""
    layers = len(model.layers)
    if batch:
        pads = [(context // 2) * i // max(rows - 1, 1) for i in range(rows)]
        cache = [BatchKVCache(pads) for _ in range(layers)]
    else:
        cache = [KVCache() for _ in range(layers)]
    if marked:
        mark_cache(cache)
    tokens = mx.random.randint(0, 1000, (rows, context))
    model(tokens, cache=cache)
    mx.eval([c.state for c in cache])
    if int_offset:
        for c in cache:
            c.offset = c._idx
    return cache


def _steps(model, cache, rows: int, n: int) -> float:
    """ms per step of the model stepping `cache` uncompiled."""
    return _timed(lambda y: mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1).astype(mx.uint32), rows, n)


def _compiled_steps(model, cache, rows: int, n: int, capacity: int = 0, own_forward: bool = True) -> float:
    """ms per step through the compiled step as the scheduler runs it (big
    buffers, the recent window flushed when full), the big buffers of at
    least `capacity` positions; `own_forward`: through `step_forward` where
    it covers the model (the scheduler's default), else the model's layers."""
    stepper = CompiledSteps(model, cuda_available(), {}, own_forward)
    stepper.min_capacity = capacity
    cache = [copy.copy(c) for c in cache]  # the caller's cache keeps its write position
    return _timed(lambda y: stepper(cache, y, sample=False)[0].astype(mx.uint32), rows, n)


def _timed(step, rows: int, n: int) -> float:
    """ms per step over n pipelined steps (the next queued before the current is read)."""
    y = mx.zeros((rows,), mx.uint32)
    for _ in range(3):  # warm-up (and recording, where compiled)
        y = step(y)
    mx.eval(y)
    start = time.perf_counter()
    cur = step(y)
    mx.async_eval(cur)
    for _ in range(n):
        nxt = step(cur)
        mx.async_eval(nxt)
        cur.tolist()
        cur = nxt
    cur.tolist()
    return (time.perf_counter() - start) * 1e3 / (n + 1)


def _widen(cache, capacity: int) -> None:
    """Give BatchKVCache buffers spare room up to `capacity` (steps then write
    into it; whether they copy the whole buffer shows in their time)."""
    for c in cache:
        extra = capacity - c.keys.shape[2]
        if extra > 0:
            pad = [(0, 0), (0, 0), (0, extra), (0, 0)]
            c.keys, c.values = mx.pad(c.keys, pad), mx.pad(c.values, pad)
    mx.eval([c.state for c in cache])


def _build_ms(model, cache, rows: int, n: int = 10) -> float:
    y = mx.zeros((rows, 1), mx.uint32)
    total = 0.0
    for _ in range(n):
        start = time.perf_counter()
        out = model(y, cache=cache)
        total += time.perf_counter() - start
        mx.eval(out)
    return total * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--fused-only", action="store_true")
    ap.add_argument("--capacities", type=lambda t: [int(c) for c in t.split(",")], default=[],
                    help="also time the compiled step over buffers of these capacities (same rows, same context)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model, _ = random_model(a.shape, "bfloat16", None, 0)
    results = []
    for fused in (True,) if a.fused_only else (False, True):
        if fused:
            fuse_model(model)
        for rows in [int(r) for r in a.rows.split(",")]:
            row = {"shape": a.shape, "rows": rows, "context": a.context, "fused": fused}
            for name, batch, marked, int_offset in (
                ("plain_cache", False, False, False), ("batch_cache", True, False, False),
                ("batch_kernel", True, True, False), ("kernel_int_offset", True, True, True),
            ):  # fmt: skip
                if marked:
                    install_short_attention(model)
                cache = _filled(model, rows, a.context, batch, marked, int_offset)
                row[f"{name}_ms"] = round(_steps(model, cache, rows, a.steps), 3)
                if batch and not marked:
                    row["graph_build_ms"] = round(_build_ms(model, cache, rows), 3)
                if marked and not int_offset:
                    row["compiled_ms"] = round(_compiled_steps(model, cache, rows, a.steps), 3)
                    for cap in a.capacities:
                        row[f"compiled_cap{cap}_ms"] = round(_compiled_steps(model, cache, rows, a.steps, cap), 3)
                        _widen(cache, cap)
                        row[f"batch_kernel_cap{cap}_ms"] = round(_steps(model, cache, rows, a.steps), 3)
                uninstall_short_attention(model)
                del cache
                mx.clear_cache()
            row["tok_s_batch_cache"] = round(rows * 1e3 / row["batch_cache_ms"], 1)
            row["tok_s_batch_kernel"] = round(rows * 1e3 / row["batch_kernel_ms"], 1)
            row["tok_s_compiled"] = round(rows * 1e3 / row["compiled_ms"], 1)
            print(json.dumps(row), flush=True)
            results.append(row)
    if a.out:
        a.out.write_text(json.dumps({"device": str(mx.default_device()), "rows": results}, indent=1))


if __name__ == "__main__":
    main()
