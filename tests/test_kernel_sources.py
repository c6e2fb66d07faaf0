"""The CUDA kernels' sources compile (nvcc, no GPU needed).

MLX builds a custom kernel's function around its body at run time (signature from the
input and output names and dtypes, `_strides` parameters where the body uses them,
template constants as `constexpr`); a syntax or type error would otherwise surface only
on a GPU. This builds the same wrapper around each kernel body, with a stand-in for
MLX's device header, and compiles it for the H200 (sm_90). Skipped without nvcc.
"""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import pytest

from batchgen.kernels import turboquant as K

nvcc = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(nvcc is None, reason="needs nvcc")

# What MLX's device header provides to a kernel body, as far as these kernels use it.
STANDIN = """
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
using Strides = cuda::std::array<int64_t, 10>;
using Shape = cuda::std::array<int32_t, 10>;
"""
CUDA_TYPES = {"f32": "float", "bf16": "__nv_bfloat16", "f16": "__half", "u32": "uint32_t", "i32": "int32_t"}


def wrapped(name: str, header: str, body: str, inputs: list, outputs: list, template: list) -> str:
    params = []
    for arg, dtype in inputs:
        params.append(f"const {CUDA_TYPES[dtype]}* {arg}")
        if f"{arg}_shape" in body:
            params.append(f"const __grid_constant__ Shape {arg}_shape")
        if f"{arg}_strides" in body:
            params.append(f"const __grid_constant__ Strides {arg}_strides")
    params += [f"{CUDA_TYPES[dtype]}* {arg}" for arg, dtype in outputs]
    constants = "".join(f"  constexpr int {k} = {v};\n" for k, v in template)
    return (f"{STANDIN}{header}\nnamespace mlx::core::cu {{\n__global__ void custom_kernel_{name}(\n  "
            + ",\n  ".join(params) + f") {{\n{constants}{body}\n}}\n}}\n")  # fmt: skip


def compiles(tmp_path, source: str) -> None:
    path = tmp_path / "kernel.cu"
    path.write_text(source)
    run = subprocess.run([nvcc, "-arch=sm_90", "-c", "-o", str(tmp_path / "kernel.o"), str(path)],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]


def step_dtypes(dtype: str) -> dict:
    """Each step-mode kernel argument's dtype, the model's being `dtype`."""
    model = ("q", "kn", "vn", "sk", "sv", "wx", "wx_out", "out", "x")
    fixed = {"kc": "u32", "vc": "u32", "wc": "u32", "wc_out": "u32", "codes": "u32", "kq": "f16", "vq": "f16",
             "wq": "f16", "wq_out": "f16", "scales": "f16", "books": "f32", "part": "f32", "sign": "f32",
             "tab": "f32", "edge": "f32", "meta": "i32", "count": "u32"}  # fmt: skip
    return {**fixed, **{n: dtype for n in model}}


# D = 64 takes the CUDA-core products, D = 128 the tensor-core ones (the 7B shape's bits, and others).
@pytest.mark.parametrize("dim,group,bits,dtype", [(64, 7, (5, 3), "bf16"), (128, 7, (5, 3), "bf16"),
                                                  (128, 8, (4, 2), "f32")])  # fmt: skip
def test_step_kernels_compile(tmp_path, dim, group, bits, dtype):
    kb = bits[0]
    wk = dim * kb // 32
    types = step_dtypes(dtype)
    # step_chunks splits positions in the kernel's tiles: a block's threads, as launched
    assert "TILE = NT;" in K._STEP and "NT = D > 64 ? 256 : 128" in K._STEP
    assert [K._threads(d) for d in (64, 128, 256)] == [128, 256, 256]
    # The templates the real launches use (turboquant_kernels._step_launch).
    mx_dtype = {"bf16": mx.bfloat16, "f32": mx.float32}[dtype]
    step = K._step_launch(1, 2 * group, dim, 2, bits, 44, 8, mx_dtype)
    templates = {"tq_step": step["template"],
                 "tq_encode": [("D", dim), ("BITS", kb), ("W", wk)]}  # fmt: skip
    for name, template in templates.items():
        inputs, outputs, body = K.STEP_KERNELS[name]
        compiles(tmp_path, wrapped(name, K._STEP_HEADER, body, [(n, types[n]) for n in inputs],
                                   [(n, types[n]) for n in outputs], template))  # fmt: skip


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_batch_attention_kernels_compile(tmp_path, dtype):
    from batchgen.kernels import attention as A

    template = [("D", 64), ("HQ", 14), ("HKV", 2), ("HT", 18), ("WARPS", A._DECODE_WARPS),
                ("UNROLL", A._DECODE_UNROLL)]  # fmt: skip
    fixed = [("left_padding", "i32"), ("meta", "i32"), ("scale", "f32")]
    step = [(n, dtype) for n in ("q", "k", "v", "rk", "rv", "kn", "vn")] + fixed
    fused = [(n, dtype) for n in ("q", "heads", "k", "v", "rk", "rv")] + fixed
    decode = [(n, dtype) for n in ("q", "k", "v")] + fixed
    # `out` in the queries' dtype: the kernels round their float32 sums on the way out
    step_out = [(n, dtype) for n in ("out", "rk_out", "rv_out")]
    compiles(tmp_path, wrapped("s", A.HEADER, A._STEP_SOURCE, step, step_out, template))
    compiles(tmp_path, wrapped("f", A.HEADER, A._FUSED_STEP_SOURCE, fused, step_out, template))
    compiles(tmp_path, wrapped("d", A.HEADER, A._DECODE_SOURCE, decode, [("out", dtype)], template))


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("dim,bits", [(64, 4), (128, 3)])
def test_turboquant_batch_step_kernels_compile(tmp_path, dtype, dim, bits):
    from batchgen.kernels import attention as A
    from batchgen.cache import turboquant_rows as T
    from batchgen.cache.turboquant import resolve_bits

    layout = T.Layout(*resolve_bits(bits), 4, 8, 0, dim, dim, mx.bfloat16)
    assert T.kernel_fits(layout)
    template = [("D", dim), ("HQ", 14), ("HKV", 2), ("HT", 18), ("WARPS", A._DECODE_WARPS),
                ("UNROLL", A._DECODE_UNROLL), *T.kernel_template(layout)]  # fmt: skip
    rows = [(n, dtype) for n in ("sk", "sv", "tk", "tv")]
    coded = [("kcode", "u32"), ("knorm", "f16"), ("vcode", "u32"), ("vnorm", "f16")]
    fixed = [(n, dtype) for n in ("rk", "rv")] + [("tabs", "f32"), ("signs", "f32"), ("left_padding", "i32"),
                                                   ("meta", "i32"), ("scale", "f32")]  # fmt: skip
    outs = [(n, dtype) for n in ("out", "rk_out", "rv_out")]
    plain = [("q", dtype), ("kn", dtype), ("vn", dtype)] + rows + coded + fixed
    fused = [("q", dtype), ("heads", dtype)] + rows + coded + fixed
    compiles(tmp_path, wrapped("t", T.STEP_HEADER, A.STEP_HEAD + T.STEP_SOURCE, plain, outs, template))
    compiles(tmp_path, wrapped("tf", T.STEP_HEADER, A.FUSED_STEP_HEAD + T.STEP_SOURCE, fused, outs, template))


@pytest.mark.parametrize("rows,n,bias", [(1, 896, False), (8, 9728, True), (13, 1152, False), (32, 37888, True)])
def test_projection_kernel_compiles(tmp_path, rows, n, bias):
    from batchgen.kernels import projection as P

    inputs = [(name, "bf16") for name in P.INPUTS]
    outputs = [(name, "bf16") for name in P.OUTPUTS]
    compiles(tmp_path, wrapped("p", P.HEADER, P.SOURCE, inputs, outputs, P.template(rows, n, bias)))
