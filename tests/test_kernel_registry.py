"""One parity test over the kernel registry (batchgen/kernels/registry.py), every op alike.

For each op and each of its examples:
- its source file loads (helpers, then one body line, includes expanded) and names every
  input and output the op declares;
- CPU: the launch, with a stand-in for MLX's kernel that only records the call, asks for
  outputs of the shapes and dtypes the reference returns; the reference runs;
- NVRTC (where installed, as the test extra does on Linux; no GPU needed): the kernel MLX
  generates around the body compiles for the H200 (sm_90a), at the example's template
  constants and dtypes;
- CUDA: the kernel's outputs equal the reference's within the op's tolerance.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import batchgen.kernels.attention  # noqa: F401  (registers its ops)
import batchgen.kernels.projection  # noqa: F401
import batchgen.kernels.turboquant  # noqa: F401
from batchgen.kernels import builds, registry
from batchgen.turboquant.codec import unpack_codes

CASES = [(name, i) for name, op in registry.OPS.items() for i in range(len(op.examples()))]


def flat(outputs) -> list:
    """An op's outputs (an array, or tuples of arrays) as a flat list."""
    if isinstance(outputs, mx.array):
        return [outputs]
    return [a for x in outputs for a in flat(x)]


class Recorded(Exception):
    pass


def record_launch(monkeypatch, op, args, kwargs) -> dict:
    """What `op.launch(*args)` hands MLX's kernel (template, inputs, output shapes),
    through a stand-in that returns zeros of the asked shapes."""
    seen = {}

    def fake_kernel(*_):
        def launch(inputs, template, grid, threadgroup, output_shapes, output_dtypes, **kw):
            seen.update(inputs=inputs, template=template, output_shapes=output_shapes, output_dtypes=output_dtypes,
                        threadgroup=threadgroup, grid=grid)
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return launch

    monkeypatch.setattr(registry, "_cuda_kernel", fake_kernel)
    seen["outputs"] = op.launch(*args, **kwargs)
    return seen


def test_every_op_has_a_source_a_reference_and_examples():
    assert set(registry.OPS) == {"tq_scores", "tq_values", "tq_encode", "tq_step", "batch_decode", "batch_step",
                                 "batch_fused_step", "tq_rows_step", "tq_rows_fused_step", "few_row_projection"}
    for name, op in registry.OPS.items():
        header, body = registry.load_source(op.source)
        assert "tq_bits" in header and "ld8" in header, name  # the shared helpers, once
        assert header.count("__device__ __forceinline__ unsigned int tq_bits(") == 1, name
        assert "#include" not in body and registry.BODY_MARK not in body, name
        for arg in op.inputs + op.outputs:  # by name, or pasted by the SEL macro (s##which: sk, sv)
            assert arg in body or f"{arg[0]}##which" in body, (name, arg)
        assert op.examples() and callable(op.reference), name


def test_a_source_needs_exactly_one_body_line(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "CUDA_DIR", tmp_path)
    (tmp_path / "none.cu").write_text("// helpers only\n")
    (tmp_path / "two.cu").write_text(f"{registry.BODY_MARK}\nx;\n{registry.BODY_MARK}\n")
    (tmp_path / "ok.cu").write_text(f'#include "h.cuh"\n#include "h.cuh"\n{registry.BODY_MARK}\n#include "b.cuh"\n')
    (tmp_path / "h.cuh").write_text("int helper;")
    (tmp_path / "b.cuh").write_text("  body();")
    for name in ("none.cu", "two.cu"):
        with pytest.raises(ValueError, match="one"):
            registry.load_source(name)
    assert registry.load_source("ok.cu") == ("int helper;\n", "  body();\n")  # each file once


def test_using_pins_and_restores_a_form():
    op = registry.OPS["tq_scores"]
    args, kw = op.examples()[0]
    with registry.using("reference", "tq_scores"):
        assert not op.takes(*args, **kw)
    with registry.using("kernel"):
        assert op.takes(*args, **kw) and op.mode == "kernel"
    assert op.mode == "auto"
    with pytest.raises(ValueError, match="mode"):
        with registry.using("fast"):
            pass


@pytest.mark.parametrize("name,i", CASES)
def test_launch_asks_for_what_the_reference_returns(monkeypatch, name, i):
    op = registry.OPS[name]
    args, kwargs = op.examples()[i]
    seen = record_launch(monkeypatch, op, args, kwargs)
    want = flat(op.reference(*args, **kwargs))
    mx.eval(want)
    got = flat(seen["outputs"])
    assert [(a.shape, a.dtype) for a in got] == [(a.shape, a.dtype) for a in want]
    assert len(seen["inputs"]) == len(op.inputs) and len(seen["output_shapes"]) == len(op.outputs)


def nvrtc_or_skip() -> builds.Nvrtc:
    try:
        return builds.Nvrtc()
    except builds.BuildError as e:
        pytest.skip(str(e))


FP16_BATCH_OPS = ("batch_decode", "batch_step", "batch_fused_step")


def test_wide_grids_take_fewer_warps_in_the_fp16_batch_kernels_only(monkeypatch):
    """Every grid counted wide (`attention.WIDE_GRID` 1): the fp16 batch kernels launch
    `WIDE_WARPS` warps a block (at least one thread per coordinate), the TurboQuant rows'
    kernels keep `WARPS`; the threads a block and the WARPS constant agree."""
    from batchgen.kernels import attention

    monkeypatch.setattr(attention, "WIDE_GRID", 1)
    checked = set()
    for name, i in CASES:
        op = registry.OPS[name]
        args, kwargs = op.examples()[i]
        seen = record_launch(monkeypatch, op, args, kwargs)
        template = dict(seen["template"])
        if name == "few_row_projection" or "WARPS" not in template:  # the projection's warps are its own
            continue
        checked.add(name)
        warps, d = template["WARPS"], template["D"]
        assert seen["threadgroup"][0] == 32 * warps, name
        fp16_warps = attention.GROUP_WARPS if template.get("QB", 1) > 1 else attention.WIDE_WARPS
        assert warps == (max(fp16_warps, d // 32) if name in FP16_BATCH_OPS else attention.WARPS), name
    assert checked >= set(FP16_BATCH_OPS) | {"tq_rows_step", "tq_rows_fused_step"}


def test_wide_grids_group_a_kv_heads_query_heads_in_the_fp16_batch_kernels(monkeypatch):
    """On a wide grid the fp16 batch kernels take all of a kv head's query heads a block
    (QB = HQ / HKV, a grid of rows x kv heads blocks); otherwise, with grouping off, or
    for the TurboQuant rows' kernels, a block per query head (QB = 1, or no QB)."""
    from batchgen.kernels import attention

    def launches(name):
        op = registry.OPS[name]
        for args, kwargs in op.examples():
            seen = record_launch(monkeypatch, op, args, kwargs)
            t = dict(seen["template"])
            yield t.get("QB"), t["HQ"], t["HKV"], seen["grid"][0] // seen["threadgroup"][0], args[0].shape[0]

    for wide_grid, grouped in ((1, True), (1, False), (2048, True)):
        monkeypatch.setattr(attention, "WIDE_GRID", wide_grid)
        monkeypatch.setattr(attention, "GROUPED", grouped)
        for name in FP16_BATCH_OPS:
            for qb, hq, hkv, blocks, rows in launches(name):
                want = hq // hkv if grouped and wide_grid == 1 and hq > hkv else 1
                assert (qb, blocks) == (want, rows * hq // want), (name, wide_grid, grouped)
        for name in ("tq_rows_step", "tq_rows_fused_step"):
            assert all(qb is None and blocks == rows * hq for qb, hq, _, blocks, rows in launches(name)), name


@pytest.mark.parametrize("examples,wide", [("first", False), ("first", True), pytest.param("all", False, marks=pytest.mark.slow)])
def test_sources_compile_for_their_examples(monkeypatch, examples, wide):
    """Every op's kernel as MLX generates it around the body (`builds.Variant.source`:
    MLX's header, the signature from the names and dtypes, the template constants), at
    each example's constants and dtypes, compiled by NVRTC for the H200 (sm_90a) as MLX
    compiles it; the first example of each op in the fast suite, and again with every
    grid counted wide (fewer warps a block). No GPU needed."""
    nvrtc = nvrtc_or_skip()
    if wide:
        from batchgen.kernels import attention

        monkeypatch.setattr(attention, "WIDE_GRID", 1)
    header = None
    for name, i in CASES:
        if examples == "first" and i:
            continue
        op = registry.OPS[name]
        args, kwargs = op.examples()[i]
        seen = record_launch(monkeypatch, op, args, kwargs)
        op_header, body = registry.load_source(op.source)
        code = "\n".join(line for line in op_header.splitlines() if not line.lstrip().startswith("//"))
        assert header in (None, code), name  # one header of shared helpers for all
        header = code
        v = builds.variant(registry.build_name(name, op_header, body), op_header, body, op.inputs, op.outputs,
                           seen["inputs"], seen["output_dtypes"], seen["template"])  # fmt: skip
        assert v is not None, name
        cubin, mangled = nvrtc.compile_variant(v, (9, 0))
        assert cubin[:4] == b"\x7fELF" and v.kernel_name in mangled, name


def close(got: mx.array, want: mx.array, tol: float) -> bool:
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    return err <= tol * max(1.0, mx.abs(want.astype(mx.float32)).max().item())


def same_codes(got: mx.array, want: mx.array, bits: int, dim: int) -> bool:
    """Packed codes that agree but where a coordinate sat on a codebook edge (float32
    sums in another order may move it by one level)."""
    a, b = (np.array(unpack_codes(x, bits, dim)).astype(int) for x in (got, want))
    return (a != b).mean() < 1e-3 and np.abs(a - b).max() <= 1


@pytest.mark.cuda
@pytest.mark.parametrize("name,i,wide", [(n, i, False) for n, i in CASES] + [(n, i, True) for n, i in CASES if n in FP16_BATCH_OPS])
def test_kernel_matches_reference(monkeypatch, name, i, wide):
    """Each example against the reference; `wide`: every grid counted wide (the fp16
    batch kernels grouped where the heads allow, `GROUP_WARPS` warps a block, else
    `WIDE_WARPS`)."""
    from batchgen.kernels import attention

    if wide:
        monkeypatch.setattr(attention, "WIDE_GRID", 1)
    op = registry.OPS[name]
    args, kwargs = op.examples()[i]
    got, want = flat(op.launch(*args, **kwargs)), flat(op.reference(*args, **kwargs))
    # bf16 outputs and float32 ones through fp16 tensor-core operands round more.
    tol = max(op.tolerance, 2e-2 if any(a.dtype == mx.bfloat16 for a in want) else 0)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, k)
        if w.dtype == mx.uint32:  # packed codes (the encoder's, a step's window)
            bits = args[1] if name == "tq_encode" else None
            if bits is not None:
                assert same_codes(g, w, bits, args[0].shape[-1]), (name, k)
            continue
        assert close(g, w, tol), (name, k, mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max().item())


def test_kernels_build_under_a_name_that_follows_their_source(monkeypatch):
    """MLX reuses a build from disk by name: a changed source must change the name."""
    seen = []
    monkeypatch.setattr(registry.mx.fast, "cuda_kernel", lambda **kw: seen.append(kw["name"]))
    registry._cuda_kernel.cache_clear()
    op = next(iter(registry.OPS.values()))
    op.kernel()
    header, body = registry.load_source(op.source)
    assert seen == [registry.build_name(op.name, header, body)] and seen[0].startswith(op.name + "_")
    assert registry.build_name(op.name, header, body + " ") != seen[0]
    registry._cuda_kernel.cache_clear()


def test_kernel_builds_are_kept_per_mlx_version_and_gpu_kind(monkeypatch, tmp_path):
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    monkeypatch.setattr(registry, "available", lambda: False)
    assert registry.keep_builds(tmp_path) is None and "MLX_PTX_CACHE_DIR" not in registry.os.environ
    monkeypatch.setattr(registry, "available", lambda: True)
    monkeypatch.setattr(registry.mx, "device_info", lambda: {"architecture": "sm_90", "device_name": "NVIDIA H200"})
    path = registry.keep_builds(tmp_path)
    assert path == tmp_path / registry.mx.__version__ / "sm_90" and path.is_dir()
    assert registry.os.environ["MLX_PTX_CACHE_DIR"] == str(path)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice stands
    assert registry.keep_builds(tmp_path / "other") == tmp_path / "mine"
