"""One compiled kernel per source: `attention.launch` keeps a kernel for each
(name, source, header), so that two sources under one name (another version of a
kernel, in one process) never share a compiled kernel, and MLX compiles each
source of a name anew (measured on MLX 0.32.4, bench/results/2026-11-30-h200-x
`m3/hazard.log`; the CUDA test below keeps it so)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from batchgen.kernels import attention


def test_launch_makes_a_kernel_for_each_source_of_a_name(monkeypatch):
    made = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)  # a stand-in: nothing compiles
    monkeypatch.setattr(attention, "_kernels", {})
    queries = mx.zeros((1, 2, 1, 32))
    for source in ("out[0] = 1;", "out[0] = 2;", "out[0] = 1;"):
        with pytest.raises(TypeError):  # the stand-in returns a dict, which cannot be launched
            attention.launch("same_name", source, queries, 1, {}, 1.0, {})
    assert [(kw["name"], kw["source"]) for kw in made] == [("same_name", "out[0] = 1;"), ("same_name", "out[0] = 2;")]
    assert made[0]["input_names"] == ["q", "scale"] and made[0]["output_names"] == ["out"]


@pytest.mark.cuda
def test_mlx_runs_each_source_of_one_name_and_each_dtype():
    for value, dtype in ((1, mx.float32), (2, mx.float32), (2, mx.bfloat16)):
        kernel = mx.fast.cuda_kernel(name="same_name_probe", input_names=["x"], output_names=["out"],
                                     source=f"out[threadIdx.x] = static_cast<float>(x[threadIdx.x]) + {value}.0f;")
        x = mx.arange(32).astype(dtype)
        out = kernel(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
                     output_dtypes=[dtype])[0]  # fmt: skip
        assert out.astype(mx.float32).tolist() == [float(i + value) for i in range(32)], (value, dtype)
