"""Builds of batchgen's kernels kept on disk, where MLX keeps its own.

MLX compiles an `mx.fast.cuda_kernel` with NVRTC the first time a process launches it
(once per template and dtypes) and, unlike its own kernels, never writes that build to its
build directory (`MLX_PTX_CACHE_DIR`; mlx/backend/cuda/custom_kernel.cpp passes
`use_disk_cache=false`). It does read the directory first, under the module name
`{kernel name}_{std::hash(source):x}`. So every process paid NVRTC for every kernel
variant it ran again (bench/RESULTS.md#kernel-builds): TurboQuant, with its encoders and
step kernel, most of all.

This module writes those files itself, before MLX's first launch of a variant: the
source MLX generates for that launch (`Variant.source`, after its `build_kernel`), its
module name (`Variant.module_name`), compiled by the NVRTC library MLX links (for the device's
architecture, as MLX compiles) into the two files MLX reads (`<module>.ptx`, the cubin,
and `<module>.txt`, the kernel's mangled name). The first process on a machine pays the
compile as before; every later one loads the cubin.

What would change this: MLX writing custom kernels' builds itself (then this is
redundant), or a change to how it names or generates them. A name that no longer matches
is a miss: MLX compiles as before, never loads a wrong build, since the name hashes the
whole source. The header MLX's source includes (`mlx/backend/cuda/device/utils.cuh`,
compiled into libmlx) is stood in for by `UTILS_CUH`: the kernels here use only its types
`Shape` and `Strides`, which must keep MLX's layout (arrays of MAX_NDIM = 10 int32 and
int64) for kernels that read shapes or strides (tq_step, projection).
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import mlx.core as mx

# The header MLX puts before every custom kernel's own (custom_kernel.cpp: default_header).
DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
UTILS_NAME = "mlx/backend/cuda/device/utils.cuh"
UTILS_CUH = """#pragma once
#include <cuda/std/complex>
#include <cuda/std/type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
#define MAX_NDIM 10
namespace mlx::core::cu {
struct Shape { int d[MAX_NDIM]; __device__ int operator[](int i) const { return d[i]; } };
struct Strides { long long d[MAX_NDIM]; __device__ long long operator[](int i) const { return d[i]; } };
}
"""

# mlx/backend/cuda/utils.cpp: dtype_to_cuda_type
CUDA_TYPES = {
    "bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
    "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double",
}  # fmt: skip
MAX_FILE_NAME = 245  # jit_module.cpp: get_ptx_path splits longer module names into folders


def std_hash(data: bytes) -> int:
    """libstdc++'s `std::hash<std::string>` on 64-bit targets (`_Hash_bytes`, a MurmurHash2
    variant with seed 0xc70f6907): how MLX names a custom kernel's module.

    >>> f"{std_hash(b'abc'):x}"
    '32d82bf8ed3dba39'
    """
    mask = (1 << 64) - 1
    mul = (0xC6A4A793 << 32) + 0x5BD1E995

    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    aligned = n & ~7
    h = (0xC70F6907 ^ (n * mul)) & mask
    for i in range(0, aligned, 8):
        k = int.from_bytes(data[i : i + 8], "little")
        h ^= (shift_mix((k * mul) & mask) * mul) & mask
        h = (h * mul) & mask
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * mul) & mask
    h = (shift_mix(h) * mul) & mask
    return shift_mix(h)


@dataclass(frozen=True)
class Variant:
    """One launch's build: what MLX's source for it depends on."""

    name: str  # the name given to mx.fast.cuda_kernel
    header: str
    body: str
    input_names: tuple
    inputs: tuple  # (dtype name, ndim) per input
    output_names: tuple
    output_dtypes: tuple  # dtype names
    template: tuple  # ((name, int), ...)

    @property
    def kernel_name(self) -> str:
        """custom_kernel.cpp: "custom_kernel_" + name + template_arguments_hash."""
        return "custom_kernel_" + self.name + "".join(f"_{v}" for _, v in self.template)

    @cached_property
    def source(self) -> str:
        """The whole source MLX builds for this launch (custom_kernel.cpp: build_kernel)."""
        parts = [DEFAULT_HEADER, self.header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"]
        parts.append(f"__global__ void {self.kernel_name}(\n")
        for name, (dtype, ndim) in zip(self.input_names, self.inputs):
            parts.append(f"    const {CUDA_TYPES[dtype]}* {name},\n")
            if ndim > 0:
                for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                    if name + suffix in self.body:
                        parts.append(f"    const __grid_constant__ {kind} {name}{suffix},\n")
        for i, (name, dtype) in enumerate(zip(self.output_names, self.output_dtypes)):
            parts.append(f"    {CUDA_TYPES[dtype]}* {name}" + (",\n" if i < len(self.output_names) - 1 else ") {\n"))
        if self.template:
            parts.extend(f"  constexpr int {k} = {v};\n" for k, v in self.template)
            parts.append("\n")
        parts.append(self.body + "\n}\n\n} // namespace mlx::core::cu\n")
        return "".join(parts)

    @cached_property
    def module_name(self) -> str:
        """custom_kernel.cpp: fmt::format("{}_{:x}", name_, std::hash<std::string>{}(source_))."""
        return f"{self.kernel_name}_{std_hash(self.source.encode()):x}"


def variant(name: str, header: str, body: str, input_names, output_names, inputs, output_dtypes,
            template=()) -> Variant | None:  # fmt: skip
    """The build a launch with these arguments needs, or None where this module does not
    know how MLX would name it (then MLX builds it as before)."""
    try:
        ins = tuple((str(a.dtype).removeprefix("mlx.core."), a.ndim) for a in inputs)
        outs = tuple(str(d).removeprefix("mlx.core.") for d in output_dtypes)
    except AttributeError:  # a Python scalar among the inputs
        return None
    if any(d not in CUDA_TYPES for d, _ in ins) or any(d not in CUDA_TYPES for d in outs):
        return None
    if not all(type(v) is int for _, v in template):  # MLX writes bools and dtypes differently
        return None
    return Variant(name, header, body, tuple(input_names), ins, tuple(output_names), outs,
                   tuple((k, v) for k, v in template))  # fmt: skip


def ptx_path(cache_dir: Path, module: str) -> Path:
    """Where MLX looks for a module's build (jit_module.cpp: get_ptx_path).

    >>> str(ptx_path(Path("/c"), "k_1"))
    '/c/k_1.ptx'
    >>> str(ptx_path(Path("/c"), "a" * 250)).count("/")
    3
    """
    path, offset = cache_dir, 0
    while len(module) - offset > MAX_FILE_NAME:
        path = path / module[offset : offset + MAX_FILE_NAME]
        offset += MAX_FILE_NAME
    return path / (module[offset:] + ".ptx")


# --------------------------------------------------------------------------------------
# NVRTC


class BuildError(Exception):
    """NVRTC is missing or did not compile a kernel (the message says which and why)."""


def _site_dirs() -> list[Path]:
    return [Path(p) for p in sys.path if p and Path(p).is_dir()]


def _nvrtc_paths() -> list[str]:
    """Where libnvrtc may be: `BATCHGEN_NVRTC`, the name MLX's library links (already
    loaded in a CUDA process), pip's nvidia packages."""
    paths = [os.environ["BATCHGEN_NVRTC"]] if os.environ.get("BATCHGEN_NVRTC") else []
    paths += ["libnvrtc.so.13", "libnvrtc.so.12"]
    for site in _site_dirs():
        for sub in ("cu13", "cuda_nvrtc"):
            lib = site / "nvidia" / sub / "lib"
            if lib.is_dir():
                paths += sorted(str(p) for p in lib.glob("libnvrtc.so.*") if "alt" not in p.name)
    return paths


def include_dirs() -> list[str]:
    """Header folders, as MLX's `include_path_args` finds them: MLX's bundled headers
    (CCCL among them), pip's CUDA runtime headers (and pip's CCCL), else CUDA_HOME /
    CUDA_PATH / /usr/local/cuda (and its cccl/)."""
    dirs = []
    mlx_dir = Path(mx.__file__).parent
    for d in (mlx_dir / "include", mlx_dir / "include" / "cccl"):
        if d.is_dir():
            dirs.append(str(d))
    for site in [mlx_dir.parent, *_site_dirs()]:
        for sub in ("cu13", "cuda_runtime"):
            inc = site / "nvidia" / sub / "include"
            if (inc / "cuda_fp16.h").is_file():  # pip's CCCL package puts its headers under cccl/
                return dirs + [str(d) for d in (inc, inc / "cccl") if d.is_dir()]
    home = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda") / "include"
    return dirs + [str(d) for d in (home, home / "cccl") if d.is_dir() and str(d) not in dirs]


class Nvrtc:
    """The NVRTC library, through ctypes: source in, cubin and mangled name out."""

    def __init__(self, path: str | None = None):
        errors = []
        for candidate in [path] if path else _nvrtc_paths():
            try:
                # libnvrtc opens its builtins library by name at the first compile: where it
                # lies beside it (pip's package, not on the loader's path), load that first.
                folder = Path(candidate).parent
                for builtins in sorted(folder.glob("libnvrtc-builtins.so.*")) if folder != Path(".") else []:
                    if "alt" not in builtins.name:
                        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                self.lib = ctypes.CDLL(candidate)
                self.path = candidate
                break
            except OSError as e:
                errors.append(str(e))
        else:
            raise BuildError(f"no NVRTC library found ({'; '.join(errors[-2:])})")
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, code: int, what: str, log: str = "") -> None:
        if code != 0:
            raise BuildError(f"{what}: {self.lib.nvrtcGetErrorString(code).decode()}{log}")

    def compile(self, source: str, kernel: str, arch: tuple[int, int], headers: dict | None = None) -> tuple[bytes, str]:
        """(cubin, mangled name of `kernel`) for compute capability `arch`, with MLX's
        flags (jit_module.cpp: compile): the device's own architecture, `a` from 9.0."""
        lib, prog = self.lib, ctypes.c_void_p()
        headers = headers or {}
        hdr = (ctypes.c_char_p * max(len(headers), 1))(*[v.encode() for v in headers.values()])
        names = (ctypes.c_char_p * max(len(headers), 1))(*[k.encode() for k in headers])
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", len(headers), hdr, names),
                    "nvrtcCreateProgram")  # fmt: skip
        try:
            expr = f"mlx::core::cu::{kernel}".encode()
            self._check(lib.nvrtcAddNameExpression(prog, expr), "nvrtcAddNameExpression")
            major, minor = arch
            arch_flag = f"--gpu-architecture=sm_{major}{minor}{'a' if major >= 9 else ''}"
            opts = ["--device-as-default-execution-space", arch_flag]
            opts += [f"--include-path={d}" for d in include_dirs()]
            argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
            code = lib.nvrtcCompileProgram(prog, len(opts), argv)
            if code != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, log)
                self._check(code, f"compiling {kernel}", "\n" + log.value.decode(errors="replace")[:4000])
            mangled = ctypes.c_char_p()
            self._check(lib.nvrtcGetLoweredName(prog, expr, ctypes.byref(mangled)), "nvrtcGetLoweredName")
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw, mangled.value.decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def compile_variant(self, v: Variant, arch: tuple[int, int]) -> tuple[bytes, str]:
        """`compile` of a launch's source, MLX's device header stood in for (`UTILS_CUH`)."""
        return self.compile(v.source, v.kernel_name, arch, {UTILS_NAME: UTILS_CUH})


def build(nvrtc: Nvrtc, v: Variant, arch: tuple[int, int], cache_dir: Path) -> Path:
    """Compile `v` and write MLX's two files for it (the mangled name first, the cubin
    last by rename: MLX takes a module as present once its `.ptx` exists). Returns the
    `.ptx` path."""
    path = ptx_path(cache_dir, v.module_name)
    cubin, mangled = nvrtc.compile_variant(v, arch)
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, data in ((path.with_suffix(".txt"), f"mlx::core::cu::{v.kernel_name}\t{mangled}\n".encode()),
                         (path, cubin)):  # fmt: skip
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)  # another process writing the same file at once writes the same bytes
    return path


# --------------------------------------------------------------------------------------
# At launch


class KeptKernel:
    """An `mx.fast.cuda_kernel` whose builds this module writes to MLX's build directory
    before MLX's first launch of each variant (then MLX loads them: in this process and
    every later one). Calls pass through unchanged."""

    def __init__(self, kernel, name: str, header: str, body: str, input_names, output_names, cache_dir: Path):
        self.kernel, self.name, self.header, self.body = kernel, name, header, body
        self.input_names, self.output_names, self.cache_dir = tuple(input_names), tuple(output_names), cache_dir
        self.seen: set = set()

    def __call__(self, *, inputs, template=(), output_dtypes=(), **kw):
        # Keyed by what tells these ops' variants apart (the constants, the first input's
        # and output's dtypes), not by every input's dtype, which costs a launch several
        # times more host time. A variant the key misses is MLX's to build, as before.
        key = (tuple(template), getattr(inputs[0], "dtype", None), output_dtypes[0] if output_dtypes else None)
        if key not in self.seen:
            self.seen.add(key)
            ensure(self, inputs, template, output_dtypes)
        return self.kernel(inputs=inputs, template=template, output_dtypes=output_dtypes, **kw)


_state: dict = {}  # "nvrtc": Nvrtc or the BuildError that stopped it; "arch"


def ensure(k: KeptKernel, inputs, template, output_dtypes) -> Path | None:
    """Write `k`'s build for this launch unless it is there; None where it cannot be made
    (reported once on stderr: MLX then builds it itself, as it always did)."""
    v = variant(k.name, k.header, k.body, k.input_names, k.output_names, inputs, output_dtypes, template)
    if v is None:
        return None
    path = ptx_path(k.cache_dir, v.module_name)
    if path.is_file():
        return path
    if "nvrtc" not in _state:
        try:
            _state["nvrtc"] = Nvrtc()
            info = mx.device_info()
            _state["arch"] = (int(info["compute_capability_major"]), int(info["compute_capability_minor"]))
        except (BuildError, KeyError, ValueError) as e:
            _state["nvrtc"] = e
            print(f"batchgen: kernel builds are not kept ({e})", file=sys.stderr)
    if isinstance(_state["nvrtc"], Exception):
        return None
    try:
        return build(_state["nvrtc"], v, _state["arch"], k.cache_dir)
    except BuildError as e:
        print(f"batchgen: kernel {k.name} not kept ({str(e).splitlines()[0]})", file=sys.stderr)
    except OSError as e:  # the folder takes no files: none of the next builds would land either
        _state["nvrtc"] = e
        print(f"batchgen: kernel builds are not kept ({e})", file=sys.stderr)
    return None
