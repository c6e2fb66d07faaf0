"""What a new pass shape costs mx.fast attention: the first call of each (queries, keys)
shape against a repeat, for the masks a prompt pass uses -- the fp16 cache's causal mask
and TurboQuant's reading rule as an additive bias (cache/turboquant_attention.py), the
latter at the prompt's own shape and padded to `fused_shape`.

    python bench/attention_plans.py [--heads 14,2] [--dim 64] [--prefix 40]
        [--lengths 70,90,...] [--reps 3] [--out F]

On CUDA, mx.fast attention is cuDNN's, which builds a plan per shape and mask kind; the
first call of a shape pays that build. Prints and writes one JSON object: per mask kind and
prompt length, the first call's ms and the repeat's median ms, and the distinct shapes the
lengths made.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the batchgen of the tree this script is in

from batchgen.cache.turboquant_attention import fused_prefill_mask, fused_shape  # noqa: E402

MASKS = ("causal", "bias", "bias_padded")
LENGTHS = "70,90,110,130,170,210,250,290,330,370"


def call_ms(q, k, v, mask, scale) -> float:
    start = time.perf_counter()
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))
    return (time.perf_counter() - start) * 1e3


def pass_arrays(kind: str, L_q: int, keys: int, hq: int, hkv: int, dim: int, dtype):
    """q, k, v and the mask of one prompt pass of L_q queries over `keys` positions."""
    rows, width = (L_q, keys) if kind != "bias_padded" else fused_shape(L_q, keys)
    if kind == "bias":
        width = -(-keys // 128) * 128  # whole tiles, as the unpadded form had them
    q = mx.random.normal((1, hq, rows, dim)).astype(dtype)
    k = mx.random.normal((1, hkv, width, dim)).astype(dtype)
    v = mx.random.normal((1, hkv, width, dim)).astype(dtype)
    if kind == "causal":
        return q, k, v, "causal"
    # TurboQuant's own mask, no sinks or exact tail: causal over the prompt, padding unread.
    return q, k, v, fused_prefill_mask(L_q, keys, 0, 0, 1, width, dtype, rows)


def measure(lengths, prefix, hq, hkv, dim, reps, dtype) -> list[dict]:
    rows = []
    scale = dim**-0.5
    for kind in MASKS:
        for L_q in lengths:
            q, k, v, mask = pass_arrays(kind, L_q, prefix + L_q, hq, hkv, dim, dtype)
            mx.eval(q, k, v, *([mask] if isinstance(mask, mx.array) else []))
            first = call_ms(q, k, v, mask, scale)
            again = statistics.median(call_ms(q, k, v, mask, scale) for _ in range(reps))
            rows.append({"mask": kind, "queries": L_q, "shape": [q.shape[2], k.shape[2]],
                         "first_ms": round(first, 3), "repeat_ms": round(again, 3)})  # fmt: skip
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for kind in MASKS:
        mine = [r for r in rows if r["mask"] == kind]
        out[kind] = {
            "shapes": len({tuple(r["shape"]) for r in mine}),
            "first_ms_total": round(sum(r["first_ms"] for r in mine), 2),
            "repeat_ms_total": round(sum(r["repeat_ms"] for r in mine), 2),
        }
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="14,2", help="query heads,kv heads")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=40, help="cached positions before each prompt")
    ap.add_argument("--lengths", default=LENGTHS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    hq, hkv = (int(x) for x in a.heads.split(","))
    lengths = [int(x) for x in a.lengths.split(",")]
    rows = measure(lengths, a.prefix, hq, hkv, a.dim, a.reps, getattr(mx, a.dtype))
    result = {"date": datetime.date.today().isoformat(), "device": str(mx.default_device()),
              "heads": [hq, hkv], "dim": a.dim, "prefix": a.prefix, "dtype": a.dtype,
              "summary": summary(rows), "rows": rows}  # fmt: skip
    text = json.dumps(result, indent=1)
    print(json.dumps(result["summary"], indent=1))
    if a.out:
        a.out.write_text(text)
    return result


if __name__ == "__main__":
    main()
