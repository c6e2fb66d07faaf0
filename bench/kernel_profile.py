"""GPU time of each kernel of one decode step, read by Nsight Compute.

    ncu --profile-from-start off --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --csv --page raw --print-units base \
        --log-file step.csv python bench/kernel_profile.py step --shape qwen2.5-7b --rows 8
    python bench/kernel_profile.py summary step.csv

`step`: the batched compiled step as the scheduler runs it (fused weights, kernel
hook, `step_forward`), rows of context/2 .. context tokens. `tq`: one job's
TurboQuant step-mode attention over every layer (update_and_fetch + attention),
then mx.fast attention over an fp16 cache of the same context for every layer.
`tqbatch`: the compiled step over TurboQuant rows of `context` tokens.

Only the profiled range (one step, or `--steps`, between cuProfilerStart and
cuProfilerStop) is measured; before it, the same step's wall time is taken (ms a step,
no profiler range open) and printed. `summary` sums the CSV's kernel times by family
(the kernel name up to its first '<' or '('), largest first, in us, leaving out the
range's first kernel: under ncu it reads hundreds of us however small it is.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _profiled(fn) -> None:
    """fn() inside one profiler range (the driver API: MLX holds the primary context)."""
    import mlx.core as mx

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no CUDA driver (a CPU run of this script): run fn unprofiled
        fn()
        return
    mx.synchronize()
    cuda.cuProfilerStart()
    mx.eval(mx.zeros((8,), mx.int32) + 1)  # the range's first kernel reads long (profiler start): a marker takes it
    fn()
    mx.synchronize()
    cuda.cuProfilerStop()


def batch_step(shape: str, rows: int, context: int, steps: int) -> None:
    import mlx.core as mx
    from batch_step import _compiled_steps, _filled, step_model

    from batchgen.step.compiled import CompiledSteps
    from batchgen.kernels.turboquant import available

    model, _ = step_model(shape)
    cache = _filled(model, rows, context, True, True)
    print(f"{shape} rows={rows} context={context} wall_ms_per_step={_compiled_steps(model, cache, rows, 32):.3f}")
    stepper = CompiledSteps(model, available(), {}, True)
    y = mx.zeros((rows,), mx.uint32)
    for _ in range(3):
        y = stepper(cache, y, sample=False)[0].astype(mx.uint32)
        mx.eval(y)
    _profiled(lambda: [mx.eval(stepper(cache, y, sample=False)[0]) for _ in range(steps)])


def tq_step(shape: str, context: int) -> None:
    import mlx.core as mx
    from turboquant_attention import SHAPES, filled_turboquant, step_s

    layers, heads, kv_heads, dim = SHAPES[shape]
    caches = filled_turboquant(layers, context, kv_heads, dim, mx.bfloat16)
    print(f"{shape} context={context} tq_ms_per_step={step_s(caches, 'tq', heads, kv_heads, dim, 20, mx.bfloat16) * 1e3:.3f}")
    q = mx.random.normal((1, heads, 1, dim)).astype(mx.bfloat16)
    k = mx.random.normal((1, kv_heads, 1, dim)).astype(mx.bfloat16)
    ks = [mx.random.normal((1, kv_heads, context, dim)).astype(mx.bfloat16) for _ in range(2)]
    mx.eval(q, k, ks)

    def both():
        for c in caches:
            c.update_and_fetch(k, k)
        mx.eval([c.attention(q, dim**-0.5) for c in caches])
        mx.eval([mx.fast.scaled_dot_product_attention(q, ks[0], ks[1], scale=dim**-0.5) for _ in range(layers)])

    _profiled(both)


def tq_batch(shape: str, rows: int, context: int) -> None:
    import mlx.core as mx
    from batch_step import _timed, step_model
    from turboquant_batch_probe import CompiledStepsOnce, turboquant_rows

    model, _ = step_model(shape)
    cache = turboquant_rows(model, rows, context, 4)
    wall = _timed(lambda y: CompiledStepsOnce.step(model, cache, y), rows, 32)
    print(f"{shape} turboquant rows={rows} context={context} wall_ms_per_step={wall:.3f}")
    y = mx.zeros((rows,), mx.uint32)
    _profiled(lambda: mx.eval(CompiledStepsOnce.step(model, cache, y)))


def family(name: str) -> str:
    cut = min((i for i in (name.find("<"), name.find("(")) if i > 0), default=len(name))
    return name[:cut].strip()


def summary(path: Path) -> None:
    """Kernel time by family from an ncu --csv --page raw --print-units base log."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    reader = csv.DictReader(lines[start:])
    units = next(reader)  # the units row
    key = "gpu__time_duration.sum"
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[units[key]]
    totals, counts = defaultdict(float), defaultdict(int)
    duration_us = lambda row: float(row[key].replace(",", "")) * scale  # noqa: E731
    first = next(reader)  # the marker `_profiled` launches first: its time is the profiler's start
    print(f"(first kernel of the range, left out: {family(first['Kernel Name'])[:60]}, {duration_us(first):.1f} us)")
    for row in reader:
        fam = family(row["Kernel Name"])
        totals[fam] += duration_us(row)
        counts[fam] += 1
    whole = sum(totals.values())
    print(f"{path.name}: {sum(counts.values())} kernels, {whole:.1f} us")
    for fam, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {us:9.1f} us {100 * us / whole:5.1f}% {counts[fam]:5d}x  {fam[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["step", "tq", "tqbatch", "summary"])
    ap.add_argument("path", nargs="?", type=Path, help="summary: the ncu CSV log")
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=1, help="step: steps in the profiled range")
    a = ap.parse_args()
    if a.mode == "summary":
        summary(a.path)
    elif a.mode == "step":
        batch_step(a.shape, a.rows, a.context, a.steps)
    elif a.mode == "tq":
        tq_step(a.shape, a.context)
    else:
        tq_batch(a.shape, a.rows, a.context)


if __name__ == "__main__":
    main()
