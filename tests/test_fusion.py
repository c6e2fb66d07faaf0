"""Weight fusion: parity with the unfused model, report counts, memory, batching."""

from __future__ import annotations

import dataclasses
import gc

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import batch_generate, generate, load
from mlx_lm.models import mamba, phi3, qwen3_5_moe
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from batchgen.transforms.fusion import KEEP_FALLBACK_ENV, FusedSlice, FusionReport, fuse_model, use_fallback
from tiny import build_model

DECODE_STEPS = 20
# 40 prompt tokens x 2 experts per token >= 64: SwitchGLU's sorted path runs in
# prefill and its unsorted path in decode, so both see the fused experts.
PROMPT_TOKENS = 40
FLOAT32_ATOL = 1e-5
# CPU matmuls compute each output element independently, so bf16 is exact here;
# on GPU backends fused and unfused GEMMs may round differently. Two bf16 ulps
# at the tiny models' logit scale (|logit| < 8) leaves room for that.
BF16_ATOL = 2 * 2.0**-5

# Tiny models (see tests/tiny.py): name -> (arch, build options).
MODELS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_5": ("qwen3_5", {}),
    "qwen2_4bit": ("qwen2", {"quantize_bits": 4}),
    # moe_intermediate_size 48 is not a multiple of the group size; 64 is.
    "qwen3_moe_4bit": ("qwen3_moe", {"quantize_bits": 4, "moe_intermediate_size": 64}),
    "qwen2_bf16": ("qwen2", {"dtype": "bfloat16"}),
    # Every input size a multiple of 64, so any group size fits.
    "qwen3_moe_wide": ("qwen3_moe", {"moe_intermediate_size": 64}),
    # head_dim 32: a quantized KV cache needs groups of at least 32.
    "qwen2_hd32": ("qwen2", {"num_attention_heads": 2, "num_key_value_heads": 1}),
}

EXPECTED_COUNTS = {
    "llama": dict(qkv=2, gate_up=2, experts=0, skipped=0),
    "qwen2": dict(qkv=2, gate_up=2, experts=0, skipped=0),
    "qwen3": dict(qkv=2, gate_up=2, experts=0, skipped=0),
    "qwen3_moe": dict(qkv=2, gate_up=0, experts=2, skipped=0),
    # 4 layers, full attention every 2nd: 2 attention + 2 recurrent layers
    # (whose in_proj_qkv is already one projection), a dense MLP in each.
    "qwen3_5": dict(qkv=2, gate_up=4, experts=0, skipped=2),
    "qwen2_4bit": dict(qkv=2, gate_up=2, experts=0, skipped=0),
    "qwen3_moe_4bit": dict(qkv=2, gate_up=0, experts=2, skipped=0),
}


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    built = {}

    def path(name):
        if name not in built:
            arch, options = MODELS[name]
            built[name] = build_model(arch, tmp_path_factory.mktemp(name), **options)
        return built[name]

    return path


def load_pair(path):
    """The same saved model loaded twice: (unfused, fused, report)."""
    unfused, _ = load_model(path)
    fused, _ = load_model(path)
    report = fuse_model(fused, keep_fallback=False, quantized=True)
    return unfused, fused, report


def prompt_tokens(batch=1, length=PROMPT_TOKENS, seed=0):
    return mx.random.randint(0, 300, (batch, length), key=mx.random.key(seed))


def greedy_trace(model, prompt, steps=DECODE_STEPS, cache=None):
    """Prefill, then `steps` greedy steps.

    Returns tokens (B, steps) and the logits before each token (B, steps + 1, V).
    """
    cache = make_prompt_cache(model) if cache is None else cache
    logits = model(prompt, cache=cache)[:, -1]
    tokens, all_logits = [], [logits]
    for _ in range(steps):
        y = logits.argmax(-1)
        tokens.append(y)
        logits = model(y[:, None], cache=cache)[:, -1]
        all_logits.append(logits)
    return mx.stack(tokens, 1), mx.stack(all_logits, 1)


def max_abs_diff(a, b):
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def active_bytes():
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def group_bytes(model):
    """nbytes of each q/k/v and gate/up group of an unfused model."""
    sizes = []
    for _, m in model.named_modules():
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            if all(isinstance(m.get(n), nn.Module) for n in names):
                sizes.append(
                    sum(
                        v.nbytes
                        for n in names
                        for _, v in tree_flatten(m[n].parameters())
                    )
                )
    return sizes


def tree_nbytes(model):
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize(
    "name",
    ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen2_4bit", "qwen3_moe_4bit"],
)
def test_float32_parity_and_counts(model_path, name):
    unfused, fused, report = load_pair(model_path(name))
    expected = EXPECTED_COUNTS[name]
    assert (report.qkv, report.gate_up, report.experts, len(report.skipped)) == (
        expected["qkv"],
        expected["gate_up"],
        expected["experts"],
        expected["skipped"],
    ), report

    prompt = prompt_tokens()
    tokens_a, logits_a = greedy_trace(unfused, prompt)
    tokens_b, logits_b = greedy_trace(fused, prompt)
    assert tokens_a.tolist() == tokens_b.tolist()
    assert max_abs_diff(logits_a, logits_b) <= FLOAT32_ATOL
    # The tiny models must actually move, or token parity proves little.
    assert len(set(tokens_a[0].tolist())) > 3


def test_qwen3_5_moe_shared_experts():
    """Experts and the shared expert's MLP both fuse (model built in memory)."""
    config = dict(
        model_type="qwen3_5_moe",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=320,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        full_attention_interval=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        rope_parameters={
            "type": "default",
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.5,
        },
    )
    unfused = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))
    mx.eval(unfused.parameters())
    fused = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))
    fused.update(unfused.parameters())
    report = fuse_model(fused, keep_fallback=False, quantized=True)
    assert (report.qkv, report.gate_up, report.experts, len(report.skipped)) == (
        2,
        4,
        4,
        2,
    )
    prompt = prompt_tokens()
    tokens_a, logits_a = greedy_trace(unfused, prompt)
    tokens_b, logits_b = greedy_trace(fused, prompt)
    assert tokens_a.tolist() == tokens_b.tolist()
    assert max_abs_diff(logits_a, logits_b) <= FLOAT32_ATOL


def test_qwen3_5_recurrent_layers_reported(model_path):
    _, _, report = load_pair(model_path("qwen3_5"))
    assert all("linear_attn" in s and "in_proj_qkv" in s for s in report.skipped)


def test_bf16_teacher_forced_logits(model_path):
    unfused, fused, report = load_pair(model_path("qwen2_bf16"))
    assert report.qkv == 2 and report.gate_up == 2
    prompt = prompt_tokens()
    # Greedy tokens may legitimately part ways after a near tie in bf16, so both
    # models read the unfused model's continuation (teacher forcing).
    continuation, _ = greedy_trace(unfused, prompt)
    forced = mx.concatenate([prompt, continuation], axis=1)
    reference = unfused(forced)
    assert mx.abs(reference).max().item() < 8  # the scale BF16_ATOL assumes
    assert max_abs_diff(reference, fused(forced)) <= BF16_ATOL

    cache_a, cache_b = make_prompt_cache(unfused), make_prompt_cache(fused)
    diffs = [max_abs_diff(unfused(prompt, cache=cache_a), fused(prompt, cache=cache_b))]
    for t in continuation[0].tolist():
        step = mx.array([[t]])
        diffs.append(
            max_abs_diff(unfused(step, cache=cache_a), fused(step, cache=cache_b))
        )
    assert max(diffs) <= BF16_ATOL


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_batched_inputs(model_path, name):
    unfused, fused, _ = load_pair(model_path(name))
    prompt = prompt_tokens(batch=2)
    tokens_a, logits_a = greedy_trace(unfused, prompt, steps=6)
    tokens_b, logits_b = greedy_trace(fused, prompt, steps=6)
    assert tokens_a.tolist() == tokens_b.tolist()
    assert max_abs_diff(logits_a, logits_b) <= FLOAT32_ATOL
    # Multi-token steps on a populated cache (B=2, L=5), as a verify pass does.
    cache_a, cache_b = make_prompt_cache(unfused), make_prompt_cache(fused)
    unfused(prompt, cache=cache_a)
    fused(prompt, cache=cache_b)
    chunk = prompt_tokens(batch=2, length=5, seed=1)
    assert (
        max_abs_diff(unfused(chunk, cache=cache_a), fused(chunk, cache=cache_b))
        <= FLOAT32_ATOL
    )


def test_under_mx_compile(model_path):
    """Parts match by identity inside a compiled trace too (tracer arrays)."""
    unfused, fused, _ = load_pair(model_path("qwen3_moe"))
    compiled = mx.compile(lambda tokens: fused(tokens))
    for length in (9, 3):
        prompt = prompt_tokens(batch=2, length=length)
        assert max_abs_diff(unfused(prompt), compiled(prompt)) <= FLOAT32_ATOL


def test_mlx_lm_generate_and_quantized_kv_cache(model_path):
    path = model_path("qwen2_hd32")
    unfused, tokenizer = load(str(path))
    fused, _ = load(str(path))
    fuse_model(fused, keep_fallback=False, quantized=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Rename the variable count to total."}],
        add_generation_prompt=True,
    )
    for kv in ({}, {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0}):
        text_a = generate(unfused, tokenizer, prompt, max_tokens=DECODE_STEPS, **kv)
        text_b = generate(fused, tokenizer, prompt, max_tokens=DECODE_STEPS, **kv)
        assert text_a and text_a == text_b

    # Left-padded batch of prompts of different lengths (BatchKVCache).
    prompts = [prompt, prompt[:-7], tokenizer.encode("def add(a, b):")]
    out_a = batch_generate(
        unfused, tokenizer, prompts, max_tokens=8, return_token_ids=True
    )
    out_b = batch_generate(
        fused, tokenizer, prompts, max_tokens=8, return_token_ids=True
    )
    assert out_a.token_ids == out_b.token_ids


@pytest.mark.parametrize("name", ["qwen2", "qwen3_moe", "qwen3_moe_4bit"])
def test_memory_fallback_dropped(model_path, name, monkeypatch):
    monkeypatch.delenv(KEEP_FALLBACK_ENV, raising=False)
    path = model_path(name)
    base = active_bytes()
    model, _ = load_model(path)
    unfused_bytes = active_bytes() - base
    largest_group = max(group_bytes(model))
    originals = sum(group_bytes(model))
    tree_before = tree_nbytes(model)

    mx.reset_peak_memory()
    report = fuse_model(model, quantized=True)
    peak_bytes = mx.get_peak_memory() - base
    fused_bytes = active_bytes() - base

    assert fused_bytes <= 1.02 * unfused_bytes
    assert peak_bytes <= unfused_bytes + largest_group
    assert report.bytes_freed == originals
    # parameters() describes what runs: same bytes, fused names, nothing twice.
    assert tree_nbytes(model) == tree_before
    keys = [k for k, _ in tree_flatten(model.parameters())]
    assert not any(k.endswith(("q_proj.weight", "gate_proj.weight")) for k in keys)
    assert any(k.endswith("qkv_proj.weight") for k in keys)


def test_keep_fallback_keeps_originals(model_path, monkeypatch):
    path = model_path("qwen2")
    base = active_bytes()
    model, _ = load_model(path)
    unfused_bytes = active_bytes() - base
    originals = sum(group_bytes(model))

    monkeypatch.setenv(KEEP_FALLBACK_ENV, "1")
    report = fuse_model(model, quantized=True)
    fused_bytes = active_bytes() - base
    assert report.bytes_freed == 0
    assert fused_bytes == pytest.approx(unfused_bytes + originals, rel=0.01)

    prompt = prompt_tokens()
    fused_logits = model(prompt)
    assert use_fallback(model) == 10  # 2 layers x (3 + 2) slices
    assert max_abs_diff(model(prompt), fused_logits) <= FLOAT32_ATOL
    use_fallback(model, False)


def test_use_fallback_needs_kept_originals(model_path):
    _, fused, _ = load_pair(model_path("qwen2"))
    with pytest.raises(ValueError, match=KEEP_FALLBACK_ENV):
        use_fallback(fused)


def test_one_fused_matmul_per_group(model_path):
    _, fused, _ = load_pair(model_path("qwen3_moe"))
    calls = []

    class Counting(nn.Module):
        def __init__(self, inner, path):
            super().__init__()
            self.inner = inner
            self.path = path

        def __call__(self, *args, **kwargs):
            calls.append(self.path)
            return self.inner(*args, **kwargs)

    owners = [
        (p, m)
        for p, m in fused.named_modules()
        if "qkv_proj" in m or "gate_up_proj" in m
    ]
    for path, owner in owners:
        name = "qkv_proj" if "qkv_proj" in owner else "gate_up_proj"
        setattr(owner, name, Counting(owner[name], path))
    mx.eval(fused(prompt_tokens()))
    assert sorted(calls) == sorted(p for p, _ in owners)


def test_decode_parts_are_views(model_path):
    """At B = L = 1 the q/k/v parts are row-contiguous views: no copy kernels."""
    _, fused, _ = load_pair(model_path("qwen2"))
    attn = fused.model.layers[0].self_attn
    x = mx.random.normal((1, 1, 64))
    parts = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    mx.eval(parts)
    heads = (attn.n_heads, attn.n_kv_heads, attn.n_kv_heads)
    shaped = [
        p.reshape(1, 1, h, -1).transpose(0, 2, 1, 3) for p, h in zip(parts, heads)
    ]
    before = active_bytes()
    made = [mx.contiguous(s) for s in shaped]
    mx.eval(made)
    assert active_bytes() == before


def test_mismatched_quantization_is_skipped(model_path):
    path = model_path("qwen2")

    def mixed(p, m):
        if p.endswith("k_proj"):
            return {"group_size": 32, "bits": 8}
        return hasattr(m, "to_quantized")

    unfused, _ = load_model(path)
    fused, _ = load_model(path)
    for model in (unfused, fused):
        nn.quantize(model, group_size=32, bits=4, class_predicate=mixed)
    report = fuse_model(fused, keep_fallback=False, quantized=True)
    assert (report.qkv, report.gate_up) == (0, 2)
    assert len(report.skipped) == 2
    assert all("bits 4/8/4" in s for s in report.skipped)
    prompt = prompt_tokens()
    assert (
        greedy_trace(unfused, prompt)[0].tolist()
        == greedy_trace(fused, prompt)[0].tolist()
    )


@pytest.mark.parametrize(
    "mode, group_size, bits",
    [("affine", 64, 8), ("affine", 32, 3), ("mxfp4", 32, 4), ("nvfp4", 16, 4)],
)
def test_quantization_modes(model_path, mode, group_size, bits):
    path = model_path("qwen3_moe_wide")
    unfused, _ = load_model(path)
    fused, _ = load_model(path)
    for model in (unfused, fused):
        nn.quantize(model, group_size=group_size, bits=bits, mode=mode)
    report = fuse_model(fused, keep_fallback=False, quantized=True)
    assert (report.qkv, report.experts, report.skipped) == (2, 2, ())
    prompt = prompt_tokens()
    assert max_abs_diff(unfused(prompt), fused(prompt)) <= FLOAT32_ATOL


def test_quantizing_a_fused_model(model_path):
    """nn.quantize after fusion swaps the fused layer; the parts follow it."""
    path = model_path("qwen2")
    unfused, _ = load_model(path)
    fused, _ = load_model(path)
    fuse_model(fused, keep_fallback=False, quantized=True)
    for model in (unfused, fused):
        nn.quantize(model, group_size=32, bits=4)
    assert isinstance(fused.model.layers[0].self_attn.qkv_proj, nn.QuantizedLinear)
    prompt = prompt_tokens()
    assert max_abs_diff(unfused(prompt), fused(prompt)) <= FLOAT32_ATOL


def test_fusing_twice_is_a_no_op(model_path):
    unfused, fused, _ = load_pair(model_path("qwen2"))
    again = fuse_model(fused, keep_fallback=False, quantized=True)
    assert (again.qkv, again.gate_up, again.experts, again.bytes_freed) == (0, 0, 0, 0)
    assert again.skipped and all("already fused" in s for s in again.skipped)
    prompt = prompt_tokens()
    assert max_abs_diff(unfused(prompt), fused(prompt)) <= FLOAT32_ATOL


def test_prefused_model_is_left_alone():
    args = phi3.ModelArgs(
        model_type="phi3",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=128,
    )
    model = phi3.Model(args)
    mx.eval(model.parameters())
    prompt = prompt_tokens(length=8) % 128
    expected = model(prompt)
    report = fuse_model(model, keep_fallback=False, quantized=True)
    assert (report.qkv, report.gate_up, report.experts, report.bytes_freed) == (
        0,
        0,
        0,
        0,
    )
    assert len(report.skipped) == 4
    assert any("qkv_proj" in s for s in report.skipped)
    assert any("gate_up_proj" in s for s in report.skipped)
    assert max_abs_diff(model(prompt), expected) == 0.0


@pytest.mark.parametrize("kind", ["recurrent", "plain"])
def test_nothing_to_fuse(kind):
    if kind == "recurrent":
        args = mamba.ModelArgs(
            model_type="mamba",
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            state_size=8,
            num_hidden_layers=2,
            conv_kernel=4,
            use_bias=False,
            use_conv_bias=True,
            time_step_rank=4,
        )
        model = mamba.Model(args)
    else:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    report = fuse_model(model, quantized=True)
    assert (report.qkv, report.gate_up, report.experts, report.bytes_freed) == (
        0,
        0,
        0,
        0,
    )
    assert report.skipped == ("<model>: no q/k/v or gate/up projections found",)


def test_report_as_dict():
    report = FusionReport(qkv=2, gate_up=3, experts=1, skipped=("a: b",), bytes_freed=7)
    assert report.as_dict() == {
        "qkv": 2,
        "gate_up": 3,
        "experts": 1,
        "skipped": ["a: b"],
        "bytes_freed": 7,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.qkv = 3


def test_slices_hold_no_parameters(model_path):
    _, fused, _ = load_pair(model_path("qwen3_moe"))
    slices = [m for _, m in fused.named_modules() if isinstance(m, FusedSlice)]
    assert len(slices) == 2 * 3 + 2 * 2
    assert all(not tree_flatten(s.parameters()) for s in slices)
