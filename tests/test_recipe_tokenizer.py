"""The recipe's tokenizer as mlx-lm loads it for a model of each arch (no torch needed)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from mlx_lm.utils import load_tokenizer  # noqa: E402

from recipe import tokenizer as tok  # noqa: E402

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "Rename the local variable `count` to `total` everywhere in this function.",
    "class Point:\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n",
]


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3", "qwen3_moe"])
def test_mlx_lm_tokenizes_exactly_as_training(tmp_path, model_type):
    """transformers picks a tokenizer class from config.json's model_type (qwen2:
    Qwen2Tokenizer, which rebuilds its own pre-tokenizer split; a llama tokenizer class
    would impose a Metaspace one); the ids mlx-lm gets must be the training tokenizer's:
    text with indentation, blank lines, digits and contractions, inside a chat."""
    trained = tok.train_tokenizer(CORPUS * 10, vocab_size=300)
    tok.save_tokenizer(trained, tmp_path)
    eos = trained.token_to_id(tok.EOS_TOKEN)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": model_type, "eos_token_id": eos})
    )
    loaded = load_tokenizer(tmp_path)
    code = "def f(x):\n    if x:\n\n        return 12345  # it's 2\n\treturn  x\r\n  \n"
    messages = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": code}]
    text = tok.render_chat(messages)
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    for sample in (code, text, CORPUS[2] * 2):
        assert loaded.encode(sample, add_special_tokens=False) == trained.encode(sample).ids
    assert loaded.encode(code) == trained.encode(code).ids  # no BOS added
    assert loaded.decode(trained.encode(code).ids) == code
    assert loaded.eos_token_ids == {eos}
