"""GPU time of each kernel of one decode step, read by Nsight Compute.

    ncu --profile-from-start off --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --csv --page raw --print-units base \
        --log-file step.csv python bench/kernel_profile.py step --shape qwen2.5-7b --rows 8
    python bench/kernel_profile.py summary step.csv

`step`: the batched compiled step as the scheduler runs it (fused weights, the
attention hook, `step.forward`), rows of context/2 .. context tokens. `tq`: one job's
TurboQuant step-mode attention over every layer (update_and_fetch + attention),
then mx.fast attention over an fp16 cache of the same context for every layer.
`tqbatch`: the compiled step over TurboQuant rows of `context` tokens. `sweep` (no
profiler): the step's wall and queueing time for each of several rows, contexts, warps a
block of the attention kernels, and host work between steps (`_ms_a_step`), one model build:

    python bench/kernel_profile.py sweep --shape qwen2.5-7b --rows 256 --context 400 --warps 16,4 --host-ms 0,8

Only the profiled range (one step, or `--steps`, between cuProfilerStart and
cuProfilerStop) is measured; before it, the same step's wall time is taken (ms a step,
pipelined, no profiler range open) and printed, with the host's share queueing it.
`summary` sums the CSV's kernel times by family (the kernel name up to its first '<' or
'('), largest first, in us, leaving out the range's first kernel: under ncu it reads
hundreds of us however small it is.
ncu runs kernels one at a time with the host's work between them, so a short kernel
may read longer than it takes in a pipelined step. Without a CUDA driver the modes
run unprofiled (a check that the script still runs).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the batchgen of the tree this script is in

# Attention shapes (Qwen2.5): layers, query heads, kv heads, head dim.
ATTENTION_SHAPES = {"0.5b": (24, 14, 2, 64), "1.5b": (28, 12, 2, 128), "7b": (28, 28, 4, 128)}


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


def _step_model(shape: str):
    """Random bf16 weights of a real shape, fused, its attention routed to the caches:
    as the scheduler steps a batch."""
    from batchgen.bench import random_model
    from batchgen.transforms.attention import route_attention
    from batchgen.transforms.fusion import fuse_model

    model, _ = random_model(shape, "bfloat16", None, 0)
    fuse_model(model)
    route_attention(model)
    return model


def _stepper(model, kernel: bool = True):
    """A compiled step of `model` (its CUDA kernels where there are), a function of
    (cache, tokens) -> next tokens."""
    from batchgen.kernels.registry import available
    from batchgen.step.compiled import CompiledSteps

    import mlx.core as mx

    steps = CompiledSteps(model, kernel and available(), {}, True)
    return lambda cache, y: steps(cache, y, sample=False)[0].astype(mx.uint32)


def _ms_a_step(step, rows: int, n: int = 32, host_ms: float = 0.0) -> str:
    """ms a step over n pipelined steps (the next queued before the current is read),
    and of that the host's time queueing each step (its graph recorded and launched):
    where queueing is most of the step, the step is bound by the host. `host_ms`: host
    work (a sleep) after each step's tokens are read, before the next step is queued, as
    a grammar's masks are made: the GPU stays busy through it only as far as MLX let the
    host queue the step ahead (it holds at most 10 of its graph commits in flight)."""
    import mlx.core as mx

    y = mx.zeros((rows,), mx.uint32)
    for _ in range(3):  # warm-up (and recording)
        y = step(y)
    mx.eval(y)
    queue = 0.0
    start = time.perf_counter()
    cur = step(y)
    mx.async_eval(cur)
    for _ in range(n):
        t0 = time.perf_counter()
        nxt = step(cur)
        mx.async_eval(nxt)
        queue += time.perf_counter() - t0
        cur.tolist()
        if host_ms:
            time.sleep(host_ms / 1e3)
        cur = nxt
    cur.tolist()
    return f"wall_ms_per_step={(time.perf_counter() - start) * 1e3 / (n + 1):.3f} queue_ms_per_step={queue * 1e3 / n:.3f}"


def _filled_cache(model, rows: int, context: int) -> list:
    """fp16 batch layers of `rows` rows of context/2 .. context tokens, filled by prompt passes."""
    import mlx.core as mx
    from batchgen.cache.fp16 import Fp16BatchCache

    pads = [(context // 2) * i // max(rows - 1, 1) for i in range(rows)]
    cache = [Fp16BatchCache(pads, kernels=True) for _ in model.layers]
    chunk = max(16, 16384 // rows)  # a 7B shape's 256 rows x 256 positions at once held GBs of activations (OOM at 1,024 on an H100)
    for lo in range(0, context, chunk):
        model(mx.random.randint(0, 1000, (rows, min(chunk, context - lo))), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def sweep(shape: str, rows: list[int], contexts: list[int], warps: list[int], host_ms: list[float],
          steps: int = 32, groups: tuple = (None,), unrolls: tuple = (None,)) -> list[str]:  # fmt: skip
    """`_ms_a_step` for each (rows, context, attention WARPS, GROUPED, UNROLL, host_ms),
    one model build (a 7B shape's weights take a while): a line each, printed and
    returned. A warps count sets every kernel's (WARPS, WIDE_WARPS, GROUP_WARPS); None
    in `groups` / `unrolls` leaves attention.py's setting."""
    import copy

    from batchgen.kernels import attention

    names = ("WARPS", "WIDE_WARPS", "GROUP_WARPS", "GROUPED", "UNROLL")
    model, lines, before = _step_model(shape), [], {n: getattr(attention, n) for n in names}
    try:
        for r in rows:
            for context in contexts:
                cache = _filled_cache(model, r, context)
                for w in warps:
                    for g in groups:
                        for u in unrolls:
                            # read when a step is recorded: a new stepper records anew
                            attention.WARPS = attention.WIDE_WARPS = attention.GROUP_WARPS = w
                            attention.GROUPED = before["GROUPED"] if g is None else bool(g)
                            attention.UNROLL = before["UNROLL"] if u is None else u
                            step = _stepper(model)
                            for h in host_ms:
                                timed = [copy.copy(c) for c in cache]
                                _ms_a_step(lambda y: step(timed, y), r, steps, h)  # the first round builds and warms
                                line = (f"{shape} rows={r} context={context} warps={w} "
                                        f"grouped={int(attention.GROUPED)} unroll={attention.UNROLL} host_ms={h:g} "
                                        + _ms_a_step(lambda y: step(timed, y), r, steps, h))  # fmt: skip
                                print(line, flush=True)
                                lines.append(line)
    finally:
        for n, v in before.items():
            setattr(attention, n, v)
    return lines


def batch_step(shape: str, rows: int, context: int, steps: int) -> None:
    import copy

    import mlx.core as mx

    model = _step_model(shape)
    cache = _filled_cache(model, rows, context)
    timed, step = [copy.copy(c) for c in cache], _stepper(model)  # the timing leaves `cache` where it was
    print(f"{shape} rows={rows} context={context} {_ms_a_step(lambda y: step(timed, y), rows)}")
    step = _stepper(model)  # a stepper keeps its cache's recent window: one a cache
    y = mx.zeros((rows,), mx.uint32)
    for _ in range(3):
        y = step(cache, y)
        mx.eval(y)
    _profiled(lambda: [mx.eval(step(cache, y)) for _ in range(steps)])


def tq_step(shape: str, context: int) -> None:
    import mlx.core as mx

    from batchgen.cache.turboquant_step import TurboQuantStepKVCache

    layers, heads, kv_heads, dim = ATTENTION_SHAPES[shape.removeprefix("qwen2.5-")]
    caches = [TurboQuantStepKVCache(4, seed=i, routed=True) for i in range(layers)]
    for c in caches:  # `context` random positions (step mode where the device has it)
        for lo in range(0, context, 2048):
            k = mx.random.normal((1, kv_heads, min(2048, context - lo), dim)).astype(mx.bfloat16)
            c.update_and_fetch(k, k * 0.5)
            mx.eval(c.key_codes, c.value_codes)
            c._chunk = None  # no attention reads the fill (it would mark the cache unrouted)
    q = mx.random.normal((1, heads, 1, dim)).astype(mx.bfloat16)
    k = mx.random.normal((1, kv_heads, 1, dim)).astype(mx.bfloat16)
    ks = [mx.random.normal((1, kv_heads, context, dim)).astype(mx.bfloat16) for _ in range(2)]
    mx.eval(q, k, ks)

    def tq_only():
        for c in caches:
            c.update_and_fetch(k, k)
        mx.eval([c.attention(q, scale=dim**-0.5) for c in caches])

    times = []
    for i in range(23):
        start = time.perf_counter()
        tq_only()
        if i >= 3:
            times.append(time.perf_counter() - start)
    print(f"{shape} context={context} tq_ms_per_step={statistics.median(times) * 1e3:.3f}")

    def both():
        tq_only()
        mx.eval([mx.fast.scaled_dot_product_attention(q, ks[0], ks[1], scale=dim**-0.5) for _ in range(layers)])

    _profiled(both)


def tq_batch(shape: str, rows: int, context: int) -> None:
    import mlx.core as mx

    from batchgen.cache.factory import make_turboquant_cache
    from batchgen.cache.turboquant_rows import TurboQuantBatchLayer
    from batchgen.decode.passes import prefill

    model = _step_model(shape)
    job = make_turboquant_cache(model, bits=4, trim_reserve=12)
    prefill(model, job, mx.random.randint(0, 1000, (context,)).tolist(), 2048)
    mx.eval([c.state[:8] for c in job])
    cache = [TurboQuantBatchLayer(rows) for _ in job]  # the one prefilled job placed in every row
    for layer, c in zip(cache, job):
        layer.write_position = context
        for r in range(rows):
            layer.place(r, c, context, rows)
    mx.eval([layer.step_arrays() for layer in cache])
    step = _stepper(model)
    print(f"{shape} turboquant rows={rows} context={context} "
          f"{_ms_a_step(lambda y: step(cache, y), rows)}")  # fmt: skip
    y = mx.zeros((rows,), mx.uint32)
    _profiled(lambda: mx.eval(step(cache, y)))


def family(name: str) -> str:
    """A kernel's family: its name up to the first '<' or '('.

    >>> family("tq_step<128, 4>(float*)"), family("sm90_xmma_gemm_bf16")
    ('tq_step', 'sm90_xmma_gemm_bf16')
    """
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
    ap = argparse.ArgumentParser(description="GPU time of each kernel of one decode step (run under ncu; see the top)")
    ap.add_argument("mode", choices=["step", "tq", "tqbatch", "sweep", "summary"])
    ap.add_argument("path", nargs="?", type=Path, help="summary: the ncu CSV log")
    ap.add_argument("--shape", default="qwen2.5-0.5b", help="a `batchgen bench --shape` name")
    ap.add_argument("--rows", default="8", help="sweep: a comma list")
    ap.add_argument("--context", default="512", help="sweep: a comma list")
    ap.add_argument("--warps", default="16", help="sweep: the attention kernels' warps a block, a comma list")
    ap.add_argument("--host-ms", default="0", help="sweep: host work between steps, ms, a comma list")
    ap.add_argument("--grouped", default="", help="0 / 1: a block per query head / per kv head on wide grids; sweep: a comma list, step: one value")
    ap.add_argument("--unroll", default="", help="sweep: the attention kernels' UNROLL, a comma list")
    ap.add_argument("--steps", type=int, default=1, help="step: steps in the profiled range")
    a = ap.parse_args()
    if a.mode == "summary":
        if a.path is None:
            ap.error("summary needs the ncu CSV log")
        summary(a.path)
    elif a.mode == "sweep":
        ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
        opt = lambda text: ints(text) if text else [None]  # noqa: E731
        sweep(a.shape, ints(a.rows), ints(a.context), ints(a.warps), [float(x) for x in a.host_ms.split(",")],
              groups=opt(a.grouped), unrolls=opt(a.unroll))  # fmt: skip
    elif a.mode == "step":
        if a.grouped:  # one value: the step's fp16 kernels grouped on wide grids (1) or a block per query head (0)
            from batchgen.kernels import attention

            attention.GROUPED = bool(int(a.grouped))
        batch_step(a.shape, int(a.rows), int(a.context), a.steps)
    elif a.mode == "tq":
        tq_step(a.shape, int(a.context))
    else:
        tq_batch(a.shape, int(a.rows), int(a.context))


if __name__ == "__main__":
    main()
