"""The batch step's attention kernel at the GPU's own clocks: the compiled step, and
the kernel alone, per setting.

    python bench/attention_probe.py --shape qwen2.5-7b --rows 8,32 --contexts 512,2048 \
        [--baseline path/to/attention.py] [--variant u8:_DECODE_UNROLL=8 ...] --out r.json

Per (rows, context): `step_ms` = ms a compiled step (pipelined, as the scheduler
runs it; `batch_step._compiled_steps`) and `kernel_us` = us a launch of
`batch_decode_attention` over one layer's buffers of the same rows, 4 x layers
launches queued and evaluated once (GPU time where the launches queue faster
than they run, else the host's time a launch), for the shipped kernel and, with
--baseline, another version of `batchgen/attention.py` (its
`fused_step_attention` / `batch_decode_attention`, e.g. another commit's, see
`attention_baseline.py`); `--variant NAME:ATTR=INT,...` times the shipped kernel
with module constants of `batchgen/attention.py` set otherwise
(`_DECODE_WARPS`, `_DECODE_UNROLL`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

sys.path.insert(0, str(Path(__file__).parent))

from attention_baseline import load_baseline  # noqa: E402
from batch_step import _compiled_steps, _filled, step_model  # noqa: E402
from projection_probe import patched  # noqa: E402

from batchgen.kernels import attention  # noqa: E402


def kernel_us(decode, rows: int, context: int, heads: int, kv_heads: int, dim: int, launches: int) -> float:
    pads = [(context // 2) * i // max(rows - 1, 1) for i in range(rows)]
    cache = BatchKVCache(pads)
    k = mx.random.normal((rows, kv_heads, context, dim)).astype(mx.bfloat16)
    cache.update_and_fetch(k, k)
    q = mx.random.normal((rows, heads, 1, dim)).astype(mx.bfloat16)
    mx.eval(cache.keys, q)
    bounds = attention.batch_cache_bounds(cache)
    run = lambda: mx.eval([decode(q, cache.keys, cache.values, cache.left_padding, bounds, dim**-0.5)  # noqa: E731
                           for _ in range(launches)])  # fmt: skip
    run()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6 / launches


def variant(text: str) -> tuple:
    """'u8:_DECODE_UNROLL=8,_DECODE_WARPS=8' -> ('u8', {'_DECODE_UNROLL': 8, '_DECODE_WARPS': 8})."""
    name, _, sets = text.partition(":")
    values = dict(item.split("=") for item in sets.split(","))
    unknown = [k for k in values if not hasattr(attention, k)]
    if not name or unknown:
        raise argparse.ArgumentTypeError(f"want NAME:ATTR=INT,... of batchgen.attention, got {text!r}")
    return name, {k: int(v) for k, v in values.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--baseline", type=Path, help="another attention.py to time beside the shipped one")
    ap.add_argument("--variant", action="append", default=[], type=variant,
                    help="NAME:ATTR=INT,...: the shipped kernel with these attention.py constants")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model, config = step_model(a.shape)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config["hidden_size"] // heads
    settings = {"shipped": {}}
    settings.update(a.variant)
    if a.baseline:
        settings["baseline"] = load_baseline(a.baseline)
    rows_out = []
    for rows in map(int, a.rows.split(",")):
        for context in map(int, a.contexts.split(",")):
            cache = _filled(model, rows, context, True, True)
            row = {"shape": a.shape, "rows": rows, "context": context}
            for name, values in settings.items():  # each: attributes of `attention` to set
                with patched(attention, **values):
                    row[f"{name}_step_ms"] = round(_compiled_steps(model, cache, rows, a.steps), 3)
                    row[f"{name}_kernel_us"] = round(kernel_us(attention.batch_decode_attention, rows, context, heads,
                                                               kv_heads, dim, 4 * len(model.layers)), 1)  # fmt: skip
            print(json.dumps(row), flush=True)
            rows_out.append(row)
            del cache
            mx.clear_cache()
    if a.out:
        a.out.write_text(json.dumps({"device": str(mx.default_device()), "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
