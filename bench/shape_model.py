"""Write a model of a real shape with random weights as a model directory that
`batchgen run --model DIR` loads (`batchgen bench --shape` keeps such models in
memory; a launch over several ranks loads from disk in every rank):

    python3 bench/shape_model.py qwen2.5-7b /tmp/shapes/qwen2.5-7b [--dtype bfloat16] [--quantize 4]

Weights are seeded (the same for a shape and seed), the tokenizer and chat
template are the demo model's (a Qwen-shaped vocabulary holds all its ids).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from batchgen.bench import random_model
from batchgen.config import DEMO_MODEL_DIR, SHAPES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", type=int, choices=[4, 8], default=None, help="affine bits (mlx-lm's layout)")
    p.add_argument("--quantize-group", type=int, choices=[32, 64, 128], default=64)
    args = p.parse_args()
    model, config = random_model(args.shape, args.dtype, args.quantize, args.seed, group_size=args.quantize_group)
    args.out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    mx.save_safetensors(str(args.out / "model.safetensors"), weights)
    (args.out / "config.json").write_text(json.dumps({**config, "torch_dtype": args.dtype}, indent=2))
    for name in TOKENIZER_FILES:
        if (DEMO_MODEL_DIR / name).exists():
            shutil.copy(DEMO_MODEL_DIR / name, args.out / name)
    print(f"wrote {args.out} ({sum(v.nbytes for v in weights.values()) / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
