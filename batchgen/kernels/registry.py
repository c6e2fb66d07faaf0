"""batchgen's kernel ops, each declared once: its CUDA source, when it runs, its reference.

An op (`Op`) names
    source      a `.cu` file under `cuda/` (helpers from `common.cuh`, then the kernel's
                body; `load_source` expands its `#include "x.cuh"` lines) whose kernel
                MLX's `mx.fast.cuda_kernel` runs, built once per machine (`builds.py`);
    runs        the condition under which the kernel form runs, given the call's
                arguments (shapes, dtypes, head sizes); besides it a CUDA GPU must be
                the default device (`available`);
    reference   a pure-MLX function of the same arguments and outputs: what Metal and
                the CPU run, and what the kernel is tested against (one generic parity
                test over `OPS`, tests/test_kernel_registry.py);
    examples    argument sets for that test.
Calling an op runs the kernel form where `runs` holds, the reference elsewhere; `using`
pins one form (benchmarks compare the two; tests run the reference on a GPU, or stand it
in for the kernel on a CPU).
"""

from __future__ import annotations

import hashlib
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx

from .builds import KeptKernel

CUDA_DIR = Path(__file__).with_name("cuda")
BODY_MARK = "// --- body ---"
_INCLUDE = re.compile(r'^\s*#include "([^"]+)"\s*$')


def available() -> bool:
    """CUDA present and the default device a GPU (the kernels have no CPU build)."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda and cuda.is_available() and mx.default_device() == mx.gpu)


def _expand(name: str, seen: set) -> str:
    if name in seen:  # each file once per kernel (headers included twice add nothing)
        return ""
    seen.add(name)
    lines = []
    for line in (CUDA_DIR / name).read_text().splitlines():
        m = _INCLUDE.match(line)
        lines.append(_expand(m.group(1), seen) if m else line)
    return "\n".join(lines)


@lru_cache(maxsize=None)
def load_source(name: str) -> tuple[str, str]:
    """(header, body) of the kernel file `name`: its text before and after the
    `// --- body ---` line, includes expanded."""
    lines = _expand(name, set()).splitlines()
    if lines.count(BODY_MARK) != 1:
        raise ValueError(f"{name}: needs one '{BODY_MARK}' line, has {lines.count(BODY_MARK)}")
    at = lines.index(BODY_MARK)
    return "\n".join(lines[:at]).rstrip() + "\n", "\n".join(lines[at + 1 :]).strip("\n") + "\n"


_constants: dict = {}


def constant(key, make):
    """Small input arrays (kernel metadata, scales) made once per value: every layer
    of a step shares one host-to-device copy instead of making its own."""
    if key not in _constants:
        if len(_constants) > 256:
            _constants.clear()
        _constants[key] = make()
    return _constants[key]


@dataclass
class Op:
    """One kernel op (see the module docstring). `launch(*args)` is the kernel form:
    it builds the launch's inputs, grid and template and calls `kernel()`."""

    name: str
    source: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    launch: Callable
    reference: Callable
    runs: Callable[..., bool]
    examples: Callable[[], list] = field(default=lambda: [])
    tolerance: float = 1e-4  # float32 examples: largest |kernel - reference| over max |reference|
    contiguous: bool = True  # MLX copies inputs row-contiguous first (False: the body reads strides)
    mode: str = "auto"  # "auto" (runs decides), "kernel", "reference", "standin" (see `using`)

    def kernel(self):
        """The compiled kernel (built by MLX at first launch, once per template)."""
        return _cuda_kernel(self.name, self.source, self.inputs, self.outputs, self.contiguous)

    def enabled(self) -> bool:
        """Whether the kernel form may run here at all (before any shape is known)."""
        return self.mode in ("kernel", "standin") or (self.mode == "auto" and available())

    def takes(self, *args, **kw) -> bool:
        """Whether a call with these arguments runs the kernel form."""
        if self.mode in ("kernel", "reference"):
            return self.mode == "kernel"
        return self.enabled() and self.runs(*args, **kw)

    def kernel_form(self, *args, **kw):
        """The kernel form of a call that `takes`: the kernel, or under "standin" its
        reference standing in for it (CPU tests of the code around a kernel)."""
        return (self.reference if self.mode == "standin" else self.launch)(*args, **kw)

    def __call__(self, *args, **kw):
        return self.kernel_form(*args, **kw) if self.takes(*args, **kw) else self.reference(*args, **kw)


def build_name(name: str, header: str, body: str) -> str:
    """The name MLX builds a kernel under: the op's name and a digest of its source,
    so that a changed source is a new kernel by name, in profiles and in the build
    files alike (MLX's own module names hash the whole generated source too).

    >>> build_name("tq_step", "h", "b") == build_name("tq_step", "h", "b") != build_name("tq_step", "h", "b2")
    True
    """
    return f"{name}_{hashlib.sha256((header + BODY_MARK + body).encode()).hexdigest()[:12]}"


@lru_cache(maxsize=None)
def _cuda_kernel(name: str, source: str, inputs: tuple, outputs: tuple, contiguous: bool):
    header, body = load_source(source)
    built = build_name(name, header, body)
    kernel = mx.fast.cuda_kernel(name=built, input_names=list(inputs), output_names=list(outputs), source=body,
                                 header=header, ensure_row_contiguous=contiguous)  # fmt: skip
    kept = kept_dir()
    return kernel if kept is None else KeptKernel(kernel, built, header, body, inputs, outputs, kept)


# On: MLX loaded these builds on the H200, the kernels' parity tests passed on them
# there, and with them kept a fresh TurboQuant process no longer paid its kernel builds
# before its first line (bench/RESULTS.md "Kernel builds"). BATCHGEN_KERNEL_BUILDS=0
# leaves every build to MLX, in every process; a kept build that ever computed other
# than MLX's own would turn this off.
KERNEL_BUILDS_DEFAULT = "1"


def kept_dir() -> Path | None:
    """Where this process's kernel builds are kept (`keep_builds`), or None: not on
    CUDA, no build directory set, or `BATCHGEN_KERNEL_BUILDS=0` (MLX then compiles
    these ops' kernels in every process, as it does by itself)."""
    wanted = os.environ.get("BATCHGEN_KERNEL_BUILDS", KERNEL_BUILDS_DEFAULT) == "1"
    if not wanted or not os.environ.get("MLX_PTX_CACHE_DIR"):
        return None
    return Path(os.environ["MLX_PTX_CACHE_DIR"]) if available() else None


def keep_builds(root: Path | None = None) -> Path | None:
    """Keep CUDA kernel builds across processes and reboots, one directory per MLX
    version and GPU kind: a fresh process then loads what an earlier one built
    instead of compiling it again. MLX writes its own kernels' builds there; these
    ops' builds are written by `builds.KeptKernel` (MLX reads them but never writes
    them: kernels/builds.py). MLX's default is a directory under the system's
    temporary folder named by MLX's version alone, which a reboot may empty and a second GPU kind would share
    (builds are named by kernel and shape, not by device). A directory the
    user set (`MLX_PTX_CACHE_DIR`) is kept as is. Call before the first kernel
    builds; returns the directory (None off CUDA)."""
    if not available():
        return None
    if os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(os.environ["MLX_PTX_CACHE_DIR"])
    info = mx.device_info()
    kind = str(info.get("architecture") or info.get("device_name") or "gpu")
    root = root or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchgen" / "mlx-kernels"
    path = root / mx.__version__ / re.sub(r"[^A-Za-z0-9_.-]+", "-", kind)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # not writable: MLX's own default stands
        return None
    os.environ["MLX_PTX_CACHE_DIR"] = str(path)
    return path


OPS: dict[str, Op] = {}


def register(op: Op) -> Op:
    if op.name in OPS:
        raise ValueError(f"kernel op {op.name!r} is declared twice")
    if not (CUDA_DIR / op.source).is_file():
        raise ValueError(f"kernel op {op.name!r}: no source file {op.source}")
    OPS[op.name] = op
    return op


MODES = ("auto", "kernel", "reference", "standin")


@contextmanager
def using(mode: str, *names: str) -> Iterator[None]:
    """Pin ops (all of them without names) to one form for the block: "kernel",
    "reference", "auto" (the default: `runs` and a CUDA GPU decide), or "standin":
    where `runs` holds, the code around the kernel runs as on a GPU, the reference
    computing what the kernel would (CPU tests of that code)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    ops = [OPS[n] for n in names] if names else list(OPS.values())
    saved = [op.mode for op in ops]
    for op in ops:
        op.mode = mode
    try:
        yield
    finally:
        for op, m in zip(ops, saved):
            op.mode = m
