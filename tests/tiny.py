"""Tiny random-weight models of real mlx-lm architectures, saved in the format
`mlx_lm.load` reads, with a real byte-level BPE tokenizer and a ChatML template.

Nothing here downloads: the tokenizer is trained on a few lines of text in a few
milliseconds and the weights are random (seeded, so every build is identical).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer briefly and exactly.",
    "import os\nimport sys\n\nclass Point:\n    x: int\n    y: int\n",
    "Rename the variable `count` to `total` in the function below.",
    "for i in range(10):\n    print(i * i)\n",
]

_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)

ARCH_CONFIGS = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    ),
    "qwen3_5": dict(
        model_type="qwen3_5",
        num_hidden_layers=4,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        full_attention_interval=2,
        rope_parameters={
            "type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    ),
}

ARCHS = tuple(ARCH_CONFIGS)


def build_tokenizer(path: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE tokenizer with ChatML specials; return its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(str(path))
    return tok.get_vocab_size()


def build_model(
    arch: str,
    path: Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    quantize_bits: int | None = None,
    group_size: int = 32,
    quantize_mode: str = "affine",
    repeater: bool = False,
    **overrides,
) -> Path:
    """Write a tiny random `arch` model (weights, config, tokenizer) to `path`.

    `repeater=True` zeroes every block's output projections and ties the
    embeddings, so the residual stream is the input embedding and the model
    predicts its input token again: a model whose output always repeats, on
    which prompt lookup drafts are always accepted.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(path)
    config = {**_COMMON, **ARCH_CONFIGS[arch], **overrides, "vocab_size": vocab}
    config["eos_token_id"] = 2  # <|im_end|>
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Wider weights than the default init, so the argmax moves from token to token
    # instead of repeating one token forever.
    model.update(
        tree_map(lambda p: p * 2.0 if p.ndim >= 2 else p, model.parameters())
    )
    if repeater:
        config["tie_word_embeddings"] = True
        model = module.Model(module.ModelArgs.from_dict(config))
        model.update(tree_map(lambda p: p * 2.0 if p.ndim >= 2 else p, model.parameters()))
        zeroed = [(k, mx.zeros_like(v)) for k, v in tree_flatten(model.parameters())
                  if k.endswith(("o_proj.weight", "down_proj.weight"))]  # fmt: skip
        model.load_weights(zeroed, strict=False)
    model.set_dtype(getattr(mx, dtype))
    if quantize_bits:
        # The fp modes (mxfp4, nvfp4: 4 bits; mxfp8: 8) have their own group size.
        group = group_size if quantize_mode == "affine" else None
        nn.quantize(model, group_size=group, bits=quantize_bits, mode=quantize_mode)
        group = model.model.layers[0].self_attn.o_proj.group_size if group is None else group
        config["quantization"] = {"group_size": group, "bits": quantize_bits, "mode": quantize_mode}
    mx.eval(model.parameters())
    mx.save_safetensors(
        str(path / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    config["torch_dtype"] = dtype
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
