"""Kernel builds kept where MLX reads them (batchgen/kernels/builds.py).

- pure: libstdc++'s string hash against values g++ printed, the source and module name
  MLX makes for a launch, where MLX looks for a module;
- NVRTC (where installed, as the test extra does on Linux; no GPU): a build's two files,
  and `KeptKernel` writing each variant once and passing calls through;
- CUDA: MLX runs the kept build (a kept file whose cubin is another kernel's changes the
  output), in a fresh process with its own build directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

from batchgen.kernels import builds, registry

# `printf("%zx", std::hash<std::string>{}(s))`, g++ 12 (libstdc++), x86-64.
GXX_HASHES = {
    b"": "553e93901e462a6e",
    b"a": "454ddee488c1ed6b",
    b"abc": "32d82bf8ed3dba39",
    b"abcdefgh": "783db3e38db898bb",
    b"abcdefghi": "b4ec9257851c8aaf",
    b"custom_kernel_tq_step_0123456789ab_64_7_2_5_3": "dffb169a8464bbe5",
    'line\n\twith "quotes" and unicode \u00e9'.encode(): "b924dd03936228f8",
}


@pytest.mark.parametrize("data", list(GXX_HASHES))
def test_std_hash_matches_libstdcxx(data):
    assert f"{builds.std_hash(data):x}" == GXX_HASHES[data]


BODY = "  int i = threadIdx.x;\n  out[i] = static_cast<float>(x[i]) * x_shape[0] + s[0];"


def tiny_variant(template=(("N", 4), ("K", 2)), scalar_ndim=1) -> builds.Variant:
    inputs = [mx.zeros((2, 3), mx.bfloat16), mx.zeros((1,) * scalar_ndim, mx.float32)]
    return builds.variant("tiny_1", "// helpers\n", BODY, ("x", "s"), ("out",), inputs, [mx.float32], template)


def test_source_is_the_one_mlx_builds_for_the_launch():
    """custom_kernel.cpp's build_kernel, written out for one launch: MLX's header, then
    ours, the signature (a shape parameter for the input whose name the body uses with
    `_shape`), the constants, the body."""
    v = tiny_variant()
    assert v.kernel_name == "custom_kernel_tiny_1_4_2"
    assert v.source == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        "// helpers\n"
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_tiny_1_4_2(\n"
        "    const __nv_bfloat16* x,\n"
        "    const __grid_constant__ Shape x_shape,\n"
        "    const float* s,\n"
        "    float* out) {\n"
        "  constexpr int N = 4;\n"
        "  constexpr int K = 2;\n"
        "\n"
        f"{BODY}\n"
        "}\n\n} // namespace mlx::core::cu\n"
    )
    assert v.module_name == f"custom_kernel_tiny_1_4_2_{builds.std_hash(v.source.encode()):x}"


def test_a_zero_dim_input_gets_no_shape_parameters_and_no_template_no_constants():
    v = builds.variant("t", "", "out[0] = x_shape[0];", ("x",), ("out",), [mx.array(1.0)], [mx.float32])
    assert "Shape" not in v.source and "constexpr" not in v.source and v.kernel_name == "custom_kernel_t"


@pytest.mark.parametrize(
    "inputs,dtypes,template",
    [
        ([1.0], [mx.float32], ()),  # a Python scalar: MLX makes an array of its own
        ([mx.zeros(2, mx.complex64)], [mx.float32], ()),
        ([mx.zeros(2)], [mx.float32], (("FLAG", True),)),  # MLX writes bools as `constexpr bool`
    ],
)
def test_launches_it_cannot_name_are_left_to_mlx(inputs, dtypes, template):
    assert builds.variant("t", "", "out[0] = 0;", ("x",), ("out",), inputs, dtypes, template) is None


def test_long_module_names_split_into_folders_as_mlx_does(tmp_path):
    name = "m" * 600
    path = builds.ptx_path(tmp_path, name)
    assert path.relative_to(tmp_path).parts == ("m" * 245, "m" * 245, "m" * 110 + ".ptx")


def nvrtc_or_skip() -> builds.Nvrtc:
    try:
        return builds.Nvrtc()
    except builds.BuildError as e:
        pytest.skip(str(e))


def test_build_writes_the_cubin_and_its_mangled_name(tmp_path):
    v = tiny_variant()
    path = builds.build(nvrtc_or_skip(), v, (9, 0), tmp_path)
    assert path == tmp_path / f"{v.module_name}.ptx"
    assert path.read_bytes()[:4] == b"\x7fELF"
    name, mangled = path.with_suffix(".txt").read_text().rstrip("\n").split("\t")
    assert name == "mlx::core::cu::custom_kernel_tiny_1_4_2" and mangled.startswith("_ZN3mlx4core2cu")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, path.with_suffix(".txt").name])


def test_a_source_nvrtc_rejects_is_a_build_error_naming_the_kernel(tmp_path):
    v = builds.variant("bad", "", "out[0] = undefined_name;", ("x",), ("out",), [mx.zeros(2)], [mx.float32])
    with pytest.raises(builds.BuildError, match="(?s)custom_kernel_bad.*undefined_name"):
        builds.build(nvrtc_or_skip(), v, (9, 0), tmp_path)
    assert not list(tmp_path.iterdir())


def test_kept_kernel_writes_each_variant_once_and_passes_calls_through(tmp_path, monkeypatch):
    monkeypatch.setitem(builds._state, "nvrtc", nvrtc_or_skip())
    monkeypatch.setitem(builds._state, "arch", (9, 0))
    made = []
    monkeypatch.setattr(builds, "build", lambda *a, _b=builds.build: made.append(a[1].kernel_name) or _b(*a))
    calls = []
    kept = builds.KeptKernel(lambda **kw: calls.append(kw) or ["out"], "tiny_1", "// helpers\n", BODY, ("x", "s"),
                             ("out",), tmp_path)  # fmt: skip
    x, s = mx.zeros((2, 3), mx.bfloat16), mx.zeros((1,))
    for n in (4, 4, 8):
        assert kept(inputs=[x, s], template=[("N", n), ("K", 2)], output_dtypes=[mx.float32], grid=(32, 1, 1)) == ["out"]
    assert made == ["custom_kernel_tiny_1_4_2", "custom_kernel_tiny_1_8_2"]
    assert [c["template"][0][1] for c in calls] == [4, 4, 8] and calls[0]["grid"] == (32, 1, 1)
    assert len(list(tmp_path.glob("*.ptx"))) == 2
    # A later process (a new KeptKernel) finds the files and builds nothing.
    again = builds.KeptKernel(lambda **kw: None, "tiny_1", "// helpers\n", BODY, ("x", "s"), ("out",), tmp_path)
    again(inputs=[x, s], template=[("N", 8), ("K", 2)], output_dtypes=[mx.float32])
    assert len(made) == 2


def test_without_nvrtc_kernels_run_unkept_and_say_so_once(tmp_path, monkeypatch, capsys):
    def missing():
        raise builds.BuildError("no NVRTC library found")

    monkeypatch.setattr(builds, "_state", {})
    monkeypatch.setattr(builds, "Nvrtc", missing)
    kept = builds.KeptKernel(lambda **kw: "ran", "tiny_1", "", BODY, ("x", "s"), ("out",), tmp_path)
    for n in (1, 2):
        assert kept(inputs=[mx.zeros((2, 3)), mx.zeros(1)], template=[("N", n)], output_dtypes=[mx.float32]) == "ran"
    assert not list(tmp_path.iterdir())
    assert capsys.readouterr().err == "batchgen: kernel builds are not kept (no NVRTC library found)\n"


def test_a_folder_that_takes_no_files_stops_the_builds_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(builds, "_state", {"nvrtc": nvrtc_or_skip(), "arch": (9, 0)})
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    kept = builds.KeptKernel(lambda **kw: "ran", "tiny_1", "", BODY, ("x", "s"), ("out",), blocked)
    for n in (1, 2):
        assert kept(inputs=[mx.zeros((2, 3)), mx.zeros(1)], template=[("N", n)], output_dtypes=[mx.float32]) == "ran"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("batchgen: kernel builds are not kept (")
    assert isinstance(builds._state["nvrtc"], OSError)


def test_registry_keeps_builds_only_where_a_directory_is_set(monkeypatch, tmp_path):
    monkeypatch.setattr(registry, "available", lambda: True)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BATCHGEN_KERNEL_BUILDS", "1")
    assert registry.kept_dir() == tmp_path
    monkeypatch.setenv("BATCHGEN_KERNEL_BUILDS", "0")
    assert registry.kept_dir() is None
    monkeypatch.delenv("BATCHGEN_KERNEL_BUILDS")
    assert registry.kept_dir() == tmp_path  # kept by default
    monkeypatch.setenv("BATCHGEN_KERNEL_BUILDS", "1")
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    assert registry.kept_dir() is None


# A fresh process, so that MLX's build directory (read once per process) is this test's.
_MLX_READS_THE_KEPT_FILE = """
import mlx.core as mx
from pathlib import Path
from batchgen.kernels import builds
cache = Path(__import__("os").environ["MLX_PTX_CACHE_DIR"])
body, other = "out[threadIdx.x] = 1.0f;", "out[threadIdx.x] = 42.0f;"
x = mx.zeros((4,))
v = builds.variant("probe_{tag}", "", body, ("x",), ("out",), [x], [mx.float32])
# The kept file under this launch's module name holds another body's cubin.
w = builds.variant("probe_{tag}", "", other, ("x",), ("out",), [x], [mx.float32])
info = mx.device_info()
arch = (int(info["compute_capability_major"]), int(info["compute_capability_minor"]))
cubin, mangled = builds.Nvrtc().compile_variant(w, arch)
path = builds.ptx_path(cache, v.module_name)
path.with_suffix(".txt").write_text(f"mlx::core::cu::{{v.kernel_name}}\\t{{mangled}}\\n")
path.write_bytes(cubin)
k = mx.fast.cuda_kernel(name="probe_{tag}", input_names=["x"], output_names=["out"], source=body)
print(k(inputs=[x], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)], output_dtypes=[mx.float32])[0].tolist())
"""


@pytest.mark.cuda
def test_mlx_loads_the_build_kept_under_the_name_builds_computes(tmp_path):
    """Proves the naming matches the installed MLX's: it runs the kept cubin (42s), not
    the source it was given (ones)."""
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path))
    code = textwrap.dedent(_MLX_READS_THE_KEPT_FILE.format(tag=os.getpid()))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[-2] == "[42.0, 42.0, 42.0, 42.0]", run.stdout
