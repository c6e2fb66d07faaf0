"""Several versions of the one-job step (`turboquant_kernels.step`) on the same cache
state, in one process, in turn.

    python bench/turboquant_step_variants.py 7b 32768 FILE [FILE ...] [--pick DEST]

Each FILE is a turboquant_kernels.py (its `step`: kernels and launches, compiled under
its own names). A step each layer is captured from a filled cache (random data of the
shape), then each version runs it as many times as the shape has layers, the versions
in turn, `ROUNDS` rounds. The captured chunking is the installed turboquant_kernels'
`step_chunks`: a version with another rule gets this one's. Prints a JSON line: each
version's ms (median over rounds) and its largest difference from the first version's
output. `--pick DEST`: copy the fastest
version whose output is within 1e-2 of the first's to DEST. CUDA only.
"""

import argparse
import json
import shutil
import statistics
import sys
import time

import mlx.core as mx

from batchgen.kernels import turboquant as kernels

sys.path.insert(0, "bench")
from turboquant_attention import SHAPES, baseline_module, filled_turboquant, step_arguments  # noqa: E402

ROUNDS = 7


def captured_step(shape: str, n: int) -> tuple:
    """One layer's arguments to `step` from a cache of n random positions in step mode."""
    layers, heads, kv_heads, dim = SHAPES[shape]
    cache = filled_turboquant(1, n, kv_heads, dim, mx.bfloat16)[0]
    q = mx.random.normal((1, heads, 1, dim)).astype(mx.bfloat16)
    k = mx.random.normal((1, kv_heads, 1, dim)).astype(mx.bfloat16)
    cache.update_and_fetch(k, k)
    return layers, step_arguments(lambda: mx.eval(cache.attention(q, dim**-0.5)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape")
    ap.add_argument("context", type=int)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--pick")
    a = ap.parse_args()
    if not kernels.available():
        sys.exit("needs MLX with a CUDA GPU")
    layers, args = captured_step(a.shape, a.context)
    versions = [baseline_module(f, f"v{i}") for i, f in enumerate(a.files)]
    outs = [v.step(*args)[0].astype(mx.float32) for v in versions]
    mx.eval(outs)
    diff = [mx.abs(o - outs[0]).max().item() for o in outs]
    times = [[] for _ in versions]
    for _ in range(ROUNDS):
        for v, t in zip(versions, times):
            mx.synchronize()
            start = time.perf_counter()
            mx.eval([v.step(*args)[0] for _ in range(layers)])
            mx.synchronize()
            t.append((time.perf_counter() - start) * 1e3)
    ms = [statistics.median(t) for t in times]
    print(json.dumps({"shape": a.shape, "context": a.context, "files": a.files, "ms": ms, "ms_rounds": times,
                      "max_diff": diff}), flush=True)  # fmt: skip
    if a.pick:
        best = min((m, f) for m, f, d in zip(ms, a.files, diff) if d <= 1e-2)[1]
        shutil.copy(best, a.pick)
        print("picked", best, flush=True)


if __name__ == "__main__":
    main()
