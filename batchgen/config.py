"""Frozen configuration, built once at the CLI edge and passed down.

Nothing here imports mlx: the job reader and `batchgen validate` run without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MAX_TOKENS = 256
DEFAULT_PLD_NGRAM_SIZE = 3
# The longest draft a verify pass may take, by device (`DecodeConfig.pld_max_lookup`
# None); the policy (decode/drafts.py) verifies the prefix that pays. On the H200, one
# job at a time, a GPU pass costs about the same at any of these lengths, so the policy
# takes whole drafts and the ceiling decides: at 32 it ran at 0.89-1.01 of the best
# fixed setting on the models it was tuned on and 0.98-1.10 on the two it was not, at 16
# at 0.80-0.93. On a CPU a pass costs by its tokens and the policy verifies short
# prefixes: there 32 ran at 0.93-1.02 of 16 (mean 0.97, noise of this size), so the CPU
# keeps 16 (bench/RESULTS.md#prompt-lookup-on-models-it-was-not-tuned-on). A GPU where a
# long pass costs more (a large model) needs no other ceiling: the policy times it.
DEFAULT_PLD_MAX_LOOKUP = 32  # where the device is a GPU
CPU_PLD_MAX_LOOKUP = 16
# A TurboQuant cache keeps exact copies of the tokens a verify pass may trim,
# 2 * (lookup + 1) a layer, bytes every job pays: its jobs' drafts stay short
# (at 16 a 600-token job passed the 0.30x of the fp16 bytes tests/test_compose.py holds it to).
# One at a time this cap is most of what keeps TurboQuant behind fp16 (0.55-0.81x on an
# H100, 1,790 passes against ~970: bench/RESULTS.md#turboquant-prefill-plans). A pass of up to the
# window's 8 tokens is one step launch a layer, so 7 costs no more launches for 4 more exact
# tokens a layer: on an H100 it took 15% fewer passes and 5-14% less decode, but whole runs
# moved by -5% to +9%, within the noise (bench/RESULTS.md#turboquant-prefill-plans); a
# whole-run gain of 5% or more, on a quieter machine or a larger model, would move it.
TURBOQUANT_MAX_LOOKUP = 5


def pld_lookup(kv_kind: str, lookup: int) -> int:
    """The longest draft a job with a `kv_kind` cache verifies.

    >>> pld_lookup("fp16", 16), pld_lookup("turboquant", 16), pld_lookup("turboquant", 3)
    (16, 5, 3)
    """
    return min(lookup, TURBOQUANT_MAX_LOOKUP) if kv_kind == "turboquant" else lookup


DRAFT_KINDS = ("pld", "none")
KV_CACHE_KINDS = ("fp16", "turboquant")
KV_BITS = (2, 3, 4)
DEFAULT_KV_BITS = 4

# The bundled demo model: the default when neither --model nor BATCHGEN_MODEL is set.
DEMO_MODEL_DIR = Path(__file__).parent / "demo"


@dataclass(frozen=True)
class SamplingConfig:
    """How one job picks tokens; temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class LogitsConfig:
    """What a job does to the model's logits before a token is picked: OpenAI's
    presence and frequency penalties (over the tokens generated so far),
    mlx-lm's repetition penalty (over the last `repetition_context_size`
    tokens of prompt and output) and an additive bias per token id."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    repetition_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending

    @property
    def active(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias)


@dataclass(frozen=True)
class DecodeConfig:
    """Which decoder runs a job: plain or prompt-lookup drafting."""

    draft: str = "pld"
    pld_ngram_size: int = DEFAULT_PLD_NGRAM_SIZE
    pld_max_lookup: int | None = None  # None: DEFAULT_PLD_MAX_LOOKUP on a GPU, CPU_PLD_MAX_LOOKUP on a CPU
    # Pad verify passes to a fixed length (None: on where the device is a GPU).
    pld_static_shapes: bool | None = None
    # Verify a draft only where the measured acceptance and pass costs say it
    # pays; off: verify every draft found (parity tests, ablations).
    pld_adaptive: bool = True
    # Queue the next verify pass before the current one is read back (greedy;
    # None: on where the device is a GPU).
    pld_pipeline: bool | None = None


@dataclass(frozen=True)
class KVConfig:
    """The KV cache kind: `fp16` is uncompressed, in the model's dtype."""

    kind: str = "fp16"
    bits: int = DEFAULT_KV_BITS


@dataclass(frozen=True)
class PromptCacheConfig:
    enabled: bool = True
    prewarm: bool = True
    max_bytes: int | None = None  # None: a share of the machine's memory
    cache_dir: Path | None = None
    prewarm_file: Path | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: str
    fuse: bool = True
    dtype: str | None = None  # cast floating weights (e.g. "float32" for exact CPU runs)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    prompt_cache: PromptCacheConfig = field(default_factory=PromptCacheConfig)
    # Plain-op attention for passes of 2..256 queries (PLD verify, prompt tails):
    # None = where the fused kernel builds per shape (MLX's CUDA backend).
    short_attention: bool | None = None
    batch_size: int | str | None = 1  # None: the device's default; "auto": fit the KV budget
    kv_budget_bytes: int | None = None  # batch KV cache budget (None: half the free memory)
    prefill_step_size: int = 2048
    # Pad prompt passes to a power-of-two length (then trim the pads): None = on a GPU,
    # where every new pass shape costs a build (MLX's CUDA backend).
    pad_prompts: bool | None = None
    # Batched decode steps as one compiled function over fixed-shape buffers
    # (`compiled_step`); False: the model called step by step on a growing cache.
    compiled_batch_step: bool = True
    # The compiled step through `step_forward` (few primitives) where it covers the
    # model; False: through the model's own layers.
    batch_step_forward: bool = True
    # Quantized layers dequantize their weight for a dense matmul from this many
    # rows of input on (transforms/quantized.py): an int, "auto" (on MLX's CUDA
    # backend only, where quantized_matmul loses at many rows), or None/0: never.
    dequantize_rows: int | str | None = "auto"
    # A quantized model's weights dequantized once at load (transforms/quantized.py):
    # True, False, or "auto" (on MLX's CUDA backend when they fit a share of its memory).
    dense_weights: bool | str = "auto"
    # Fuse quantized q/k/v and gate/up too (transforms/fusion.py says why not by default).
    fuse_quantized: bool = False


@dataclass(frozen=True)
class RunConfig:
    jobs_path: str  # a path, or "-" for stdin
    output_path: str  # a path, or "-" for stdout
    engine: EngineConfig
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    default_seed: int | None = None
    summary_path: Path | None = None
    quiet: bool = False
    fsync: bool = True
    retry_failed: bool = False
    # Under a launcher (`mlx.launch -n N`): ranks that hold one model copy
    # together (tensor parallel), an int, "all", or "auto": 1 unless the
    # weights do not fit a device. One process: 1.
    tensor_parallel: int | str = "auto"


@dataclass(frozen=True)
class JobPlan:
    """What the run's settings and the job's overrides resolve to."""

    decode: DecodeConfig
    kv: KVConfig

    @property
    def kv_kind(self) -> str:
        return "fp16" if self.kv.kind == "fp16" else f"turboquant-{self.kv.bits}"


# Real model shapes (random weights) for `batchgen bench --shape`: data only,
# so the command line can list them without loading MLX.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "qwen3-moe-small": dict(model_type="qwen3_moe", hidden_size=1024, num_hidden_layers=16,
                            intermediate_size=3072, num_attention_heads=16, num_key_value_heads=4,
                            head_dim=64, num_experts=16, num_experts_per_tok=4,
                            moe_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[],
                            norm_topk_prob=True, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, intermediate_size=384,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}  # fmt: skip
SHAPE_COMMON = dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1000000.0,
                    max_position_embeddings=65536, vocab_size=151936)  # fmt: skip
