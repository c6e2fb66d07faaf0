"""batchgen's few-row projection kernel (`small_matmul`) and its load-time install."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load

from batchgen import small_matmul as S
from batchgen.fusion import fuse_model
from batchgen.turboquant_kernels import available

cuda = pytest.mark.skipif(not available(), reason="needs MLX with a CUDA GPU")


def test_launch_picks_row_blocks_and_columns_per_warp():
    got = [(S.launch(rows, 896, mx.bfloat16)["grid"], dict(S.launch(rows, 896, mx.bfloat16)["template"]))
           for rows in (1, 2, 3, 8, 9, 16)]  # fmt: skip
    # 896 columns: 112 blocks of 4 warps x 2 columns, or 56 of 4 x 4 (8-row blocks)
    assert [g for g, _ in got] == [(14336, 1, 1), (14336, 1, 1), (14336, 1, 1), (7168, 1, 1), (7168, 2, 1),
                                   (7168, 2, 1)]  # fmt: skip
    assert [(t["MT"], t["R"]) for _, t in got] == [(2, 2), (2, 2), (4, 2), (8, 4), (8, 4), (8, 4)]
    assert S.launch(5, 37, mx.float32)["grid"] == (3 * 128, 1, 1)  # 37 columns: 3 blocks of 16, the last part-full


@pytest.mark.parametrize("x_shape,w_shape,dtypes,ok", [
    ((8, 64), (96, 64), (mx.bfloat16, mx.bfloat16), True),
    ((16, 64), (96, 64), (mx.float32, mx.float32), True),
    ((17, 64), (96, 64), (mx.bfloat16, mx.bfloat16), False),  # more rows than MAX_ROWS
    ((8, 60), (96, 60), (mx.bfloat16, mx.bfloat16), False),  # K not a multiple of 8
    ((8, 64), (96, 64), (mx.bfloat16, mx.float32), False),  # mixed dtypes
    ((8, 64), (96, 32), (mx.bfloat16, mx.bfloat16), False),  # K differs
    ((2, 8, 64), (96, 64), (mx.bfloat16, mx.bfloat16), False),  # 3-D x (RowsLinear flattens)
    ((8, 64), (96, 64), (mx.int32, mx.int32), False),
])  # fmt: skip
def test_supported(x_shape, w_shape, dtypes, ok):
    assert S.supported(mx.zeros(x_shape, dtypes[0]), mx.zeros(w_shape, dtypes[1])) is ok


def test_unsupported_shapes_are_named_in_the_error():
    with pytest.raises(ValueError, match=r"got x \(17, 64\) mlx.core.bfloat16, w \(96, 64\)"):
        S.small_matmul(mx.zeros((17, 64), mx.bfloat16), mx.zeros((96, 64), mx.bfloat16))


def _fused(model_dir, arch, **kw):
    model, _ = load(str(model_dir(arch, **kw)))
    fuse_model(model)
    return model


def test_install_swaps_plain_linears_only(model_dir, monkeypatch):
    model = _fused(model_dir, "qwen2")
    assert S.install_small_matmul(model) == (0 if not available() else 9)  # CPU: nothing
    monkeypatch.setattr(S, "cuda_available", lambda: True)
    model = _fused(model_dir, "qwen2")
    linears = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    # two layers x (qkv_proj, o_proj, gate_up_proj, down_proj), and the head
    assert len(linears) == 9
    assert S.install_small_matmul(model) == 9
    assert sorted(name for name, m in model.named_modules() if type(m) is S.RowsLinear) == sorted(linears)
    quantized = _fused(model_dir, "qwen2", quantize_bits=4, dtype="float32")
    assert S.install_small_matmul(quantized) == 0  # quantized projections keep MLX's kernels


def test_rows_linear_leaves_one_row_and_long_chunks_to_mlx():
    layer = nn.Linear(64, 48, bias=True)
    x = mx.random.normal((1, 3 * S.MAX_ROWS, 64))
    want = [layer(x[:, :1]), layer(x)]
    layer.__class__ = S.RowsLinear
    got = [layer(x[:, :1]), layer(x)]  # neither reaches the kernel (CPU has none)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


def _reference(x, w, bias):
    y = x.astype(mx.float32) @ w.astype(mx.float32).T
    return y if bias is None else y + bias.astype(mx.float32)


@cuda
@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-5), (mx.float16, 2e-3), (mx.bfloat16, 1e-2)])
@pytest.mark.parametrize("n,k,with_bias", [(1152, 896, True), (37, 64, False), (96, 200, True), (3584, 4864, False)])
def test_kernel_matches_a_float32_reference(dtype, tol, n, k, with_bias):
    mx.random.seed(0)
    w = (mx.random.normal((n, k)) * 0.05).astype(dtype)
    bias = mx.random.normal((n,)).astype(dtype) if with_bias else None
    x_all = mx.random.normal((S.MAX_ROWS, k)).astype(dtype)
    for rows in (1, 2, 3, 5, 8, 9, S.MAX_ROWS):
        ref = _reference(x_all[:rows], w, bias)
        err = mx.abs(S.small_matmul(x_all[:rows], w, bias).astype(mx.float32) - ref).max().item()
        assert err <= tol * mx.abs(ref).max().item(), (rows, err)  # within `tol` of the largest output


@cuda
def test_a_rows_result_does_not_depend_on_its_batch_mates():
    w = (mx.random.normal((1152, 896)) * 0.05).astype(mx.bfloat16)
    x = mx.random.normal((S.MAX_ROWS, 896)).astype(mx.bfloat16)
    together = S.small_matmul(x, w)
    for rows in (1, 3, 8):
        assert mx.array_equal(S.small_matmul(x[:rows], w), together[:rows]).item()


@cuda
def test_unaligned_rows_take_the_scalar_loads():
    flat = mx.random.normal((4 + 3 * 96,)).astype(mx.bfloat16)
    x = flat[4:].reshape(3, 96)  # row-contiguous, 8 bytes past an allocation's start
    w = (mx.random.normal((40, 96)) * 0.05).astype(mx.bfloat16)
    ref = _reference(x, w, None)
    assert mx.abs(S.small_matmul(x, w).astype(mx.float32) - ref).max().item() <= 1e-2 * mx.abs(ref).max().item()
