"""Load-time weight fusion: q/k/v and gate/up projections run as one matmul.

Decode at small batch is bound by kernel launches and per-kernel overhead, not by
FLOPs, so three GEMVs over q/k/v (and two over gate/up) cost more than one GEMV
over their concatenation. `fuse_model` rewrites a loaded mlx-lm model in place:

* Projections are found by structure: any module whose children include
  `q_proj`, `k_proj`, `v_proj` (or `gate_proj`, `up_proj`) of one supported layer
  type with matching input size and quantization. This covers dense MLPs, shared
  experts and `SwitchGLU` experts (`SwitchLinear` / `QuantizedSwitchLinear`)
  without touching any architecture's code.
* The owner gets one fused child (`qkv_proj` / `gate_up_proj`) of the same class,
  whose arrays are the parts' arrays concatenated along the output axis. For
  quantized layers this is exact: quantization groups run along the input axis,
  so every output row keeps its own weights, scales and biases.
* The old children become `FusedSlice` modules. The model code still calls
  `self.q_proj(x)`, `self.k_proj(x)`, `self.v_proj(x)`; the first call runs the
  fused projection on `x` and splits its last axis, the others return their part
  of that same result (matched by the identity of `x`, and of the expert
  indices for switch layers). One matmul per group per forward pass.
* Each fused array is evaluated into its own buffer, then the originals are
  dropped and the allocator cache cleared, group by group: resident memory stays
  that of the unfused model and the peak adds at most one group's weights.

Layout: the fused output is `[q | k | v]` along the last axis and the parts are
`mx.split` views. With one token (B = L = 1, plain decode) every part is a
row-contiguous view, so nothing downstream copies it. With more rows a part is
strided; kernels that need row-contiguous input (e.g. rms_norm of qwen3's q/k
norms, RoPE of a >3-D strided input on CUDA) then copy that part, which costs
one small copy kernel next to the two matmul launches saved.

`BATCHGEN_KEEP_FALLBACK=1` keeps the original projections alive next to the
fused ones (memory grows by their size) so `use_fallback` can route calls back
to them for parity bisects.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

KEEP_FALLBACK_ENV = "BATCHGEN_KEEP_FALLBACK"

# Output axis of each supported projection type: the axis the parts are
# concatenated along. Exact types only: a subclass (e.g. a LoRA wrapper) may
# compute something the concatenation does not preserve. A tensor-parallel
# rank's q/k/v and gate/up (mlx-lm's `model.shard`: `AllToSharded`, each rank
# its slice of the heads and of the MLP's width, no collective in the forward
# pass) fuse like any linear layer: the concatenation of a rank's slices is
# its slice of the fused projection, one matmul per shard.
_OUTPUT_AXIS = {
    nn.Linear: 0,
    nn.QuantizedLinear: 0,
    nn.AllToShardedLinear: 0,
    nn.QuantizedAllToShardedLinear: 0,
    SwitchLinear: 1,
    QuantizedSwitchLinear: 1,
}
_SWITCH_TYPES = (SwitchLinear, QuantizedSwitchLinear)
_QUANTIZED_TYPES = (nn.QuantizedLinear, nn.QuantizedAllToShardedLinear, QuantizedSwitchLinear)

# Quantized groups stay separate unless asked (`fuse_model(quantized=True)`): on
# the H200 a fused quantized_matmul measured 1.04x (7B, 4 bits) and 1.00x
# (qwen3_moe) one job's decode, the 2-core CPU 0.99-1.04x, against 1.20-1.58x
# for bf16 weights (bench/RESULTS.md#fusion): below the 5% a kept change needs.
# Metal figures showing a gain would change it. Dense weights (a quantized
# model dequantized at load, transforms/quantized.py) fuse as bf16 ones do.
QUANTIZED_SKIP = "quantized q/k/v and gate/up not fused (fused quantized_matmul 1.00-1.04x; bench/RESULTS.md#fusion)"

# Children that mean "these projections are already one matmul" (phi3, gpt2,
# falcon, the recurrent layers of qwen3_5 / qwen3_next, ...).
_PREFUSED_NAMES = (
    "qkv_proj",
    "gate_up_proj",
    "Wqkv",
    "wqkv",
    "c_attn",
    "query_key_value",
    "in_proj_qkv",
    "in_proj_qkvz",
)


@dataclass(frozen=True)
class _Group:
    kind: str  # the FusionReport counter it adds to
    parts: tuple[str, ...]
    fused_name: str


_QKV = _Group("qkv", ("q_proj", "k_proj", "v_proj"), "qkv_proj")
_GATE_UP = _Group("gate_up", ("gate_proj", "up_proj"), "gate_up_proj")


@dataclass(frozen=True)
class FusionReport:
    qkv: int = 0
    gate_up: int = 0
    experts: int = 0
    skipped: tuple[str, ...] = ()
    bytes_freed: int = 0

    def as_dict(self) -> dict:
        return {
            "qkv": self.qkv,
            "gate_up": self.gate_up,
            "experts": self.experts,
            "skipped": list(self.skipped),
            "bytes_freed": self.bytes_freed,
        }


class _SharedOutput:
    """The fused projection's output for the latest input, shared by its parts.

    Holds the input itself (not its id) so the identity check cannot be fooled
    by a recycled id, and forgets both once every part has taken its slice so no
    activation outlives the forward pass.
    """

    def __init__(self, owner: nn.Module, fused_name: str, split_points: list[int]):
        # A weak reference: the owner holds the slices, the slices hold this.
        # Looking the fused module up at call time also follows later swaps of
        # it (e.g. `nn.quantize` of a fused float model).
        self._owner = weakref.ref(owner)
        self._fused_name = fused_name
        self._split_points = split_points
        self._all_taken = (1 << (len(split_points) + 1)) - 1
        self._clear()

    def _clear(self):
        self._x = None
        self._args = ()
        self._kwargs = {}
        self._parts = None
        self._taken = 0

    def _matches(self, x, args, kwargs) -> bool:
        if x is not self._x or self._parts is None:
            return False
        if not args and not kwargs:  # dense projections: the hot path
            return not self._args and not self._kwargs
        if len(args) != len(self._args):
            return False
        if any(a is not b for a, b in zip(args, self._args)):
            return False
        return kwargs.keys() == self._kwargs.keys() and all(
            _same(v, self._kwargs[k]) for k, v in kwargs.items()
        )

    def part(self, index: int, x: mx.array, args: tuple, kwargs: dict) -> mx.array:
        if not self._matches(x, args, kwargs):
            fused = self._owner()[self._fused_name]
            y = fused(x, *args, **kwargs)
            self._parts = mx.split(y, self._split_points, axis=-1)
            self._x, self._args, self._kwargs = x, args, kwargs
            self._taken = 0
        out = self._parts[index]
        self._taken |= 1 << index
        if self._taken == self._all_taken:
            self._clear()
        return out


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, mx.array) or isinstance(b, mx.array):
        return False
    return a == b


class FusedSlice(nn.Module):
    """Stands where one original projection was; returns its part of the fused one."""

    def __init__(self, shared: _SharedOutput, index: int, start: int, stop: int):
        super().__init__()
        self._shared = shared
        self.index = index
        self.start = start
        self.stop = stop
        # Kept out of the parameter tree on purpose: `model.parameters()` and
        # nbytes accounting describe the fused model that actually runs.
        object.__setattr__(self, "_fallback", None)
        self.use_fallback = False

    def _extra_repr(self) -> str:
        return f"{self._shared._fused_name}[{self.start}:{self.stop}]"

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        if self.use_fallback:
            return self._fallback(x, *args, **kwargs)
        return self._shared.part(self.index, x, args, kwargs)


def _keep_fallback_from_env() -> bool:
    return os.environ.get(KEEP_FALLBACK_ENV, "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )


def _hyperparams(module: nn.Module) -> dict:
    """Non-array settings that must agree (bits, group_size, mode, ...)."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_")}


def _check_parts(names: tuple[str, ...], mods: list[nn.Module]) -> Optional[str]:
    """Why `mods` cannot be concatenated, or None when they can."""
    types = [type(m) for m in mods]
    label = "/".join(names)
    if any(isinstance(m, FusedSlice) for m in mods):
        return f"{label}: already fused"
    if len(set(types)) != 1:
        return f"{label}: mixed layer types ({', '.join(t.__name__ for t in types)})"
    if types[0] not in _OUTPUT_AXIS:
        return f"{label}: unsupported layer type {types[0].__name__}"
    settings = [_hyperparams(m) for m in mods]
    differing = sorted(
        {k for s in settings for k in s if any(t.get(k) != s.get(k) for t in settings)}
    )
    if differing:
        shown = ", ".join(
            f"{k} {'/'.join(str(s.get(k)) for s in settings)}" for k in differing
        )
        return f"{label}: mismatched quantization ({shown})"
    keys = [set(m.keys()) for m in mods]
    if any(k != keys[0] for k in keys[1:]):
        return f"{label}: mismatched parameters ({', '.join(sorted(set.union(*keys)))})"
    axis = _OUTPUT_AXIS[types[0]]
    for key in sorted(keys[0]):
        arrays = [m[key] for m in mods]
        if not all(isinstance(a, mx.array) for a in arrays):
            return f"{label}: unsupported parameter {key}"
        if len({a.dtype for a in arrays}) != 1:
            return f"{label}: mismatched dtypes for {key}"
        if arrays[0].ndim > axis:
            rest = {a.shape[:axis] + a.shape[axis + 1 :] for a in arrays}
            if len(rest) != 1:
                shapes = ", ".join(str(a.shape) for a in arrays)
                return f"{label}: mismatched input size ({key} shapes {shapes})"
        elif any(not mx.array_equal(a, arrays[0]).item() for a in arrays[1:]):
            # A per-layer constant (e.g. an nvfp4 global scale) that differs
            # between the parts cannot be shared by one fused layer.
            return f"{label}: different {key} per projection"
    return None


def _concatenate(mods: list[nn.Module]) -> nn.Module:
    """A new module of the parts' class whose arrays are theirs concatenated."""
    cls = type(mods[0])
    axis = _OUTPUT_AXIS[cls]
    fused = cls.__new__(cls)
    nn.Module.__init__(fused)
    for key, value in vars(mods[0]).items():
        object.__setattr__(fused, key, set(value) if isinstance(value, set) else value)
    for key in mods[0].keys():
        arrays = [m[key] for m in mods]
        fused[key] = (
            mx.concatenate(arrays, axis=axis) if arrays[0].ndim > axis else arrays[0]
        )
    return fused


def _output_sizes(mods: list[nn.Module]) -> list[int]:
    return [m["weight"].shape[_OUTPUT_AXIS[type(m)]] for m in mods]


def _nbytes(module: nn.Module) -> int:
    return sum(v.nbytes for v in module.values() if isinstance(v, mx.array))


def _fuse_group(
    owner: nn.Module, group: _Group, keep_fallback: bool
) -> tuple[Optional[str], int]:
    """Fuse one group in `owner`; return (skip reason or None, bytes freed)."""
    mods = [owner[name] for name in group.parts]
    reason = _check_parts(group.parts, mods)
    if reason is not None:
        return reason, 0
    if group.fused_name in owner:
        return f"{group.fused_name} already exists next to {'/'.join(group.parts)}", 0

    fused = _concatenate(mods)
    # Own buffers now, so dropping the parts below really releases their memory.
    mx.eval(fused.parameters())

    sizes = _output_sizes(mods)
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    shared = _SharedOutput(owner, group.fused_name, bounds[1:-1])
    setattr(owner, group.fused_name, fused)
    freed = 0
    for i, (name, original) in enumerate(zip(group.parts, mods)):
        part = FusedSlice(shared, i, bounds[i], bounds[i + 1])
        if keep_fallback:
            object.__setattr__(part, "_fallback", original)
        else:
            freed += _nbytes(original)
        setattr(owner, name, part)
    return None, freed


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that own (some of) a q/k/v or gate/up group, or a pre-fused one.

    Only owners are returned: holding the leaf projections here would keep the
    originals alive after they are replaced.
    """
    names = set(_QKV.parts) | set(_GATE_UP.parts) | set(_PREFUSED_NAMES)
    owners = [
        (path or "<model>", m)
        for path, m in model.named_modules()
        if any(isinstance(m.get(n), nn.Module) for n in names)
    ]
    # named_modules() walks a stack (last layer first); go layer 0 upwards so
    # the report reads in model order.
    return sorted(owners, key=lambda item: _path_key(item[0]))


def _path_key(path: str) -> tuple:
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in path.split("."))


def _children(owner: nn.Module, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if isinstance(owner.get(n), nn.Module)]


def fuse_model(model: nn.Module, keep_fallback: bool | None = None, quantized: bool = False) -> FusionReport:
    """Fuse q/k/v and gate/up projections of `model` in place (see module doc);
    quantized groups only with `quantized` (`QUANTIZED_SKIP` says why: one line
    in `skipped` with their count).

    `keep_fallback=None` reads `BATCHGEN_KEEP_FALLBACK`. Never raises because a
    model has nothing to fuse: what was left alone is listed in `skipped`.
    """
    if keep_fallback is None:
        keep_fallback = _keep_fallback_from_env()
    counts = {"qkv": 0, "gate_up": 0, "experts": 0}
    skipped: list[str] = []
    bytes_freed = 0
    quantized_left = 0

    for path, owner in _candidates(model):
        for group in (_QKV, _GATE_UP):
            present = _children(owner, group.parts)
            if not present:
                continue
            if len(present) != len(group.parts):
                missing = sorted(set(group.parts) - set(present))
                skipped.append(
                    f"{path}: {'/'.join(present)} without {'/'.join(missing)}"
                )
                continue
            if not quantized and type(owner[group.parts[0]]) in _QUANTIZED_TYPES:
                quantized_left += 1
                continue
            is_switch = isinstance(owner[group.parts[0]], _SWITCH_TYPES)
            reason, freed = _fuse_group(owner, group, keep_fallback)
            if reason is not None:
                skipped.append(f"{path}: {reason}")
                continue
            bytes_freed += freed
            counts["experts" if is_switch else group.kind] += 1
            if not keep_fallback:
                # Freed buffers rarely fit the next fused size; without this the
                # allocator cache would grow to a second copy of the weights.
                mx.clear_cache()
        prefused = _children(owner, _PREFUSED_NAMES)
        if prefused and not _children(owner, _QKV.parts + _GATE_UP.parts):
            skipped.append(f"{path}: already one projection ({', '.join(prefused)})")

    if quantized_left:
        skipped.append(f"<model>: {quantized_left} {QUANTIZED_SKIP}")
    if not any(counts.values()) and not skipped:
        skipped.append("<model>: no q/k/v or gate/up projections found")
    return FusionReport(
        qkv=counts["qkv"],
        gate_up=counts["gate_up"],
        experts=counts["experts"],
        skipped=tuple(skipped),
        bytes_freed=bytes_freed,
    )


def use_fallback(model: nn.Module, enabled: bool = True) -> int:
    """Route fused slices to the kept original projections (parity bisects).

    Returns how many slices were switched; raises if `model` was fused without
    keeping its fallback.
    """
    slices = [m for _, m in model.named_modules() if isinstance(m, FusedSlice)]
    if enabled and any(s._fallback is None for s in slices):
        raise ValueError(
            f"fused without a fallback; set {KEEP_FALLBACK_ENV}=1 before fusing"
        )
    for s in slices:
        s.use_fallback = enabled
    return len(slices)
