"""Where one TurboQuant step-mode decode step spends its time, all layers of a shape.

    python bench/turboquant_step_probe.py 0.5b,7b 1024,8192,32768

Per row (ms, median; each figure includes its mx.eval): `full` = every layer's
update_and_fetch + attention; `kernels` = `turboquant_kernels.step` alone, as many
calls as layers, over one layer's captured arguments (no cache bookkeeping);
`step_only` = its kernel launched directly, as many launches as layers (a third
argument, another commit's turboquant_kernels.py: `baseline_kernels` its `step`, its
kernels and launches, on the same arguments as `kernels`); `empty` = as
many launches of a custom kernel that writes one float as the step launches (one a
layer), `builtin` = as many tiny built-in ops (x + 1 on 16 floats); `fp16` = mx.fast
attention over an fp16 cache of the same context, every layer; `empty_step_args` /
`empty_step_header` = an empty body with the step's arguments / header, one a layer;
`*_build` = host time building `full`'s / `kernels`' graph (no eval); `full_one_meta`
= `full` with one meta array for every step (timing only); `full_N_blocks` = `full`
with STEP_BLOCKS = N.
CUDA only (step mode).
"""

import json
import statistics
import sys
import time

import mlx.core as mx

from batchgen.kernels import turboquant as kernels

sys.path.insert(0, "bench")
from turboquant_attention import SHAPES, baseline_module, filled_turboquant, step_arguments  # noqa: E402

BASELINE = None  # a turboquant_kernels.py (argv[3]): its step timed on the same arguments


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


def build_ms(build, n: int = 30) -> float:
    times = []
    for i in range(n + 3):
        mx.synchronize()
        start = time.perf_counter()
        outs = build()
        elapsed = time.perf_counter() - start
        mx.eval(outs)
        if i >= 3:
            times.append(elapsed)
    return statistics.median(times) * 1e3


def probe(shape: str, n: int) -> dict:
    layers, heads, kv_heads, dim = SHAPES[shape]
    caches = filled_turboquant(layers, n, kv_heads, dim, mx.bfloat16)
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
    args, real = step_arguments(full), kernels.step
    row["kernels_ms"] = timed_ms(lambda: mx.eval([real(*args)[0] for _ in range(layers)]))
    # Host time alone: building the graph, evaluated after the clock stops.
    row["full_build_ms"] = build_ms(lambda: [(c.update_and_fetch(k, k), c.attention(q, dim**-0.5))[1] for c in caches])
    row["kernels_build_ms"] = build_ms(lambda: [real(*args)[0] for _ in range(layers)])
    # Every step with one meta array (made once): timing only, the outputs are wrong.
    step_meta, first = kernels.step_meta, {}
    kernels.step_meta = lambda fields: first.setdefault("meta", step_meta(fields))
    try:
        row["full_one_meta_ms"] = timed_ms(full)
    finally:
        kernels.step_meta = step_meta
    row["20_launches_ms"] = timed_ms(lambda: mx.eval([real(*args)[0] for _ in range(20)]), 10)
    row["chunks"] = args[7]
    q_, new_kv, sinks, coded, window, books, meta, chunks, bits = args
    step_in = [q_, *new_kv, *sinks, *coded, *window, books, meta, kernels.step_counters(kv_heads)]
    launch = kernels._step_launch(1, heads, dim, kv_heads, bits, window[0].shape[2], chunks, q_.dtype)
    step_k = kernels._step_kernel("tq_step")
    row["step_only_ms"] = timed_ms(lambda: mx.eval([step_k(inputs=step_in, **launch)[0] for _ in range(layers)]))
    empty = mx.fast.cuda_kernel(name="probe_empty", input_names=["x"], output_names=["y"],
                                source="if (threadIdx.x == 0) y[0] = x[0];")  # fmt: skip
    x = mx.zeros((16,))
    mx.eval(x)
    row["empty_ms"] = timed_ms(lambda: mx.eval([empty(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                                                      output_shapes=[(1,)], output_dtypes=[mx.float32])[0]
                                                for _ in range(layers)]))  # fmt: skip
    if BASELINE:  # the same arguments through another commit's step
        old = baseline_module(BASELINE)
        row["baseline_kernels_ms"] = timed_ms(lambda: mx.eval([old.step(*args)[0] for _ in range(layers)]))
    # Host cost of a launch: the step's arguments (inputs, outputs, template) with an
    # empty body, and an empty body with the step's header.
    names = kernels.STEP_KERNELS["tq_step"]
    wide = mx.fast.cuda_kernel(name="probe_wide", input_names=names[0], output_names=names[1],
                               source="if (threadIdx.x == 0) part[0] = 0.0f;", ensure_row_contiguous=False)
    wide_args = dict(launch, grid=(32, 1, 1), threadgroup=(32, 1, 1))
    row["empty_step_args_ms"] = timed_ms(lambda: mx.eval([wide(inputs=step_in, **wide_args)[0] for _ in range(layers)]))
    headed = mx.fast.cuda_kernel(name="probe_headed", input_names=["x"], output_names=["y"],
                                 source="if (threadIdx.x == 0) y[0] = x[0];", header=kernels._STEP_HEADER)
    row["empty_step_header_ms"] = timed_ms(lambda: mx.eval([headed(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                                                                   output_shapes=[(1,)], output_dtypes=[mx.float32])[0]
                                                            for _ in range(layers)]))  # fmt: skip
    # Blocks per step and layer (STEP_BLOCKS) against the whole step.
    default = kernels.STEP_BLOCKS
    try:
        for blocks in (256, 1024, 2048):
            kernels.STEP_BLOCKS = blocks
            row[f"full_{blocks}_blocks_ms"] = timed_ms(full)
    finally:
        kernels.STEP_BLOCKS = default
    row["builtin_ms"] = timed_ms(lambda: mx.eval([x + i for i in range(layers)]))
    ks = [mx.random.normal((1, kv_heads, n, dim)).astype(mx.bfloat16) for _ in range(2)]
    mx.eval(ks)
    row["fp16_ms"] = timed_ms(lambda: mx.eval([mx.fast.scaled_dot_product_attention(q, ks[0], ks[1], scale=dim**-0.5)
                                               for _ in range(layers)]))  # fmt: skip
    return row


def main() -> None:
    global BASELINE
    BASELINE = sys.argv[3] if len(sys.argv) > 3 else None
    for shape in sys.argv[1].split(","):
        for n in (int(x) for x in sys.argv[2].split(",")):
            print(json.dumps(probe(shape, n)), flush=True)


if __name__ == "__main__":
    main()
