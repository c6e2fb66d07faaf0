"""Load-time routing of quantized layers: `quantized_matmul` for few rows, a
dequantized weight and a dense matmul for many.

MLX's quantized layers always call `mx.quantized_matmul` (`gather_qmm` for
experts). On MLX's CUDA backend that op is the faster one for a few rows and
the slower one, several times over, for hundreds of rows (prompt passes, big
batch steps), where dequantizing the weight and handing the product to cuBLAS
wins: bench/RESULTS.md#quantized-weights-on-cuda.
`route_quantized(model, rows)` swaps each quantized layer for a subclass that
picks the op by the row count of its input:

    rows >= dequantize_rows:  x @ dequantize(w).T (+ bias)   (gather_mm for experts)
    else:                     the layer's own op

The row count is part of the traced shape, so a compiled step or pass records
one branch and stays compiled. `rows` None (or 0) leaves the model untouched.
Rows are the flattened leading axes of the input; for experts, the rows each
expert sees on average (indices / experts, rounded up), the size of each product.

The layers swapped: nn.QuantizedLinear (fused ones too: fusion keeps the
class), mlx-lm's QuantizedSwitchLinear, and nn.QuantizedEmbedding's
`as_linear` (a tied head). Exact types only, as fusion does: a subclass (a
tensor-parallel shard, a LoRA wrapper) may do more than the product. Do this
after fusion, whose checks want exact types too.

Both forms compute the same product with a different rounding (the dense one
rounds the dequantized weight to the activations' dtype first): in float32 on
the CPU they agree to ~1e-5 relative (tests/test_quantized.py).

`dense_weights(model)` goes one step further, before fusion: every quantized
layer becomes its dense counterpart (nn.Linear, nn.Embedding, SwitchLinear)
holding the dequantized weight, once, at load. The model then takes the dense
paths (fusion, the batch step's projection kernel) at the dense model's memory.
`wants_dense` decides it: on MLX's CUDA backend, when the dense weights fit a
share of the device's memory (`DENSE_MEMORY_SHARE`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

# Rows from which a quantized product runs dense on MLX's CUDA backend ("auto"):
# measured, quantized_matmul wins at 1 row, is even at 32 (over a layer's three
# products) and loses from 256 on; 64 is near the crossing of the two. A probe at
# 64 and 128 rows, or a device where the crossing differs, would change it.
CUDA_DEQUANTIZE_ROWS = 64


# "auto" dequantizes a quantized model's weights at load on MLX's CUDA backend
# when the dense weights take at most this share of the device's memory. There a
# dense matmul beat quantized_matmul at every row count measured, 1 to 2,048 (a
# 7B layer at 1 row: .246 against .284 ms; at 32: .336 against .794;
# bench/RESULTS.md#quantized-weights-on-cuda), and the dense model takes the
# bf16 paths. The share leaves the rest to the KV rows of big batches (a 7B at
# 4 bits: 15 GB dense on a 141 GB H200). A quantized kernel that wins at few
# rows, or a device where memory is the limit, would change it; `--dense-weights
# off` keeps the quantized layers (and the per-row route above).
DENSE_MEMORY_SHARE = 0.25


def default_rows() -> int | None:
    """"auto": `CUDA_DEQUANTIZE_ROWS` on MLX's CUDA backend, else None. Metal's
    quantized kernels are tuned for every row count and we have no Metal figures
    saying otherwise; on the CPU the dense form only costs memory traffic."""
    return CUDA_DEQUANTIZE_ROWS if on_cuda() else None


def resolve_rows(setting) -> int | None:
    """The threshold a setting stands for: an int >= 1, "auto" (`default_rows`),
    or None / 0 / "off" (no routing)."""
    if setting == "auto":
        return default_rows()
    if setting is None or setting == "off" or setting == 0:
        return None
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
        raise ValueError(f"dequantize_rows: a row count >= 0, 'auto' or 'off', got {type(setting).__name__} {setting!r}")
    return setting


def rows_of(x: mx.array) -> int:
    """The rows of a product over x (..., in): its leading axes flattened."""
    return math.prod(x.shape[:-1])


def dense(threshold: int | None, rows: int) -> bool:
    """The routing rule: the dense form from `threshold` rows on (None: never)."""
    return threshold is not None and rows >= threshold


def dequantized(module: nn.Module, dtype) -> mx.array:
    """A quantized layer's weight as a dense (..., out, in) array of `dtype`."""
    kw = {}
    if module.get("global_scale") is not None:  # nvfp4 experts' per-tensor scale
        kw["global_scale"] = module["global_scale"]
    return mx.dequantize(module["weight"], module["scales"], module.get("biases"), module.group_size, module.bits,
                         mode=module.mode, dtype=dtype, **kw)  # fmt: skip


def project(module: nn.Module, x: mx.array, threshold: int | None) -> mx.array:
    """x @ w.T (+ bias) through a quantized (out, in) layer: dense from
    `threshold` rows on, else `quantized_matmul`."""
    bias = module.get("bias")
    if dense(threshold, rows_of(x)):
        w_t = dequantized(module, x.dtype).T
        return x @ w_t if bias is None else mx.addmm(bias, x, w_t)
    y = mx.quantized_matmul(x, module["weight"], module["scales"], module.get("biases"), transpose=True,
                            group_size=module.group_size, bits=module.bits, mode=module.mode)  # fmt: skip
    return y if bias is None else y + bias


class RoutedQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product is `project`'s."""

    dequantize_rows: int | None = None

    def __call__(self, x):
        return project(self, x, self.dequantize_rows)


class RoutedQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose `as_linear` (a tied head) is `project`'s."""

    dequantize_rows: int | None = None

    def as_linear(self, x):
        return project(self, x, self.dequantize_rows)


class RoutedQuantizedSwitchLinear(QuantizedSwitchLinear):
    """mlx-lm's QuantizedSwitchLinear: dense (`gather_mm` over every expert's
    dequantized weight) where the experts average `dequantize_rows` rows each."""

    dequantize_rows: int | None = None

    def __call__(self, x, indices, sorted_indices=False):
        if not dense(self.dequantize_rows, -(-indices.size // self.num_experts)):
            return super().__call__(x, indices, sorted_indices=sorted_indices)
        x = mx.gather_mm(x, dequantized(self, x.dtype).swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)  # fmt: skip
        if "bias" in self:
            x = x + mx.expand_dims(self["bias"][indices], -2)
        return x


def _dense_dtype(module: nn.Module, fallback) -> mx.Dtype:
    """The dtype a quantized layer's dense weight takes: its affine scales'
    (the dtype its products run in), or, for the fp modes (mxfp4, nvfp4, mxfp8),
    whose scales are uint8 exponents, `fallback` (the model's own float dtype)."""
    dtype = module["scales"].dtype
    return dtype if mx.issubdtype(dtype, mx.floating) else fallback


def float_dtype(model: nn.Module) -> mx.Dtype:
    """The floating dtype most of `model`'s non-quantized parameters have (the
    norms', at least; float32 where it has none)."""
    from mlx.utils import tree_flatten

    quantized = tuple(f"{path}." for path, m in model.named_modules() if _is_quantized(m))
    counts: dict = {}
    for key, a in tree_flatten(model.parameters()):
        if not key.startswith(quantized) and mx.issubdtype(a.dtype, mx.floating):
            counts[a.dtype] = counts.get(a.dtype, 0) + a.size
    return max(counts, key=counts.get) if counts else mx.float32


def _dense_twin(module: nn.Module, fallback) -> nn.Module:
    """A quantized layer's dense counterpart holding its dequantized weight (in
    `_dense_dtype`) and its bias."""
    weight = dequantized(module, _dense_dtype(module, fallback))
    if isinstance(module, nn.QuantizedEmbedding):
        out = nn.Embedding(*weight.shape)
    elif isinstance(module, QuantizedSwitchLinear):
        out = SwitchLinear(weight.shape[-1], weight.shape[-2], weight.shape[0], bias="bias" in module)
    else:
        out = nn.Linear(weight.shape[-1], weight.shape[-2], bias="bias" in module)
    out.weight = weight
    if "bias" in module:
        out.bias = module["bias"]
    return out


def _quantized_layers(model: nn.Module) -> tuple[list, dict, set]:
    """(path, layer) of the layers this module handles (exact types, routed ones
    too), the other quantized layers by type name, and every quantization mode."""
    found, skipped, modes = [], {}, set()
    for path, m in model.named_modules():
        if not _is_quantized(m):
            continue
        modes.add(f"{m.mode}-{m.bits}-{m.group_size}")
        if type(m) in _ROUTED or type(m) in _KIND:
            found.append((path, m))
        else:
            skipped[type(m).__name__] = skipped.get(type(m).__name__, 0) + 1
    return found, skipped, modes


def dense_nbytes(model: nn.Module) -> int:
    """Bytes the quantized layers' weights would take dense (in `_dense_dtype`)."""
    found, _, _ = _quantized_layers(model)
    fallback = float_dtype(model)
    return sum(m["weight"].size * 32 // m.bits * _dense_dtype(m, fallback).size for _, m in found)


def device_memory() -> int | None:
    """The default device's memory in bytes, where MLX reports it (Metal:
    `memory_size`, CUDA: `total_memory`)."""
    try:
        info = mx.device_info()
    except Exception:  # a backend without device_info
        return None
    size = info.get("memory_size") or info.get("total_memory")
    return int(size) if size else None


def on_cuda() -> bool:
    """MLX's CUDA backend is the default device (a GPU that is not Metal)."""
    return mx.default_device().type == mx.gpu and not mx.metal.is_available()


def wants_dense(setting, model: nn.Module, cuda: bool | None = None, memory: int | None = None) -> bool:
    """Whether `dense_weights` should run: True / False as given, or "auto": on
    MLX's CUDA backend (`cuda`, default: the default device's) when the model
    has quantized layers whose dense weights fit `DENSE_MEMORY_SHARE` of
    `memory` (default: the device's)."""
    if isinstance(setting, bool):
        return setting
    if setting != "auto":
        raise ValueError(f"dense_weights: True, False or 'auto', got {type(setting).__name__} {setting!r}")
    if not (on_cuda() if cuda is None else cuda):
        return False
    memory = device_memory() if memory is None else memory
    need = dense_nbytes(model)
    return memory is not None and 0 < need <= DENSE_MEMORY_SHARE * memory


def dense_weights(model: nn.Module) -> QuantizedReport:
    """Replace `model`'s quantized layers by dense ones holding the dequantized
    weights, in place, a layer at a time (each dense weight is evaluated and the
    quantized one freed before the next, so the peak is the dense model's plus
    the quantized layers not yet replaced). Layers of other types (a
    tensor-parallel shard) stay."""
    from mlx.utils import tree_unflatten

    found, skipped, modes = _quantized_layers(model)
    fallback = float_dtype(model)
    counts = {"linear": 0, "embedding": 0, "experts": 0}
    dense = bool(found)
    found.reverse()
    while found:  # popped, so that nothing here keeps a replaced layer's arrays alive
        path, m = found.pop()
        twin = _dense_twin(m, fallback)
        mx.eval(twin.parameters())
        model.update_modules(tree_unflatten([(path, twin)]))
        kind = "embedding" if isinstance(m, nn.QuantizedEmbedding) else "experts" if isinstance(m, QuantizedSwitchLinear) else "linear"
        counts[kind] += 1
        del m, twin
    mx.clear_cache()
    return QuantizedReport(None, **counts, modes=tuple(sorted(modes)), dense=dense,
                           skipped=tuple(f"{name}: {n}" for name, n in sorted(skipped.items())))  # fmt: skip


_ROUTED = {
    nn.QuantizedLinear: RoutedQuantizedLinear,
    nn.QuantizedEmbedding: RoutedQuantizedEmbedding,
    QuantizedSwitchLinear: RoutedQuantizedSwitchLinear,
}
_KIND = {RoutedQuantizedLinear: "linear", RoutedQuantizedEmbedding: "embedding", RoutedQuantizedSwitchLinear: "experts"}


@dataclass(frozen=True)
class QuantizedReport:
    """What `route_quantized` (or `dense_weights`) found and did: the threshold
    applied (None: none), the layers it routes (or made dense: `dense`) by kind,
    their quantization ("affine-4-64", "mxfp4-4-32"), and the quantized layers
    it left as they were, by type."""

    dequantize_rows: int | None = None
    linear: int = 0
    embedding: int = 0
    experts: int = 0
    modes: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    dense: bool = False

    def as_dict(self) -> dict:
        return {"dense": self.dense, "dequantize_rows": self.dequantize_rows, "linear": self.linear,
                "embedding": self.embedding, "experts": self.experts, "modes": list(self.modes),
                "skipped": list(self.skipped)}  # fmt: skip


def _routed(module: nn.Module, rows: int) -> nn.Module:
    """`module` as its routed class, holding the same arrays (no copy)."""
    cls = _ROUTED.get(type(module), type(module))
    out = cls.__new__(cls)
    nn.Module.__init__(out)
    for key, value in vars(module).items():
        object.__setattr__(out, key, set(value) if isinstance(value, set) else value)
    dict.update(out, module)
    out.dequantize_rows = rows
    return out


def _is_quantized(module: nn.Module) -> bool:
    return isinstance(module, nn.Module) and isinstance(module.get("scales"), mx.array) and hasattr(module, "bits")


def route_quantized(model: nn.Module, rows: int | None) -> QuantizedReport:
    """Route `model`'s quantized layers by `rows` (module doc), in place; a routed
    model is routed again to the new threshold. `rows` None: nothing changes, the
    report still counts the quantized layers (all under `skipped`)."""
    from mlx.utils import tree_unflatten

    found, skipped, modes = _quantized_layers(model)
    counts = {"linear": 0, "embedding": 0, "experts": 0}
    if rows is not None and found:
        swapped = [(path, _routed(m, rows)) for path, m in found]
        model.update_modules(tree_unflatten(swapped))
        for _, m in swapped:
            counts[_KIND[type(m)]] += 1
    elif found:
        for _, m in found:
            if type(m) in _KIND:  # routed before: back to the layer's own op
                m.dequantize_rows = None
        skipped["not routed (dequantize_rows off)"] = len(found)
    return QuantizedReport(rows if counts != dict.fromkeys(counts, 0) else None, **counts, modes=tuple(sorted(modes)),
                           skipped=tuple(f"{name}: {n}" for name, n in sorted(skipped.items())))  # fmt: skip
