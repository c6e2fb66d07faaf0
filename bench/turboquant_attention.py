"""One decode step's attention over every layer: fp16 KVCache + mx.fast sdpa against
TurboQuant's plain-ops path, its fused score/value kernels, and its step mode (one
kernel a step and layer; random data, real head shapes).

    python bench/turboquant_attention.py --shapes 0.5b,7b --contexts 1024,8192,32768 --out r.json

Each step appends one token to every layer's cache and attends with one query; the
time is the median over `--steps` steps after a warm-up, synced per step.
`--step-blocks 512,2048`: the step mode again with `turboquant_kernels.STEP_BLOCKS`
(the blocks a step kernel aims at) set to each value (`tq_step_<N>_ms`).
`--step-baseline FILE`: the step mode again with `tq_step` built from another
`turboquant_kernels.py` (an older commit's, same inputs and outputs; its block size, the
shipped chunks), `tq_step_baseline_ms`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from batchgen.cache import turboquant as tq
from batchgen.kernels import turboquant as turboquant_kernels

sys.path.insert(0, str(Path(__file__).parent))
from projection_probe import patched  # noqa: E402

SHAPES = {  # layers, query heads, kv heads, head dim (Qwen2.5)
    "0.5b": (24, 14, 2, 64),
    "1.5b": (28, 12, 2, 128),
    "7b": (28, 28, 4, 128),
}


def fill(cache, n: int, kv_heads: int, dim: int, dtype) -> None:
    for lo in range(0, n, 2048):
        m = min(2048, n - lo)
        k = mx.random.normal((1, kv_heads, m, dim)).astype(dtype)
        cache.update_and_fetch(k, k * 0.5)
        mx.eval(cache.state if isinstance(cache, KVCache) else (cache.key_codes, cache.value_codes))
        if not isinstance(cache, KVCache):
            cache._chunk = None  # no attention reads the fill (it would mark the cache unrouted)


def filled_turboquant(layers: int, n: int, kv_heads: int, dim: int, dtype) -> list:
    """One 4-bit TurboQuant cache a layer, each holding n random positions, routed
    (step mode where the device has it)."""
    caches = [tq.TurboQuantKVCache(4, seed=i) for i in range(layers)]
    for c in caches:
        c.routed = True
        fill(c, n, kv_heads, dim, dtype)
    return caches


def step_s(caches, kind: str, heads: int, kv_heads: int, dim: int, steps: int, dtype) -> float:
    scale = dim**-0.5
    times = []
    for i in range(steps + 3):
        q = mx.random.normal((1, heads, 1, dim)).astype(dtype)
        k = mx.random.normal((1, kv_heads, 1, dim)).astype(dtype)
        mx.eval(q, k)
        start = time.perf_counter()
        outs = []
        for c in caches:
            keys, values = c.update_and_fetch(k, k)
            if kind == "fp16":
                outs.append(mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale))
            else:
                outs.append(c.attention(q, scale))
        mx.eval(outs)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_arguments(run) -> tuple:
    """The arguments of the first `turboquant_kernels.step` call that `run()` makes."""
    captured, real = [], turboquant_kernels.step
    with patched(turboquant_kernels, step=lambda *a: captured.append(a) or real(*a)):
        run()
    return captured[0]


def baseline_module(path: str, tag: str = "baseline"):
    """Another commit's turboquant_kernels.py (at `path`) as a module whose step-mode
    kernels compile under their own names (`tq_step_<tag>`, ...: MLX keeps a compiled
    kernel by name), so that several versions run in one process."""
    spec = importlib.util.spec_from_file_location(f"turboquant_kernels_{tag}", path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    made = {}

    def kernel(name: str, body=None):
        if name not in made:
            inputs, outputs, source = old.STEP_KERNELS[name]
            made[name] = mx.fast.cuda_kernel(name=f"{name}_{tag}", input_names=inputs, output_names=outputs,
                                             source=source, header=old._STEP_HEADER,
                                             ensure_row_contiguous=name != "tq_step")  # fmt: skip
        return made[name]

    old._step_kernel = kernel
    return old


def baseline_kernels(path: str) -> dict:
    """What to patch into `turboquant_kernels` to run a decode step's attention through
    the file at `path`'s `step` (its own kernels and launches)."""
    return {"step": baseline_module(path).step}


PATHS = {"ops": (False, False), "fused": (True, False), "step": (True, True)}  # (FUSED_KERNELS, STEP_KERNEL)


def measure(shape: str, n: int, steps: int, dtype, step_blocks: tuple = (), paths: tuple = tuple(PATHS),
            baseline=None) -> dict:  # fmt: skip
    layers, heads, kv_heads, dim = SHAPES[shape]
    row = {"shape": shape, "context": n}
    fp16 = [KVCache() for _ in range(layers)]
    for c in fp16:
        fill(c, n, kv_heads, dim, dtype)
    row["fp16_ms"] = step_s(fp16, "fp16", heads, kv_heads, dim, steps, dtype) * 1e3
    del fp16
    caches = filled_turboquant(layers, n, kv_heads, dim, dtype)
    for name in paths:
        fused, stepped = PATHS[name]
        with patched(tq, FUSED_KERNELS=fused, STEP_KERNEL=stepped):
            row[f"tq_{name}_ms"] = step_s(caches, "tq", heads, kv_heads, dim, steps, dtype) * 1e3
        row[f"{name}_over_fp16"] = row["fp16_ms"] / row[f"tq_{name}_ms"]  # speed ratio (>1: faster)
    for blocks in step_blocks:
        with patched(turboquant_kernels, STEP_BLOCKS=blocks):
            row[f"tq_step_{blocks}_ms"] = step_s(caches, "tq", heads, kv_heads, dim, steps, dtype) * 1e3
    if baseline is not None:
        with patched(turboquant_kernels, **baseline):
            row["tq_step_baseline_ms"] = step_s(caches, "tq", heads, kv_heads, dim, steps, dtype) * 1e3
    row["step_kv_bytes"] = sum(c.nbytes for c in caches)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0.5b,7b")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--paths", default=",".join(PATHS), help="TurboQuant paths to time: ops, fused, step")
    ap.add_argument("--step-blocks", default="", help="comma-separated STEP_BLOCKS values to time the step mode at")
    ap.add_argument("--step-baseline", help="a turboquant_kernels.py whose tq_step to time as well")
    ap.add_argument("--out")
    a = ap.parse_args()
    step_blocks = tuple(int(x) for x in a.step_blocks.split(",") if x)
    baseline = baseline_kernels(a.step_baseline) if a.step_baseline else None
    rows = []
    for shape in a.shapes.split(","):
        for n in (int(x) for x in a.contexts.split(",")):
            row = measure(shape, n, a.steps, mx.bfloat16, step_blocks, tuple(a.paths.split(",")), baseline)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": str(mx.default_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
