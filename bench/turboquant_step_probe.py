"""Where one TurboQuant step-mode decode step spends its time, all layers of a shape.

    python bench/turboquant_step_probe.py 0.5b,7b 1024,8192,32768

Per row (ms, median; each figure includes its mx.eval): `full` = every layer's
update_and_fetch + attention; `kernels` = the step and merge kernels alone, as many
launches as layers, over one layer's captured arguments (no cache bookkeeping);
`20_launches` = 20 launches of one layer's kernels. CUDA only (step mode).
"""

import json
import statistics
import sys
import time

import mlx.core as mx

from batchgen import turboquant as tq
from batchgen import turboquant_kernels as kernels

sys.path.insert(0, "bench")
from turboquant_attention import SHAPES, fill  # noqa: E402


def timed_ms(fn, n: int = 30) -> float:
    times = []
    for i in range(n + 3):
        mx.synchronize()
        start = time.perf_counter()
        fn()
        mx.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def probe(shape: str, n: int) -> dict:
    layers, heads, kv_heads, dim = SHAPES[shape]
    caches = [tq.TurboQuantKVCache(4, seed=i) for i in range(layers)]
    for c in caches:
        c.routed = True
        fill(c, n, kv_heads, dim, mx.bfloat16)
    q = mx.random.normal((1, heads, 1, dim)).astype(mx.bfloat16)
    k = mx.random.normal((1, kv_heads, 1, dim)).astype(mx.bfloat16)
    mx.eval(q, k)

    def full():
        outs = []
        for c in caches:
            c.update_and_fetch(k, k)
            outs.append(c.attention(q, dim**-0.5))
        mx.eval(outs)

    row = {"shape": shape, "context": n, "full_ms": timed_ms(full)}
    captured, real = [], kernels.step
    kernels.step = lambda *a: captured.append(a) or real(*a)
    try:
        full()
    finally:
        kernels.step = real
    args = captured[0]
    row["kernels_ms"] = timed_ms(lambda: mx.eval([real(*args)[0] for _ in range(layers)]))
    row["20_launches_ms"] = timed_ms(lambda: mx.eval([real(*args)[0] for _ in range(20)]), 10)
    row["chunks"] = args[7]
    return row


def main() -> None:
    for shape in sys.argv[1].split(","):
        for n in (int(x) for x in sys.argv[2].split(",")):
            print(json.dumps(probe(shape, n)), flush=True)


if __name__ == "__main__":
    main()
