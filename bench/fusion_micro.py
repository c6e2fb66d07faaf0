"""Decode speed of fused vs unfused weights, side by side in one process.

Random-init models of real shapes are built in memory (nothing is downloaded).
Each (shape, dtype) pair builds one unfused model and a second one that shares
its weights and is then fused, so both run the same numbers. Runs alternate
between the two (with the order flipped every round) after a warm-up of each,
and the median decode tok/s per variant is reported.

    python bench/fusion_micro.py --shapes tiny --dtypes fp32,4bit --tokens 32 \\
        --prompt-tokens 128 --out outputs/fusion_micro_cpu.json
    python bench/fusion_micro.py --out outputs/fusion_micro_h200.json  # full set

On CPU, bf16 matmuls are slow and MoE `gather_mm` needs float32: use `fp32` and
the `tiny` shapes there. Speed claims belong to the GPU runs.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchgen.transforms.fusion import fuse_model  # noqa: E402

_DENSE = dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1e6)
_MOE = dict(
    model_type="qwen3_moe",
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    max_position_embeddings=32768,
)

SHAPES = {
    # Qwen2.5 shapes: hidden / layers / heads / kv heads / intermediate.
    "0.5b": dict(
        _DENSE,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        _DENSE,
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        _DENSE,
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    # A small qwen3_moe: 8 experts, 2 active per token, ~1.1B parameters.
    "moe": dict(
        _MOE,
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=3072,
        moe_intermediate_size=1024,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    # CPU-sized shapes for a quick check of the script and of the ratio.
    "tiny": dict(
        _DENSE,
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=768,
        vocab_size=4096,
        tie_word_embeddings=True,
    ),
    "tiny_moe": dict(
        _MOE,
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        moe_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=4096,
        tie_word_embeddings=False,
    ),
}

DTYPES = {
    "bf16": (mx.bfloat16, None),
    "fp16": (mx.float16, None),
    "fp32": (mx.float32, None),
    "4bit": (mx.bfloat16, 4),
    "4bit-fp32": (mx.float32, 4),
}
QUANT_GROUP_SIZE = 64


def build_model(config: dict, dtype_name: str) -> nn.Module:
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    dtype, bits = DTYPES[dtype_name]
    model.set_dtype(dtype)
    if bits:
        nn.quantize(model, group_size=QUANT_GROUP_SIZE, bits=bits)
    return model


def build_pair(config: dict, dtype_name: str) -> tuple[nn.Module, nn.Module, dict]:
    """(unfused, fused, fusion report) sharing every unfused weight."""
    mx.random.seed(0)
    unfused = build_model(config, dtype_name)
    mx.eval(unfused.parameters())
    fused = build_model(config, dtype_name)
    # Share the arrays (the second model's own random init is never evaluated),
    # then fuse: its fused buffers are new, everything else is shared.
    fused.update(unfused.parameters())
    report = fuse_model(fused, keep_fallback=False)
    return unfused, fused, report.as_dict()


def decode_run(model: nn.Module, prompt: mx.array, tokens: int) -> dict:
    """Prefill `prompt`, then greedy-decode; time prefill and decode apart."""
    start = time.perf_counter()
    first_at = None
    generated = []
    for token, _ in generate_step(prompt, model, max_tokens=tokens):
        generated.append(int(token))
        if first_at is None:
            first_at = time.perf_counter()
    end = time.perf_counter()
    decode_s = end - first_at
    return {
        "prefill_tps": prompt.size / (first_at - start),
        "decode_tps": (len(generated) - 1) / decode_s if decode_s > 0 else 0.0,
        "tokens": generated,
    }


def bench_pair(shape: str, dtype_name: str, args) -> dict:
    config = SHAPES[shape]
    unfused, fused, report = build_pair(config, dtype_name)
    models = {"unfused": unfused, "fused": fused}
    prompt = mx.random.randint(
        0, config["vocab_size"], (args.prompt_tokens,), key=mx.random.key(1)
    )
    warmup = prompt[: min(64, args.prompt_tokens)]
    for model in models.values():
        decode_run(model, warmup, min(8, args.tokens))

    runs = {name: [] for name in models}
    order = list(models)
    for _ in range(args.rounds):
        for name in order:
            runs[name].append(decode_run(models[name], prompt, args.tokens))
        order.reverse()

    summary = {
        name: {
            "decode_tps": statistics.median(r["decode_tps"] for r in rs),
            # Best of the runs: robust to a busy (shared) machine slowing some runs.
            "decode_tps_best": max(r["decode_tps"] for r in rs),
            "prefill_tps": statistics.median(r["prefill_tps"] for r in rs),
            "decode_tps_runs": [r["decode_tps"] for r in rs],
        }
        for name, rs in runs.items()
    }
    tokens_a, tokens_b = runs["unfused"][0]["tokens"], runs["fused"][0]["tokens"]
    first_diff = next(
        (i for i, (a, b) in enumerate(zip(tokens_a, tokens_b)) if a != b), None
    )
    weights_gb = sum(v.nbytes for _, v in tree_flatten(unfused.parameters()))
    return {
        "shape": shape,
        "dtype": dtype_name,
        "weights_gb": weights_gb / 1e9,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.tokens,
        "rounds": args.rounds,
        "unfused": summary["unfused"],
        "fused": summary["fused"],
        "decode_speedup": _ratio(summary, "decode_tps"),
        "decode_speedup_best": _ratio(summary, "decode_tps_best"),
        "first_token_mismatch": first_diff,
        "fusion": report,
    }


def _ratio(summary: dict, key: str) -> float:
    return summary["fused"][key] / summary["unfused"][key]


def print_row(r: dict):
    if "error" in r:
        print(f"{r['shape']:>8} {r['dtype']:>9}  error: {r['error']}")
        return
    print(
        f"{r['shape']:>8} {r['dtype']:>9} {r['weights_gb']:8.2f} "
        f"{r['unfused']['decode_tps']:10.1f} {r['fused']['decode_tps']:10.1f} "
        f"{r['decode_speedup']:7.3f}x {r['decode_speedup_best']:7.3f}x "
        f"{str(r['first_token_mismatch']):>9}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes", default="0.5b,1.5b,7b,moe", help=f"of {list(SHAPES)}"
    )
    parser.add_argument("--dtypes", default="bf16,4bit", help=f"of {list(DTYPES)}")
    parser.add_argument("--tokens", type=int, default=200, help="decode tokens per run")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out", default="outputs/fusion_micro.json", help="JSON results"
    )
    args = parser.parse_args()

    print(f"device {mx.default_device()}  mlx {mx.__version__}")
    print(
        f"{'shape':>8} {'dtype':>9} {'GB':>8} {'unfused':>10} {'fused':>10} "
        f"{'median':>8} {'best':>8} {'mismatch':>9}"
        f"   (decode tok/s: median of {args.rounds}; speedup of median and of best)"
    )
    results = []
    for shape in args.shapes.split(","):
        for dtype_name in args.dtypes.split(","):
            try:
                row = bench_pair(shape, dtype_name, args)
            except (
                Exception
            ) as e:  # one bad pair (e.g. bf16 MoE on CPU) must not end the table
                row = {
                    "shape": shape,
                    "dtype": dtype_name,
                    "error": f"{type(e).__name__}: {e}",
                }
            print_row(row)
            results.append(row)
            gc.collect()
            mx.clear_cache()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "device": str(mx.default_device()),
                "platform": platform.platform(),
                "mlx": mx.__version__,
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
