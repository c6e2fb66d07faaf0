"""What NVRTC takes to build each of batchgen's kernel variants: the toll a process paid
for every variant it ran before builds were kept (kernels/builds.py). No GPU needed: the
variants are those the registry's examples launch, compiled as MLX compiles them.

    python bench/kernel_builds.py [--arch 9.0] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx

import batchgen.kernels.attention  # noqa: F401  (registers its ops)
import batchgen.kernels.projection  # noqa: F401
import batchgen.kernels.turboquant  # noqa: F401
from batchgen.kernels import builds, registry


def example_variants() -> dict:
    """{(op, kernel name, first input's dtype): Variant} over every op's examples, their
    launches recorded by a stand-in for MLX's kernel that returns zeros."""
    found = {}
    for op in registry.OPS.values():
        header, body = registry.load_source(op.source)
        name = registry.build_name(op.name, header, body)

        def record(*, inputs, template=(), output_shapes, output_dtypes, **_):
            v = builds.variant(name, header, body, op.inputs, op.outputs, inputs, output_dtypes, template)
            found[(op.name, v.kernel_name, v.inputs[0][0])] = v
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        op.kernel = lambda record=record: record  # this process only records
        for args, kwargs in op.examples():
            op.launch(*args, **kwargs)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="9.0", help="compute capability to build for (default 9.0, the H200)")
    ap.add_argument("--out", help="write the per-variant seconds here (JSON)")
    a = ap.parse_args()
    arch = tuple(int(x) for x in a.arch.split("."))
    nvrtc = builds.Nvrtc()
    rows = []
    for (op, kernel, dtype), v in sorted(example_variants().items()):
        t = time.perf_counter()
        cubin, _ = nvrtc.compile_variant(v, arch)
        seconds = time.perf_counter() - t
        rows.append({"op": op, "kernel": kernel, "dtype": dtype, "seconds": seconds, "bytes": len(cubin)})
        print(f"{rows[-1]['seconds']:6.2f} s  {len(cubin):7d} B  {kernel} ({dtype})", flush=True)
    by_op = {}
    for r in rows:
        by_op.setdefault(r["op"], []).append(r["seconds"])
    for op, s in sorted(by_op.items()):
        print(f"{op:18s} {len(s):2d} variants, median {statistics.median(s):.2f} s")
    total = sum(r["seconds"] for r in rows)
    print(f"all {len(rows)} variants: {total:.1f} s (NVRTC {nvrtc.version}, {platform.machine()})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"nvrtc": nvrtc.version, "arch": arch, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
