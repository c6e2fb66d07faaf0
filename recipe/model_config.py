"""The architecture of the recipe's model and its config.json, without torch (the build
checks its flags before the data stage forks its workers)."""

from __future__ import annotations

from dataclasses import dataclass

# model_type -> (architectures entry of config.json)
ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# The fields that every arch's config.json carries, in this order (the qwen2 export's
# bytes depend on it).
_BASE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    # 640 rather than 768 keeps the bf16 file under 14 MB (768 would be ~14.7 MB).
    # qwen3_moe: the width of a dense MLP layer, which none of its layers is (all are
    # sparse); config.json still carries it since mlx-lm's ModelArgs requires it.
    intermediate_size: int = 640
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # qwen2: q/k/v biases. llama: no biases. qwen3: no biases, RMSNorm on each query and
    # key head (q_norm/k_norm) before RoPE. qwen3_moe: qwen3 attention and a sparse MoE
    # MLP in every layer.
    arch: str = "qwen2"
    # None: hidden_size // num_attention_heads. mlx-lm's qwen2 always derives it that
    # way, so qwen2 takes no other value; the other archs read config.json's head_dim.
    head_dim: int | None = None
    # qwen3_moe only (0 for the dense archs).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch {self.arch!r} is not one of {sorted(ARCHITECTURES)}")
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even and positive (RoPE), not {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.arch == "qwen2" and self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(
                "qwen2: mlx-lm derives head_dim as hidden_size // num_attention_heads; "
                f"head_dim {self.head_dim} needs {self.hidden_size // self.head_dim} heads "
                f"for hidden size {self.hidden_size} (or use llama/qwen3)"
            )
        moe = (self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size)
        if self.arch == "qwen3_moe":
            if not (
                1 <= self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
            ):
                raise ValueError(
                    "qwen3_moe needs num_experts >= num_experts_per_tok >= 1 and "
                    f"moe_intermediate_size > 0, not {moe}"
                )
        elif any(moe):
            raise ValueError(f"{self.arch} has no experts: {moe}")

    def hf_config(self, eos_token_id: int, pad_token_id: int, dtype: str) -> dict:
        """config.json for mlx-lm (and transformers) to rebuild this model."""
        config = {
            "architectures": [ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            **{name: getattr(self, name) for name in _BASE_FIELDS},
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "rope_traditional": False,
            "tie_word_embeddings": True,
        }
        if self.arch == "llama":
            config.update(attention_bias=False, mlp_bias=False)
        else:
            if self.arch != "qwen2":
                config["attention_bias"] = False
            config["use_sliding_window"] = False
        if self.arch == "qwen3_moe":
            config.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=1,  # every layer sparse
                mlp_only_layers=[],
                output_router_logits=False,
            )
        config.update(
            use_cache=True,
            bos_token_id=None,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            torch_dtype=dtype,
        )
        return config
