"""Making a job's KV cache: the kind a run asks for (fp16 or TurboQuant), as the type the
device runs best, with the model's attention routed to it (transforms/attention.py).

    make_kv_cache(model, kind, ...)         the engine's entry point
    make_turboquant_cache(model, bits, ...) TurboQuant layers where the model has plain ones
    CACHE_CLASSES                           every cache class a saved prompt cache may name
"""

from __future__ import annotations

from typing import Any, List

from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache

from ..kernels.turboquant import STEP
from ..transforms.attention import route_attention
from ..turboquant.codec import resolve_bits
from .fp16 import DEFAULT_MAX_QUERIES, Fp16BatchCache, Fp16Cache, make_fp16_cache
from .turboquant import TurboQuantKVCache
from .turboquant_step import TurboQuantStepKVCache

# Class name -> class, for a prompt-cache loader (cache/pool.py) besides mlx-lm's own.
CACHE_CLASSES = {cls.__name__: cls for cls in (Fp16Cache, Fp16BatchCache, TurboQuantKVCache, TurboQuantStepKVCache)}


def register_with_mlx_lm() -> None:
    """mlx-lm's load_prompt_cache looks classes up by name in its cache module's
    globals: add ours there (nothing is replaced), so its loader rebuilds them too."""
    for name, cls in CACHE_CLASSES.items():
        if getattr(mlx_cache, name, None) is not cls:
            setattr(mlx_cache, name, cls)


register_with_mlx_lm()


def make_turboquant_cache(model, bits: int = 4, *, seed: int = 0, rotated_attention: bool = True,
                          **options) -> List[Any]:  # fmt: skip
    """The model's cache list with every plain KVCache replaced by a TurboQuant cache.

    Recurrent (ArraysCache), rotating and other caches are kept as the model makes them.
    Layer i gets rotation seed `seed + i`. `options` go to TurboQuantKVCache (key_bits,
    value_bits, sink_tokens, window, trim_reserve, fused_prefill).

    `rotated_attention` (default) routes the model's attention through the dispatch, so
    attention reads the codes in the rotated domain with each query's window exact,
    whatever the chunking (chunked prefill, prompt-cache reuse and prompt-lookup
    verification then match token-by-token decoding); where the step kernel op can run,
    the layers are `TurboQuantStepKVCache`. With False, or where the model's attention
    does not go through mlx-lm's scaled_dot_product_attention, attention uses the
    dequantized keys/values that update_and_fetch returns.
    """
    resolve_bits(bits)
    routed = bool(rotated_attention and route_attention(model))
    kind = TurboQuantStepKVCache if routed and STEP.enabled() else TurboQuantKVCache
    caches = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    return [kind(bits, seed=seed + i, routed=routed, **options) if type(c) is KVCache else c
            for i, c in enumerate(caches)]  # fmt: skip


def make_kv_cache(model, kind: str = "fp16", bits: int = 4, *, short_passes: bool = False,
                  trim_reserve: int | None = None) -> List[Any]:  # fmt: skip
    """A job's cache of `kind` ("fp16": uncompressed, in the model's dtype; "turboquant":
    `bits` per coordinate). `short_passes`: fp16 layers attend passes of a few queries as
    plain ops (where the fused kernel builds per shape). `trim_reserve`: TurboQuant
    trims of up to this many tokens stay exact."""
    if kind == "turboquant":
        options = {} if trim_reserve is None else {"trim_reserve": trim_reserve}
        return make_turboquant_cache(model, bits=bits, **options)
    if kind != "fp16":
        raise ValueError(f"kv cache kind must be fp16 or turboquant, got {kind!r}")
    route_attention(model)
    return make_fp16_cache(model, DEFAULT_MAX_QUERIES if short_passes else 0)
