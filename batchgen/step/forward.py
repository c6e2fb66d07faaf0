"""A batch's one-token step through a llama-family model in few primitives.

A compiled batch step of a small model costs what its primitive count costs:
MLX's CUDA backend spends microseconds of host time on each primitive it
evaluates, kernel or view, and the GPU finishes first (bench/RESULTS.md#step-forward).
mlx-lm's layers are written for any sequence length: 3-D activations (every
matmul flattens and unflattens them), weights transposed at every call, q / k /
v reshaped and transposed one by one, about 38 primitives a layer. For one
token per row none of that is needed:

- activations are (rows, hidden);
- projections read weights transposed once, when the step is made (an
  evaluated `.T` view: no copy, no primitive per call), or on CUDA, where the
  weight is small and the rows few, through `projection`'s tensor-core kernel
  (its launch costs less than cuBLASLt's); quantized ones run as the model's
  own layers do (`transforms/quantized.project`: quantized_matmul below the
  layer's `dequantize_rows`, a dense matmul over the dequantized weight from
  there on), never through that bf16 kernel;
- RoPE runs once over the fused q|k|v output viewed as (rows, heads, 1, D):
  v's rotation is computed and never read, which costs less than slicing q and
  k out (a strided slice is copied before a kernel reads it);
- attention (CUDA) reads q and the new k from that, the new v from the
  unrotated projection (the `batch_fused_step` kernel op, or TurboQuant rows'
  `tq_rows_fused_step`).

14 primitives a layer, 11 of them kernels (0.5B shape: 349 a step against 858).
The ops are the model's own, in its order, on the same weights: on the CPU the
logits equal the model's (float32, tested). qwen3's per-head q/k norms run
before the RoPE (a concatenation puts q|k|v back together: 5 primitives more).
Models this does not cover (other layer structures, unfused projections or
other layer types, sliding windows, other RoPE kinds) get None from
`make_step_forward` and step through the model itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from ..kernels import projection
from ..transforms import quantized


log = logging.getLogger("batchgen")

SUPPORTED_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


@dataclass(frozen=True)
class _Linear:
    """A projection's weight (out, in), as the model holds it, and its transpose."""

    w: mx.array
    w_t: mx.array  # an evaluated `.T` view: the step's graph holds no transpose
    bias: mx.array | None

    def __call__(self, x: mx.array, kernel: bool) -> mx.array:
        """nn.Linear's own ops, or (`kernel`: CUDA) `projection`'s few-row kernel where it takes them."""
        if kernel and projection.takes(x, self.w):
            return projection.project(x, self.w, self.bias)
        return x @ self.w_t if self.bias is None else mx.addmm(self.bias, x, self.w_t)


@dataclass(frozen=True)
class _QuantizedLinear:
    """A quantized projection (or tied embedding): the product as the layer
    computes it (`quantized.project`, by the rows and the layer's
    `dequantize_rows`, which a layer never routed lacks)."""

    layer: nn.Module

    @property
    def dequantize_rows(self) -> int | None:
        return getattr(self.layer, "dequantize_rows", None)

    def __call__(self, x: mx.array, kernel: bool) -> mx.array:
        return quantized.project(self.layer, x, self.dequantize_rows)


_LINEAR_TYPES = (nn.Linear, nn.QuantizedLinear, quantized.RoutedQuantizedLinear)
_EMBEDDING_TYPES = (nn.Embedding, nn.QuantizedEmbedding, quantized.RoutedQuantizedEmbedding)


def _linear(module: nn.Module) -> _Linear | _QuantizedLinear:
    """A linear layer (or a tied embedding) as a `_Linear`, or a quantized one as a `_QuantizedLinear`."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return _QuantizedLinear(module)
    w = module["weight"]
    w_t = w.T
    mx.eval(w_t)
    return _Linear(w, w_t, module.get("bias"))


@dataclass(frozen=True)
class _Layer:
    norm1: mx.array
    eps1: float
    qkv: _Linear | _QuantizedLinear  # (Hq + 2 Hkv) D outputs: q | k | v
    o: _Linear | _QuantizedLinear
    norm2: mx.array
    eps2: float
    gate_up: _Linear | _QuantizedLinear  # 2 I outputs: gate | up
    down: _Linear | _QuantizedLinear
    qk_norms: tuple | None = None  # qwen3: (q weight, k weight, eps), RMS norm of each head before RoPE


def _unsupported(model) -> str | None:
    """Why `make_step_forward` cannot take `model` (None: it can)."""
    if type(model).__module__ not in SUPPORTED_MODULES:
        return f"model type {type(model).__module__}"
    inner = model.model
    if any(getattr(layer, "use_sliding", False) for layer in inner.layers):
        return "sliding-window layers"
    if type(inner.embed_tokens) not in _EMBEDDING_TYPES or any(type(m) not in _LINEAR_TYPES for m in _linears(model)):
        return "projections not fused, or of another type"
    first = inner.layers[0].self_attn
    if type(first.rope) is not nn.RoPE:
        return "a RoPE variant"
    if hasattr(first, "q_norm") and not all(type(getattr(layer.self_attn, n)) is nn.RMSNorm
                                            for layer in inner.layers for n in ("q_norm", "k_norm")):  # fmt: skip
        return "another q/k norm"
    dims = first.rope.dims
    head_dim = _head_dim(first)
    if dims != head_dim or any(type(n) is not nn.RMSNorm for layer in inner.layers
                               for n in (layer.input_layernorm, layer.post_attention_layernorm)):  # fmt: skip
        return "partial RoPE or another norm"
    return None


def _linears(model) -> list:
    inner, out = model.model, []
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [getattr(attn, "qkv_proj", None), attn.o_proj, getattr(mlp, "gate_up_proj", None), mlp.down_proj]
    if not model.args.tie_word_embeddings:
        out.append(model.lm_head)
    return out


def _head_dim(attn) -> int:
    o = attn.o_proj
    # A quantized weight packs 32 // bits inputs a word: its scales count the groups.
    inputs = o["scales"].shape[-1] * o.group_size if "scales" in o else o["weight"].shape[1]
    return inputs // attn.n_heads


class StepForward:
    """forward(inputs (B,), caches) -> logits (B, vocab): the model's one-token
    pass over `compiled_step.StepCache` layers. `kernel` (CUDA): attention
    through the fused step kernel op, projections through
    `projection` where it takes them."""

    def __init__(self, model):
        inner = model.model
        attn = inner.layers[0].self_attn
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, _head_dim(attn)
        self.scale, self.rope = attn.scale, attn.rope
        self.embed = inner.embed_tokens
        self.norm, self.eps = inner.norm["weight"], inner.norm.eps
        self.head = _linear(inner.embed_tokens if model.args.tie_word_embeddings else model.lm_head)
        self.layers = [self._layer(layer) for layer in inner.layers]

    @staticmethod
    def _layer(layer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        qk = (attn.q_norm["weight"], attn.k_norm["weight"], attn.q_norm.eps) if hasattr(attn, "q_norm") else None
        return _Layer(n1["weight"], n1.eps, _linear(attn.qkv_proj), _linear(attn.o_proj), n2["weight"], n2.eps,
                      _linear(mlp.gate_up_proj), _linear(mlp.down_proj), qk)  # fmt: skip

    def __call__(self, inputs: mx.array, caches: list, kernel: bool) -> mx.array:
        B = inputs.shape[0]
        hq, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        offset = caches[0].offset
        mask = None  # made once for every layer (as mlx-lm's models do), where a layer needs it
        h = self.embed(inputs)
        for w, cache in zip(self.layers, caches):
            x = mx.fast.rms_norm(h, w.norm1, w.eps1)
            heads = w.qkv(x, kernel).reshape(B, hq + 2 * hkv, 1, d)
            roped = self.rope(heads if w.qk_norms is None else self._qk_normed(heads, w.qk_norms), offset=offset)
            if kernel and cache.takes_kernel(heads):
                out = cache.fused_attention(roped, heads, self.scale)  # (B, Hq * D)
            else:
                keys, values = cache.update_and_fetch(roped[:, hq : hq + hkv], heads[:, hq + hkv :])
                # The cache answers for itself (transforms/attention.py's protocol): TurboQuant
                # rows from their codes, a step kernel; else the stock attention with the mask.
                out = cache.attention(roped[:, :hq], keys, values, scale=self.scale, mask=None)
                if out is NotImplemented:
                    mask = caches[0].make_mask(1) if mask is None else mask
                    out = mx.fast.scaled_dot_product_attention(roped[:, :hq], keys, values, scale=self.scale,
                                                               mask=mask)  # fmt: skip
                out = out.reshape(B, hq * d)
            h = h + w.o(out, kernel)
            x = mx.fast.rms_norm(h, w.norm2, w.eps2)
            gate, up = mx.split(w.gate_up(x, kernel), 2, axis=-1)
            h = h + w.down(swiglu(gate, up), kernel)
        return self.head(mx.fast.rms_norm(h, self.norm, self.eps), kernel)


    def _qk_normed(self, heads: mx.array, norms: tuple) -> mx.array:
        """qwen3's per-head RMS norms of q and k (v as it is), in one array again."""
        hq, hkv = self.n_heads, self.n_kv_heads
        q_w, k_w, eps = norms
        q = mx.fast.rms_norm(heads[:, :hq], q_w, eps)
        k = mx.fast.rms_norm(heads[:, hq : hq + hkv], k_w, eps)
        return mx.concatenate([q, k, heads[:, hq + hkv :]], axis=1)


def make_step_forward(model) -> Callable | None:
    """A `StepForward` over `model`'s weights, or None where it does not cover
    the model (the reason is logged)."""
    reason = _unsupported(model)
    if reason is not None:
        log.debug("batch step through the model itself: %s", reason)
        return None
    return StepForward(model)
