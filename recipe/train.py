"""A small decoder written directly in PyTorch (qwen2, llama, qwen3 or qwen3_moe
architecture), its training loop, and its export to the safetensors + config.json layout
that `mlx_lm.load` reads.

The module tree mirrors Hugging Face's Qwen2ForCausalLM (and its llama/qwen3/qwen3_moe
siblings) so that `state_dict()` keys are already the names mlx-lm expects
(`model.layers.0.self_attn.q_proj.weight`, `model.layers.0.mlp.experts.3.up_proj.weight`,
...).
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from recipe.model_config import ARCHITECTURES, ModelConfig  # noqa: F401 - re-exported

IGNORE_INDEX = -100


# ---------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 as HF Qwen2 and mlx do; bf16 variance is too coarse.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (max_positions, head_dim), halves duplicated (rotate-half layout)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(
        torch.arange(config.max_position_embeddings, dtype=torch.float64), inv_freq
    )
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout  # on the attention weights, in training only
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        dim = config.hidden_size
        bias = config.arch == "qwen2"  # q/k/v biases; llama's attention_bias is false
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        if config.arch in ("qwen3", "qwen3_moe"):
            # Over head_dim, on each head, before RoPE (Qwen3Attention).
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Query head h reads kv head h // group, as in HF repeat_kv and mlx's GQA.
        group = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's sparse MLP: router `gate`, experts `experts.{e}` (SwiGLU MLPs of width
    moe_intermediate_size). Routing as mlx-lm computes it: softmax over all experts in
    float32, the top num_experts_per_tok probabilities, renormalized to sum 1 when
    norm_topk_prob, each chosen expert's output weighted by its probability.

    Every expert runs on every token (three matmuls over the experts' weights side by
    side) and the experts not chosen get weight 0: the same function as sparse dispatch,
    simpler and, at these sizes, fast. In training mode the forward also returns the
    Switch-Transformer load-balancing loss (num_experts * sum_e f_e * P_e: f_e the share of
    the top-k choices that go to expert e, P_e its mean router probability; 1 when the
    routing is uniform), else None."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )

    def routing_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, probs), both (..., num_experts): the top-k-masked (and renormalized)
        weights and the full softmax probabilities, float32."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter(-1, chosen, top), probs

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        weights, probs = self.routing_weights(x)
        gate = torch.cat([e.gate_proj.weight for e in self.experts])  # (E * I, hidden)
        up = torch.cat([e.up_proj.weight for e in self.experts])
        down = torch.cat([e.down_proj.weight for e in self.experts], dim=1)  # (hidden, E * I)
        h = F.silu(F.linear(x, gate)) * F.linear(x, up)
        # Weighting before the (linear) down projection = weighting each expert's output.
        h = h.unflatten(-1, (self.num_experts, -1)) * weights.to(h.dtype).unsqueeze(-1)
        out = F.linear(h.flatten(-2), down)
        aux = None
        if self.training:
            chosen = (weights > 0).float().reshape(-1, self.num_experts)
            share = chosen.mean(0) / self.top_k
            aux = self.num_experts * (share * probs.reshape(-1, self.num_experts).mean(0)).sum()
        return out, aux


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dropout: float = 0.0, attention_dropout: float = 0.0):
        super().__init__()
        self.self_attn = Attention(config, attention_dropout)
        if config.arch == "qwen3_moe":
            self.mlp = SparseMoeBlock(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Residual dropout (GPT-2 style) on each branch's output; identity in eval mode,
        # and no parameters: the export is the same with or without it.
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, the MoE load-balancing loss in training mode, else None)."""
        h = x + self.dropout(self.self_attn(self.input_layernorm(x), cos, sin))
        out = self.mlp(self.post_attention_layernorm(h))
        out, aux = out if isinstance(out, tuple) else (out, None)
        return h + self.dropout(out), aux


class Qwen2Body(nn.Module):
    def __init__(self, config: ModelConfig, dropout: float = 0.0, attention_dropout: float = 0.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dropout, attention_dropout)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen2ForCausalLM(nn.Module):
    """The model of every arch (config.arch); the name is that of the default one.

    Tied embeddings: the output projection is embed_tokens.weight, no lm_head.

    `dropout` (residual branches and embeddings) and `attention_dropout` act in training
    mode only; they are not part of ModelConfig since the exported model has none.
    After a training-mode forward of a qwen3_moe model, `aux_loss` holds the mean over
    layers of the load-balancing loss (None otherwise)."""

    def __init__(self, config: ModelConfig, dropout: float = 0.0, attention_dropout: float = 0.0):
        super().__init__()
        self.config = config
        self.model = Qwen2Body(config, dropout, attention_dropout)
        self.embed_dropout = nn.Dropout(dropout)
        cos, sin = rope_tables(config)
        # Not persistent: the export must contain only the weights mlx-lm knows.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.aux_loss = None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        # Residual-branch outputs are scaled down so the residual stream's variance stays
        # roughly constant with depth (GPT-2 style).
        residual_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(".bias"):
                nn.init.zeros_(param)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, std=residual_std)
            else:
                nn.init.normal_(param, std=std)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final-norm outputs, (batch, length, hidden)."""
        length = input_ids.shape[1]
        cos, sin = self.rope_cos[:length], self.rope_sin[:length]
        h = self.embed_dropout(self.model.embed_tokens(input_ids))
        aux = []
        for layer in self.model.layers:
            h, layer_aux = layer(h, cos, sin)
            if layer_aux is not None:
                aux.append(layer_aux)
        self.aux_loss = torch.stack(aux).mean() if aux else None
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.model.embed_tokens.weight.t()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- export


def export_model(
    model: Qwen2ForCausalLM,
    out_dir: Path,
    eos_token_id: int,
    pad_token_id: int,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Write model.safetensors (Hugging Face names of config.arch) and config.json; return
    the file's bytes."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {
        name: tensor.detach().to("cpu", dtype).contiguous()
        for name, tensor in model.state_dict().items()
    }
    weights_path = out_dir / "model.safetensors"
    save_file(weights, str(weights_path), metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    config = model.config.hf_config(eos_token_id, pad_token_id, dtype_name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return weights_path.stat().st_size


# ---------------------------------------------------------------- data


@dataclass
class Examples:
    """Tokenized chats, concatenated: example i is tokens[starts[i] : starts[i] + lengths[i]],
    and its first prompt_lengths[i] tokens are the prompt (no loss there)."""

    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def target_tokens(self) -> int:
        return int((self.lengths - self.prompt_lengths).sum())

    @classmethod
    def from_pairs(cls, prompts: list[list[int]], answers: list[list[int]], max_len: int):
        """Keep pairs whose training input (all tokens but the last) fits in max_len."""
        kept = [(p, a) for p, a in zip(prompts, answers) if len(p) + len(a) - 1 <= max_len]
        lengths = np.array([len(p) + len(a) for p, a in kept], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        pieces = [np.asarray(x, dtype=np.int32) for pair in kept for x in pair]
        return cls(
            tokens=np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32),
            starts=starts,
            lengths=lengths,
            prompt_lengths=np.array([len(p) for p, _ in kept], dtype=np.int64),
        )


def plan_batches(
    examples: Examples, batch_tokens: int, rng: np.random.Generator, bucket: int = 64
) -> list[np.ndarray]:
    """One epoch of batches: examples grouped by padded length (a multiple of `bucket`),
    rows per batch = batch_tokens // padded length, order shuffled. Padding waste stays
    small, and causal attention never needs a mask: pads sit after the real tokens."""
    padded = -(-(examples.lengths - 1) // bucket) * bucket
    batches = []
    for length in np.unique(padded):
        members = rng.permutation(np.flatnonzero(padded == length))
        rows = max(1, batch_tokens // int(length))
        batches += [members[i : i + rows] for i in range(0, len(members), rows)]
    # A single-row leftover would be a new batch shape (torch.compile specializes size 1).
    batches = [b for b in batches if len(b) > 1] or batches
    return [batches[i] for i in rng.permutation(len(batches))]


def make_batch(examples: Examples, rows: np.ndarray, pad_id: int, bucket: int = 64):
    """(inputs, targets) int64 arrays; targets are IGNORE_INDEX except on answer tokens."""
    inputs_len = examples.lengths[rows] - 1
    width = int(-(-inputs_len.max() // bucket) * bucket)
    inputs = np.full((len(rows), width), pad_id, dtype=np.int64)
    targets = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
    for r, i in enumerate(rows):
        seq = examples.tokens[examples.starts[i] : examples.starts[i] + examples.lengths[i]]
        n, p = len(seq), int(examples.prompt_lengths[i])
        inputs[r, : n - 1] = seq[:-1]
        # Position t predicts seq[t + 1]: from p - 1 on, that is an answer token.
        targets[r, p - 1 : n - 1] = seq[p:]
    return inputs, targets


def fixed_batches(examples: Examples, batch_tokens: int, bucket: int = 64) -> list[np.ndarray]:
    """Every example exactly once, in batches of similar padded length within
    batch_tokens (a lone over-long example gets a batch of its own); deterministic."""
    padded = -(-(examples.lengths - 1) // bucket) * bucket
    batches, current, width = [], [], 0
    for i in np.argsort(padded, kind="stable"):
        new_width = max(width, int(padded[i]))
        if current and new_width * (len(current) + 1) > batch_tokens:
            batches.append(np.array(current))
            current, new_width = [], int(padded[i])
        current.append(int(i))
        width = new_width
    if current:
        batches.append(np.array(current))
    return batches


class HeldOut:
    """A fixed held-out subset in named groups (e.g. "edit", "write_function"): answer
    loss per group, in eval mode (no dropout), without gradients, eagerly (a compiled
    layer would recompile for eval mode). The batches are built once."""

    def __init__(self, groups: dict[str, Examples], pad_id: int, batch_tokens: int):
        self.groups = {
            name: [make_batch(ex, rows, pad_id) for rows in fixed_batches(ex, batch_tokens)]
            for name, ex in groups.items()
            if len(ex)
        }
        self.examples = {name: len(ex) for name, ex in groups.items()}

    @torch.no_grad()
    def losses(self, model: Qwen2ForCausalLM) -> dict[str, float]:
        device = next(model.parameters()).device
        was_training = model.training
        compiled = [layer._compiled_call_impl for layer in model.model.layers]
        decompile_layers(model)
        model.eval()
        loss_fn = loss_function(model, device)
        try:
            return {
                name: mean_answer_loss(loss_fn, batches, device)
                for name, batches in self.groups.items()
            }
        finally:
            for layer, impl in zip(model.model.layers, compiled):
                layer._compiled_call_impl = impl
            model.train(was_training)


def mean_answer_loss(loss_fn: Callable, batches, device: torch.device) -> float:
    """Answer-token loss over `batches` of (inputs, targets) host arrays, each batch
    weighted by its answer tokens; one host sync at the end."""
    total, count = torch.zeros((), device=device), 0
    for inputs_np, targets_np in batches:
        batch = device_batch(inputs_np, targets_np, device)
        n = len(batch[2])
        total += loss_fn(*batch).detach() * n
        count += n
    return (total / max(1, count)).item()


def selection_loss(losses: dict[str, float], select: str | None) -> float:
    """The loss that picks the best weights: group `select` when there is one, else the
    mean of all groups."""
    if not losses:
        return float("nan")
    if select in losses:
        return losses[select]
    return sum(losses.values()) / len(losses)


class BestWeights:
    """A copy (on the model's device) of the weights with the lowest held-out loss so far."""

    def __init__(self):
        self.loss, self.step, self.seconds, self.state = math.inf, None, None, None

    def update(self, model: nn.Module, loss: float, step: int, seconds: float) -> bool:
        if not loss < self.loss:  # NaN never counts as better
            return False
        self.loss, self.step, self.seconds = loss, step, seconds
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return True

    def restore(self, model: nn.Module) -> bool:
        if self.state is None:
            return False
        model.load_state_dict(self.state)
        return True


# ---------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainConfig:
    minutes: float = 5.0
    max_steps: int = 1_000_000
    batch_tokens: int = 65536
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "auto"
    compile: str = "auto"  # auto = on CUDA only
    # By time, so that a run logs the same number of lines at any speed; held-out losses
    # (when a HeldOut set is given) are measured at every log line.
    log_every_s: float = 15.0
    keep_best: bool = True  # end with the weights of the best held-out loss
    select: str = "edit"  # the HeldOut group whose loss picks the best weights
    # qwen3_moe: weight of the load-balancing loss added to the training loss (not to the
    # reported losses); the Switch Transformer's 0.01.
    router_aux_loss_coef: float = 0.01


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lr_at(config: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup by steps, then cosine to min_lr_ratio by progress (0..1, the larger
    of the step fraction and the wall-clock fraction, since the budget is in minutes)."""
    warmup = min(1.0, (step + 1) / config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * warmup * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def make_optimizer(model: nn.Module, config: TrainConfig, device: torch.device):
    """AdamW; no weight decay on norms, biases and the (tied) embedding."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if param.ndim == 2 and "embed_tokens" not in name else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def device_batch(inputs: np.ndarray, targets: np.ndarray, device: torch.device) -> tuple:
    """(inputs, answer positions, answer targets) on the device. The positions (flat
    indices of the answer tokens, found on the host: no device sync) let the loss compute
    logits for answer tokens only, about a third of all tokens."""
    flat = targets.reshape(-1)
    positions = np.flatnonzero(flat != IGNORE_INDEX)
    return (
        _to_device(inputs, device),
        _to_device(positions, device),
        _to_device(np.ascontiguousarray(flat[positions]), device),
    )


def loss_function(model: nn.Module, device: torch.device) -> Callable:
    """loss_fn(inputs, positions, answer_targets) -> mean answer-token cross-entropy."""
    autocast = device.type == "cuda"

    def loss_fn(inputs: torch.Tensor, positions: torch.Tensor, answers: torch.Tensor):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            hidden = model.hidden_states(inputs)
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
            logits = model.logits(hidden)
        return F.cross_entropy(logits.float(), answers)

    return loss_fn


def compile_layers(model: Qwen2ForCausalLM, mode: str, device: torch.device, log: Callable) -> bool:
    """Compile each decoder layer (regional compilation): the layers share one graph, so
    compile time is that of one layer, and dynamic shapes cover every batch bucket."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return False
    try:
        import torch._dynamo

        # A compile failure must cost speed, never the run.
        torch._dynamo.config.suppress_errors = True
        torch._dynamo.config.cache_size_limit = 64
        for layer in model.model.layers:
            layer.compile(dynamic=True)
        return True
    except Exception as error:  # noqa: BLE001 - any failure means: run eagerly
        log(f"torch.compile unavailable ({type(error).__name__}: {error}); running eagerly")
        decompile_layers(model)
        return False


def decompile_layers(model: Qwen2ForCausalLM) -> None:
    for layer in model.model.layers:
        layer._compiled_call_impl = None  # what nn.Module.compile set


class StopFlag:
    """Set by SIGTERM/SIGINT so that a killed run still exports what it has learned."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.stop = False
        self._previous = {}

    def install(self) -> None:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass

    def uninstall(self) -> None:
        """Back to the previous handlers: after training, a signal should stop the process."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.stop = True


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def batch_stream(examples: Examples, batch_tokens: int, rng: np.random.Generator):
    """(epoch, rows) forever, reshuffled every epoch."""
    epoch = 0
    while True:
        for rows in plan_batches(examples, batch_tokens, rng):
            yield epoch, rows
        epoch += 1


class Progress:
    """Fraction of the budget used: the larger of the step fraction and the time fraction,
    the time counted from the end of the first step, so that compile time does not eat
    the warmup and the cosine spans the steps that actually run."""

    def __init__(self, budget_s: float, max_steps: int):
        self.start_s = time.time()
        self.budget_s, self.max_steps = budget_s, max_steps
        self.first_step_end = None

    def first_step_done(self) -> float:
        self.first_step_end = time.time()
        return self.first_step_end - self.start_s

    def fraction(self, step: int) -> float:
        if self.first_step_end is None:
            return step / self.max_steps
        left_s = max(1.0, self.budget_s - (self.first_step_end - self.start_s))
        return max((time.time() - self.first_step_end) / left_s, step / self.max_steps)

    def out_of_time(self) -> bool:
        return time.time() - self.start_s >= self.budget_s


class LossMeter:
    """Sums losses on the device and syncs only when it reports (every log_every_s)."""

    def __init__(self, device: torch.device, log_every_s: float):
        self.total = torch.zeros((), device=device)
        self.log_every_s = log_every_s
        self.steps, self.tokens, self.window_start = 0, 0, time.time()
        self.last_loss, self.curve = float("nan"), []

    def add(self, loss: torch.Tensor, tokens: int) -> None:
        self.total += loss.detach()
        self.steps += 1
        self.tokens += tokens

    def report(self, step: int, elapsed_s: float, force: bool = False) -> str | None:
        now = time.time()
        if not self.steps or (not force and now - self.window_start < self.log_every_s):
            return None
        self.last_loss = (self.total / self.steps).item()
        tokens_per_s = self.tokens / max(1e-9, now - self.window_start)
        self.curve.append([step, round(elapsed_s, 1), round(self.last_loss, 4)])
        self.total.zero_()
        self.steps, self.tokens, self.window_start = 0, 0, now
        return f"loss {self.last_loss:.4f} {tokens_per_s:,.0f} tok/s elapsed {elapsed_s:.0f}s"


def train_step(
    model, optimizer, loss_fn, batch: tuple, grad_clip: float, aux_coef: float = 0.0
) -> torch.Tensor:
    """One optimizer step; returns the answer loss (without the MoE auxiliary loss)."""
    loss = loss_fn(*batch)
    aux = getattr(model, "aux_loss", None)
    (loss + aux_coef * aux if aux_coef and aux is not None else loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def train(
    model: Qwen2ForCausalLM,
    examples: Examples,
    config: TrainConfig,
    pad_id: int,
    log: Callable[[str], None] = print,
    stop: StopFlag | None = None,
    held_out: HeldOut | None = None,
) -> dict:
    """Train in place until the step or time budget runs out; return a summary. With a
    `held_out` set, its losses are measured at every log line and the model ends with
    the weights of the lowest one (config.keep_best)."""
    device = pick_device(config.device)
    torch.manual_seed(config.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model.to(device).train()
    optimizer = make_optimizer(model, config, device)
    loss_fn = loss_function(model, device)
    progress = Progress(config.minutes * 60, config.max_steps)
    compiled = compile_layers(model, config.compile, device, log)
    meter = LossMeter(device, config.log_every_s)
    stop = stop or StopFlag()
    count = Counts()
    tracker = Tracker(held_out, config, log)
    log(f"training on {device}: {len(examples)} examples, {examples.target_tokens} answer tokens")
    for count.epoch, rows in batch_stream(
        examples, config.batch_tokens, np.random.default_rng(config.seed)
    ):
        if count.steps >= config.max_steps or progress.out_of_time() or stop.stop:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(config, count.steps, progress.fraction(count.steps))
        inputs_np, targets_np = make_batch(examples, rows, pad_id)
        batch = device_batch(inputs_np, targets_np, device)
        try:
            loss = train_step(
                model, optimizer, loss_fn, batch, config.grad_clip, config.router_aux_loss_coef
            )
        except Exception as error:  # noqa: BLE001 - a compiled-graph failure
            if not compiled:
                raise
            log(f"compiled step failed ({type(error).__name__}: {error}); continuing eagerly")
            optimizer.zero_grad(set_to_none=True)
            decompile_layers(model)
            compiled = False
            loss = train_step(
                model, optimizer, loss_fn, batch, config.grad_clip, config.router_aux_loss_coef
            )
        count.steps += 1
        count.tokens += inputs_np.size
        count.real_tokens += int((examples.lengths[rows] - 1).sum())
        meter.add(loss, inputs_np.size)
        if count.steps == 1:
            note = " (includes compile)" if compiled else ""
            log(f"first step done after {progress.first_step_done():.1f}s{note}")
        line = meter.report(count.steps, time.time() - progress.start_s)
        if line:
            lr = optimizer.param_groups[0]["lr"]
            line += tracker.measure(model, count.steps, time.time() - progress.start_s, meter)
            log(f"step {count.steps} epoch {count.epoch} lr {lr:.2e} {line}")
    line = meter.report(count.steps, time.time() - progress.start_s, force=True)
    if line:
        line += tracker.measure(model, count.steps, time.time() - progress.start_s, meter)
        log(f"final: step {count.steps} {line}")
    decompile_layers(model)  # evaluation and export run eagerly: no second compile
    count.compiled = compiled
    count.stopped_by = (
        "signal" if stop.stop else ("steps" if count.steps >= config.max_steps else "time")
    )
    summary = training_summary(config, device, progress, meter, count)
    summary.update(tracker.finish(model))
    return summary


class Tracker:
    """Held-out losses at every log line, their curve, and the best weights."""

    def __init__(self, held_out: HeldOut | None, config: TrainConfig, log: Callable):
        self.held_out, self.config, self.log = held_out, config, log
        self.best = BestWeights()
        self.curve, self.eval_s = [], 0.0

    def measure(self, model, step: int, seconds: float, meter: LossMeter) -> str:
        if self.held_out is None:
            return ""
        start = time.time()
        losses = self.held_out.losses(model)
        loss = selection_loss(losses, self.config.select)
        improved = self.best.update(model, loss, step, seconds)  # restored if keep_best
        self.eval_s += time.time() - start
        self.curve.append(
            {
                "step": step,
                "seconds": round(seconds, 1),
                "train_loss": round(meter.last_loss, 4),
                "held_out_loss": round(loss, 4),
                **{f"held_out_{name}": round(value, 4) for name, value in losses.items()},
            }
        )
        parts = " ".join(f"{name} {value:.4f}" for name, value in losses.items())
        return f" | held-out {parts}{' *' if improved else ''}"

    def finish(self, model) -> dict:
        """Restore the best weights (when they are not the last ones); the summary part."""
        if self.held_out is None:
            return {}
        final_step = self.curve[-1]["step"] if self.curve else None
        restored = (
            self.config.keep_best and self.best.step != final_step and self.best.restore(model)
        )
        if restored:
            self.log(
                f"restored the weights of step {self.best.step} (held-out "
                f"{self.config.select} loss {self.best.loss:.4f})"
            )
        self.best.state = None  # free the copy
        return {
            "held_out_examples": self.held_out.examples,
            "held_out_select": self.config.select,
            "held_out_eval_s": round(self.eval_s, 1),
            "held_out_curve": self.curve,
            "best": {
                "step": self.best.step,
                "seconds": None if self.best.seconds is None else round(self.best.seconds, 1),
                "held_out_loss": None if self.best.step is None else round(self.best.loss, 4),
                "restored": bool(restored),
            },
        }


@dataclass
class Counts:
    steps: int = 0
    epoch: int = 0
    tokens: int = 0  # padded batch tokens
    real_tokens: int = 0
    compiled: bool = False
    stopped_by: str = ""


def training_summary(config, device, progress: Progress, meter: LossMeter, count: Counts) -> dict:
    """The figures recipe.json keeps."""
    train_s = time.time() - progress.start_s
    steady_s = time.time() - (progress.first_step_end or progress.start_s)
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "steps": count.steps,
        "epochs_completed": count.epoch,
        "final_loss": meter.last_loss,
        "train_s": round(train_s, 1),
        "first_step_s": round((progress.first_step_end or time.time()) - progress.start_s, 1),
        "tokens_seen": count.tokens,
        "real_tokens_seen": count.real_tokens,
        "tokens_per_s": round(count.tokens / max(1e-9, train_s)),
        "steady_tokens_per_s": (
            round(count.tokens / max(1e-9, steady_s)) if count.steps > 1 else None
        ),
        "stopped_by": count.stopped_by,
        "compiled": count.compiled,
        "loss_curve": meter.curve,
        "config": asdict(config),
    }


@torch.no_grad()
def evaluate_loss(
    model: Qwen2ForCausalLM, examples: Examples, pad_id: int, batch_tokens: int, max_batches: int
) -> float:
    """Mean answer-token loss over a few batches."""
    if len(examples) == 0:
        return float("nan")
    device = next(model.parameters()).device
    model.eval()
    loss_fn = loss_function(model, device)
    rows = plan_batches(examples, batch_tokens, np.random.default_rng(0))[:max_batches]
    loss = mean_answer_loss(loss_fn, (make_batch(examples, r, pad_id) for r in rows), device)
    model.train()
    return loss
