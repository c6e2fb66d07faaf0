"""Narrow down a TurboQuant step-mode pass that goes wrong after blocked prompt chunks.

On the H200 (2026-12-05, bench/RESULTS.md "TurboQuant step kernel"), the schedule of
`tests/test_turboquant_step.py::test_flash_on_cuda_matches_the_blocked_path` -- prompt
chunks of 1,500 and 700 tokens, one step, a 6-token pass, a trim of 3, 300 tokens -- gave
values of 2.6e38 in the 6-token pass with `fused_prefill=False` (14 query heads, 2 kv heads,
head dim 64, bf16). This drives that schedule through `TurboQuantStepKVCache` for each
variant asked for and prints one JSON line a variant: each pass's largest |output| and its
largest difference from the same schedule through the base type's ops path
(`TurboQuantKVCache`, no step kernel). Kept kernel builds are a process-wide choice: run it
once with BATCHGEN_KERNEL_BUILDS=0 and once with 1 (`bash bench/h200.sh tqflash`). Without
CUDA there is no step kernel and every pass takes the ops path (the CPU checks step mode
with the reference standing in: tests/test_turboquant_step.py).

    python bench/turboquant_flash_probe.py --fused none,false --dtypes bfloat16,float32 \\
        --heads 14x2,4x2 --reserves 0,12 [--one-block]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

from batchgen.cache import turboquant as tq
from batchgen.cache.turboquant_step import TurboQuantStepKVCache
from batchgen.kernels import registry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_turboquant import kv  # noqa: E402  the test's random keys and values
from test_turboquant_step import drive  # noqa: E402  the test's schedule driver

SCHEDULE = [1500, 700, 1, 6, ("trim", 3), 300]


def probe(fused, dtype, heads: tuple, reserve: int, dim: int) -> dict:
    n_heads, kv_heads = heads
    total = sum(x for x in SCHEDULE if isinstance(x, int))
    k, v = kv(total, 41, heads=kv_heads, dim=dim, dtype=dtype)
    q = mx.random.normal((1, n_heads, total, dim), key=mx.random.key(42)).astype(dtype)
    got, want = (
        [x.astype(mx.float32) for x in drive(cache, SCHEDULE, k, v, q)]
        for cache in (TurboQuantStepKVCache(4, fused_prefill=fused, routed=True, trim_reserve=reserve),
                      tq.TurboQuantKVCache(4, fused_prefill=False, routed=True, trim_reserve=reserve))
    )  # fmt: skip
    return {
        "fused": fused, "dtype": str(dtype).split(".")[-1], "heads": list(heads), "reserve": reserve, "dim": dim,
        "builds_kept": registry.kept_dir() is not None,
        "largest": [round(mx.abs(x).max().item(), 4) for x in got],
        "err_vs_ops": [round(mx.abs(x - y).max().item(), 5) for x, y in zip(got, want)],
        "ops_largest": [round(mx.abs(y).max().item(), 4) for y in want],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fused", default="none,false", help="fused_prefill values: none, false, true")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--heads", default="14x2,4x2", help="QUERYxKV head counts")
    ap.add_argument("--reserves", default="0,12", help="trim reserves (a cache's default 0; the engine's on a GPU 12)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--one-block", action="store_true", help="prompt chunks' queries in one block (no eager eval per block)")
    a = ap.parse_args()
    registry.keep_builds()  # as a run does: MLX's build folder set, batchgen's builds kept unless =0
    if a.one_block:
        tq.query_block = lambda *_: 1 << 20
    fused = {"none": None, "false": False, "true": True}
    for f in a.fused.split(","):
        for d in a.dtypes.split(","):
            for h in a.heads.split(","):
                for r in a.reserves.split(","):
                    row = probe(fused[f], getattr(mx, d), tuple(int(x) for x in h.split("x")), int(r), a.dim)
                    row["one_block"] = a.one_block
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
