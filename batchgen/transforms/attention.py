"""One attention dispatch, chosen by the cache type.

mlx-lm's model files call `scaled_dot_product_attention(queries, keys, values, cache,
scale, mask, sinks)`, imported by name from mlx_lm.models.base, with the layer's cache;
it has no per-cache hook besides its `hasattr(cache, "bits")` branch (mx's affine
quantized cache). `route_attention(model)` rebinds that name, in the modules the model is
built from, to a dispatch: a cache with an `attention` method (batchgen's caches: the
fp16 ones' short passes and batch kernel, TurboQuant's reading rule, the compiled
step's) answers for itself, or returns `NotImplemented` to take the stock path; any other
cache takes the stock path unchanged (mlx-lm's own caches: the plain side of a benchmark
in the same process keeps mlx-lm's behaviour).

    cache.attention(queries, keys, values, scale=..., mask=..., sinks=...) -> array | NotImplemented

A load-time transform like fusion: done once per model, idempotent; `unroute_attention`
restores the previous bindings.
"""

from __future__ import annotations

import sys

_NAME = "scaled_dot_product_attention"
_routed: dict = {}  # module name -> the binding the dispatch replaced


def _dispatch(stock):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        attend = getattr(cache, "attention", None)
        if attend is not None:
            out = attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
            if out is not NotImplemented:
                return out
        return stock(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.batchgen_stock = stock
    return scaled_dot_product_attention


def route_attention(model) -> list[str]:
    """Route the attention of `model`'s layers through the dispatch; returns the names
    of the model's modules that call it (empty: the model's attention does not go
    through mlx-lm's function, and caches are fed through `update_and_fetch` alone)."""
    names = sorted({type(m).__module__ for m in model.modules()})
    routed = []
    for name in names:
        module = sys.modules.get(name)
        fn = getattr(module, _NAME, None)
        if fn is None:
            continue
        if not hasattr(fn, "batchgen_stock"):
            setattr(module, _NAME, _dispatch(fn))
            _routed[name] = fn
        routed.append(name)
    return routed


def routed_modules() -> list[str]:
    """The model-file modules the dispatch serves now."""
    return sorted(_routed)


def unroute_attention() -> None:
    """Undo `route_attention` for every module it rebound."""
    for name, fn in _routed.items():
        setattr(sys.modules[name], _NAME, fn)
    _routed.clear()
