"""Byte-level BPE tokenizer with ChatML special tokens, saved in the format that
`mlx_lm.load` (through transformers' AutoTokenizer) reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEFAULT_VOCAB_SIZE = 4096
# Qwen2's pre-tokenizer split: the default model is declared qwen2, and transformers >= 5
# loads a qwen2 model's tokenizer as Qwen2Tokenizer, which rebuilds this split (and an NFC
# normalizer) whatever tokenizer.json says. Training with the same split makes the ids
# identical under every transformers version; GPT-2's split (ByteLevel's own regex)
# would be silently replaced at inference (newlines, indents and digits tokenize
# differently) and the model would see token sequences it was never trained on. The
# other archs get the same ids: qwen3 and qwen3_moe map to Qwen2Tokenizer too, or
# tokenizer.json is read as it is; transformers 5.0 and 5.24 register no tokenizer
# class for model_type llama (LlamaTokenizer would impose a Metaspace split), so the
# declared PreTrainedTokenizerFast reads tokenizer.json (tests/test_recipe_tokenizer.py).
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def render_chat(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """CHATML_TEMPLATE in Python: the exact text training sees, so that training and
    `apply_chat_template` at inference tokenize identically."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """A `tokenizers.Tokenizer`; special tokens get ids 0, 1, 2 in SPECIAL_TOKENS order."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (chat template inside it too, so
    transformers versions that ignore chat_template.jinja still find it)."""
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHATML_TEMPLATE
    # Older transformers do not know newer class names; this one exists everywhere.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    # The special-tokens map is redundant with tokenizer_config.json; one file fewer to ship.
    (out_dir / "special_tokens_map.json").unlink(missing_ok=True)


def special_token_ids(tokenizer) -> dict[str, int]:
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}


def load_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
