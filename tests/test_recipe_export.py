"""The torch model of the recipe and the same weights loaded by mlx-lm agree."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402

from recipe import tokenizer as tok  # noqa: E402
from recipe.train import ModelConfig, Qwen2ForCausalLM, count_parameters, export_model  # noqa: E402

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "Rename the local variable `count` to `total` everywhere in this function.",
    "class Point:\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n",
]


def small_config(vocab_size: int, hidden_size: int = 64, intermediate_size: int = 96,
                 max_position_embeddings: int = 64, **arch) -> ModelConfig:  # fmt: skip
    """2 layers, 4 query heads over 2 KV heads (GQA), the given widths; `arch` holds
    ModelConfig's arch, head_dim and expert fields."""
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        **arch,
    )


def tiny_model(vocab_size: int, seed: int = 0, hidden_size: int = 64, **arch) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = small_config(vocab_size, hidden_size, max_position_embeddings=256, **arch)
    model = Qwen2ForCausalLM(config)
    # Wider than the training init, and non-trivial norms and biases, so that a wrong
    # layout (rope halves, GQA grouping, bias, norm) shows up in the logits.
    model.reset_parameters(std=0.2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                param.add_(torch.randn_like(param) * 0.3)
            elif name.endswith("mlp.gate.weight"):
                param.mul_(5)  # decided routing: no near-ties in the top-k choice
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer():
    return tok.train_tokenizer(CORPUS * 10, vocab_size=300)


def export(tmp_path, model, tokenizer, dtype):
    ids = tok.special_token_ids(tokenizer)
    export_model(model, tmp_path, ids["<|im_end|>"], ids["<|endoftext|>"], dtype=dtype)
    tok.save_tokenizer(tokenizer, tmp_path)
    return tmp_path


def prompt_ids(tokenizer) -> list[int]:
    messages = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": CORPUS[0]}]
    return tokenizer.encode(tok.render_chat(messages)).ids


def mlx_logits(path, ids: list[int]) -> np.ndarray:
    model, _ = load(str(path))
    model.set_dtype(mx.float32)
    return np.array(model(mx.array([ids]))[0])


MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# (arch fields, hidden size): head dims 32, 64 and 128 for each arch; qwen2's head dim
# is hidden_size // heads (mlx-lm derives it), the others' is independent of the width.
ARCH_CASES = {
    f"{arch}-hd{head_dim}": (dict(arch=arch, head_dim=head_dim, **extra), hidden)
    for arch, extra in [("qwen2", {}), ("llama", {}), ("qwen3", {}), ("qwen3_moe", MOE)]
    for head_dim in (32, 64, 128)
    for hidden in [4 * head_dim if arch == "qwen2" else 64]
}
ARCH_CASES["qwen3_moe-hd32-top1-unnormalized"] = (
    dict(arch="qwen3_moe", head_dim=32, **{**MOE, "num_experts_per_tok": 1}, norm_topk_prob=False),
    64,
)
# Python source with indentation, blank lines, tabs, numbers and a contraction.
CODE = "def f(x):\n    if x:\n\n        return 12345  # it's 2\n\treturn  x * 0.5\r\n  \n"


def torch_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).float().numpy()[0]


def assert_close(actual: np.ndarray, expected: np.ndarray, rel: float) -> None:
    scale = np.abs(expected).max()
    assert np.abs(actual - expected).max() <= rel * scale, np.abs(actual - expected).max() / scale


def test_float32_export_matches_torch(tmp_path, tokenizer):
    model = tiny_model(tokenizer.get_vocab_size())
    path = export(tmp_path, model, tokenizer, torch.float32)
    ids = prompt_ids(tokenizer)
    assert len(ids) > 20
    assert_close(mlx_logits(path, ids), torch_logits(model, ids), rel=1e-3)


@pytest.mark.parametrize("case", sorted(ARCH_CASES))
def test_every_arch_and_head_dim_exports_to_mlx_lm(tmp_path, tokenizer, case):
    """float32 logits through mlx_lm.load equal the torch model's, and the loaded
    tokenizer gives the recipe tokenizer's ids for Python source and the chat prompt."""
    arch, hidden_size = ARCH_CASES[case]
    model = tiny_model(tokenizer.get_vocab_size(), hidden_size=hidden_size, **arch)
    path = export(tmp_path, model, tokenizer, torch.float32)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch["arch"] and config["head_dim"] == arch["head_dim"]
    loaded, wrapper = load(str(path))
    assert type(loaded).__module__ == f"mlx_lm.models.{arch['arch']}"
    weights = mx.load(str(path / "model.safetensors"))
    assert sum(w.size for w in weights.values()) == count_parameters(model)
    loaded.set_dtype(mx.float32)
    ids = prompt_ids(tokenizer)
    logits = np.array(loaded(mx.array([ids]))[0])
    assert_close(logits, torch_logits(model, ids), rel=1e-3)
    messages = [{"role": "user", "content": CODE}]
    for sample in (CODE, CORPUS[2] * 2, tok.render_chat(messages)):
        assert wrapper.encode(sample, add_special_tokens=False) == tokenizer.encode(sample).ids
    assert wrapper.encode(CODE) == tokenizer.encode(CODE).ids  # no BOS added either
    chat = wrapper.apply_chat_template(messages, add_generation_prompt=True)
    assert chat == tokenizer.encode(tok.render_chat(messages)).ids
    assert wrapper.decode(tokenizer.encode(CODE).ids) == CODE


def test_arch_configs_carry_what_mlx_lm_reads(tmp_path, tokenizer):
    vocab = tokenizer.get_vocab_size()
    names = {}
    for arch, extra in [("qwen2", {}), ("llama", {}), ("qwen3", {}), ("qwen3_moe", MOE)]:
        model = tiny_model(vocab, arch=arch, **extra)
        path = export(tmp_path / arch, model, tokenizer, torch.bfloat16)
        config = json.loads((path / "config.json").read_text())
        assert config["tie_word_embeddings"] is True and config["bos_token_id"] is None
        names[arch] = set(mx.load(str(path / "model.safetensors")))
        if arch == "llama":
            assert config["architectures"] == ["LlamaForCausalLM"]
            assert config["attention_bias"] is False and config["mlp_bias"] is False
        if arch == "qwen3_moe":
            assert config["architectures"] == ["Qwen3MoeForCausalLM"]
            assert (config["num_experts"], config["num_experts_per_tok"]) == (4, 2)
            assert config["moe_intermediate_size"] == 32 and config["norm_topk_prob"] is True
            assert config["decoder_sparse_step"] == 1 and config["mlp_only_layers"] == []
    layer = "model.layers.1"
    assert f"{layer}.self_attn.q_proj.bias" in names["qwen2"]
    for arch in ("llama", "qwen3", "qwen3_moe"):
        assert not any(name.endswith(".bias") for name in names[arch])
    assert names["llama"] == {n for n in names["qwen2"] if not n.endswith(".bias")}
    assert names["qwen3"] == names["llama"] | {
        f"model.layers.{i}.self_attn.{n}_norm.weight" for i in (0, 1) for n in "qk"
    }
    assert f"{layer}.mlp.gate.weight" in names["qwen3_moe"]
    assert f"{layer}.mlp.experts.3.down_proj.weight" in names["qwen3_moe"]
    assert f"{layer}.mlp.gate_proj.weight" not in names["qwen3_moe"]


def test_default_qwen2_config_json_is_unchanged():
    """The default model's config.json (the shipped model's), key by key and in order."""
    config = ModelConfig().hf_config(eos_token_id=2, pad_token_id=0, dtype="bfloat16")
    assert list(config.items()) == [
        ("architectures", ["Qwen2ForCausalLM"]),
        ("model_type", "qwen2"),
        ("vocab_size", 4096),
        ("hidden_size", 256),
        ("num_hidden_layers", 8),
        ("num_attention_heads", 8),
        ("num_key_value_heads", 4),
        ("intermediate_size", 640),
        ("rms_norm_eps", 1e-6),
        ("rope_theta", 10000.0),
        ("max_position_embeddings", 4096),
        ("head_dim", 32),
        ("hidden_act", "silu"),
        ("attention_dropout", 0.0),
        ("rope_traditional", False),
        ("tie_word_embeddings", True),
        ("use_sliding_window", False),
        ("use_cache", True),
        ("bos_token_id", None),
        ("eos_token_id", 2),
        ("pad_token_id", 0),
        ("torch_dtype", "bfloat16"),
    ]


def test_model_config_rejects_what_mlx_lm_cannot_rebuild():
    with pytest.raises(ValueError, match="qwen2"):
        ModelConfig(head_dim=64)  # hidden 256 with 8 heads: mlx-lm's qwen2 uses 32
    assert ModelConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=64).head_dim == 64
    assert ModelConfig(arch="llama", head_dim=128).head_dim == 128
    with pytest.raises(ValueError, match="experts"):
        ModelConfig(arch="qwen3_moe")
    with pytest.raises(ValueError, match="experts"):
        ModelConfig(arch="qwen3", num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="arch"):
        ModelConfig(arch="gpt2")


def test_moe_block_matches_sparse_dispatch():
    """The dense computation (every expert, weighted by the top-k-masked routing weights)
    equals routing each token to its chosen experts only, as mlx-lm does."""
    from recipe.train import SparseMoeBlock

    torch.manual_seed(0)
    for norm in (True, False):
        config = small_config(32, arch="qwen3_moe", **MOE, norm_topk_prob=norm)
        block = SparseMoeBlock(config).eval()
        x = torch.randn(3, 5, config.hidden_size)
        with torch.no_grad():
            out, aux = block(x)
            expected = torch.zeros_like(x)
            probs = torch.softmax(block.gate(x), dim=-1)
            top, chosen = probs.topk(2, dim=-1)
            if norm:
                top = top / top.sum(-1, keepdim=True)
            for index in np.ndindex(3, 5):
                for weight, e in zip(top[index], chosen[index]):
                    expected[index] += weight * block.experts[int(e)](x[index])
        assert aux is None  # eval mode
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_moe_balance_loss_is_one_for_uniform_routing():
    from recipe.train import SparseMoeBlock

    block = SparseMoeBlock(small_config(32, arch="qwen3_moe", **MOE)).train()
    tokens = torch.arange(64)
    # Every probability 1/4 and the top-2 choices spread evenly: f_e = P_e = 1/4.
    weights = torch.zeros(64, 4)
    weights[tokens, tokens % 4] = weights[tokens, (tokens + 1) % 4] = 0.5
    block.routing_weights = lambda x: (weights, torch.full((64, 4), 0.25))
    _, aux = block(torch.randn(64, 64))
    assert aux.item() == pytest.approx(1.0)
    # All choices on experts 0 and 1, which also get all the probability: 4 * 2 * 1/4.
    skewed = torch.zeros(64, 4)
    skewed[:, :2] = 0.5
    block.routing_weights = lambda x: (skewed, skewed)
    _, aux = block(torch.randn(64, 64))
    assert aux.item() == pytest.approx(2.0)


def test_bfloat16_export_matches_rounded_torch_weights(tmp_path, tokenizer):
    model = tiny_model(tokenizer.get_vocab_size(), seed=1)
    path = export(tmp_path, model, tokenizer, torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    ids = prompt_ids(tokenizer)
    assert_close(mlx_logits(path, ids), torch_logits(model, ids), rel=1e-3)


def test_export_layout_and_config(tmp_path, tokenizer):
    model = tiny_model(tokenizer.get_vocab_size())
    path = export(tmp_path, model, tokenizer, torch.bfloat16)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "bfloat16"
    assert config["eos_token_id"] == tokenizer.token_to_id("<|im_end|>")
    weights = mx.load(str(path / "model.safetensors"))
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" not in weights
    assert "model.layers.1.self_attn.q_proj.bias" in weights
    assert "model.layers.1.self_attn.o_proj.bias" not in weights
    assert all(w.dtype == mx.bfloat16 for w in weights.values())
    assert sum(w.size for w in weights.values()) == count_parameters(model)


def test_default_model_fits_the_size_budget():
    model = Qwen2ForCausalLM(ModelConfig())
    assert 6_000_000 <= count_parameters(model) <= 7_000_000
    assert count_parameters(model) * 2 <= 14_000_000  # bf16 bytes


def test_loaded_model_generates_with_chat_template(tmp_path, tokenizer):
    from mlx_lm import generate

    path = export(tmp_path, tiny_model(tokenizer.get_vocab_size()), tokenizer, torch.bfloat16)
    model, wrapper = load(str(path))
    prompt = wrapper.apply_chat_template(
        [{"role": "user", "content": "def add"}], add_generation_prompt=True
    )
    assert prompt == tokenizer.encode(tok.render_chat([{"role": "user", "content": "def add"}])).ids
    text = generate(model, wrapper, prompt, max_tokens=8)
    assert isinstance(text, str)


# ---------------------------------------------------------------- training loop


def test_make_batch_puts_loss_on_answer_tokens_only():
    import numpy as np

    from recipe.train import IGNORE_INDEX, Examples, make_batch

    examples = Examples.from_pairs([[1, 5, 6], [1, 9]], [[7, 8, 2], [2]], max_len=64)
    inputs, targets = make_batch(examples, np.array([0, 1]), pad_id=0, bucket=8)
    x = IGNORE_INDEX
    assert inputs.tolist() == [[1, 5, 6, 7, 8, 0, 0, 0], [1, 9, 0, 0, 0, 0, 0, 0]]
    assert targets.tolist() == [[x, x, 7, 8, 2, x, x, x], [x, 2, x, x, x, x, x, x]]


def test_from_pairs_drops_examples_longer_than_max_len():
    from recipe.train import Examples

    examples = Examples.from_pairs([[1] * 5, [1] * 3], [[2] * 4, [2] * 2], max_len=6)
    assert examples.lengths.tolist() == [5]
    assert examples.target_tokens == 2


def test_plan_batches_uses_each_example_once_within_the_token_budget():
    import numpy as np

    from recipe.train import Examples, plan_batches

    rng = np.random.default_rng(0)
    prompts = [[1] * int(n) for n in rng.integers(2, 200, size=300)]
    examples = Examples.from_pairs(prompts, [[2, 3]] * 300, max_len=512)
    batches = plan_batches(examples, batch_tokens=1024, rng=rng, bucket=64)
    used = np.concatenate(batches)
    assert len(used) == len(set(used.tolist())) and len(used) >= 280
    for rows in batches:
        width = -(-(examples.lengths[rows] - 1).max() // 64) * 64
        assert len(rows) * width <= 1024 and len(rows) > 1


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    from recipe.train import TrainConfig, lr_at

    config = TrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(config, 0, 0.0) == pytest.approx(1e-4)
    assert lr_at(config, 9, 0.0) == pytest.approx(1e-3)
    assert lr_at(config, 500, 0.5) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr_at(config, 900, 1.0) == pytest.approx(1e-4)


def test_training_learns_to_copy():
    import numpy as np

    from recipe.train import Examples

    rng = np.random.default_rng(0)
    prompts, answers = [], []
    for _ in range(256):
        body = rng.integers(4, 32, size=8).tolist()
        prompts.append([1, *body, 3])  # 3 separates the prompt from the copy
        answers.append([*body, 2])
    examples = Examples.from_pairs(prompts, answers, max_len=64)
    torch.manual_seed(0)
    config = small_config(32, intermediate_size=128)
    model = Qwen2ForCausalLM(config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add sync cost (and CI is shared)
    try:
        before, summary, after = _train_copy_task(model, examples)
    finally:
        torch.set_num_threads(threads)
    assert summary["steps"] == 150 and summary["stopped_by"] == "steps"
    assert before > 3.0 and after < 0.5 * before, (before, after)


def test_qwen3_moe_trains_with_the_balance_loss():
    """A few steps of a tiny qwen3_moe model: finite losses, and the router learns."""
    from recipe.train import Examples, TrainConfig, train

    rng = np.random.default_rng(0)
    bodies = [rng.integers(4, 32, size=8).tolist() for _ in range(64)]
    examples = Examples.from_pairs([[1, *b, 3] for b in bodies], [[*b, 2] for b in bodies], 64)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(small_config(32, arch="qwen3_moe", head_dim=32, **MOE), dropout=0.1)
    router = model.model.layers[0].mlp.gate.weight.detach().clone()
    config = TrainConfig(
        max_steps=4, batch_tokens=512, lr=3e-3, warmup_steps=1, device="cpu", compile="off",
        log_every_s=0.0, router_aux_loss_coef=0.01,
    )  # fmt: skip
    summary = train(model, examples, config, pad_id=0, log=lambda m: None)
    assert summary["steps"] == 4 and np.isfinite(summary["final_loss"])
    assert all(np.isfinite(loss) for _, _, loss in summary["loss_curve"])
    assert model.aux_loss is not None and torch.isfinite(model.aux_loss)
    assert not torch.equal(model.model.layers[0].mlp.gate.weight, router)
    model.eval()
    with torch.no_grad():
        model(torch.tensor([[1, 5, 6]]))
    assert model.aux_loss is None  # eval mode: no balance loss


def _train_copy_task(model, examples):
    from recipe.train import TrainConfig, evaluate_loss, train

    before = evaluate_loss(model, examples, 0, batch_tokens=1024, max_batches=4)
    summary = train(
        model,
        examples,
        TrainConfig(
            max_steps=150,
            minutes=1.0,
            batch_tokens=1024,
            lr=3e-3,
            warmup_steps=10,
            device="cpu",
            compile="off",
            log_every_s=1.0,
        ),
        pad_id=0,
        log=lambda message: None,
    )
    after = evaluate_loss(model, examples, 0, batch_tokens=1024, max_batches=4)
    return before, summary, after


# ---------------------------------------------------------------- held-out tracking, dropout


def test_fixed_batches_cover_every_example_once_within_budget():
    from recipe.train import Examples, fixed_batches

    rng = np.random.default_rng(1)
    prompts = [[1] * int(n) for n in rng.integers(2, 300, size=101)]
    examples = Examples.from_pairs(prompts, [[2, 3]] * 101, max_len=512)
    batches = fixed_batches(examples, batch_tokens=1024, bucket=64)
    used = np.concatenate(batches).tolist()
    assert sorted(used) == list(range(len(examples)))  # all of them, single rows too
    for rows in batches:
        width = -(-(examples.lengths[rows] - 1).max() // 64) * 64
        assert len(rows) * width <= 1024
    again = fixed_batches(examples, batch_tokens=1024, bucket=64)
    assert [b.tolist() for b in again] == [b.tolist() for b in batches]  # deterministic
    # A lone example wider than the budget still gets its batch.
    wide = Examples.from_pairs([[1] * 300], [[2]], max_len=512)
    assert [b.tolist() for b in fixed_batches(wide, 128)] == [[0]]


def test_selection_loss_prefers_the_named_group():
    from recipe.train import selection_loss

    assert selection_loss({"edit": 0.5, "write_function": 2.0}, "edit") == 0.5
    assert selection_loss({"a": 1.0, "b": 2.0}, "edit") == 1.5
    assert np.isnan(selection_loss({}, "edit"))


def test_best_weights_keep_the_lowest_loss_copy():
    from recipe.train import BestWeights

    model = torch.nn.Linear(2, 2)
    best = BestWeights()
    assert not best.restore(model)
    with torch.no_grad():
        model.weight.fill_(1.0)
    assert best.update(model, 2.0, step=10, seconds=1.0)
    with torch.no_grad():
        model.weight.fill_(2.0)  # the copy must not follow the live weights
    assert best.update(model, 1.0, step=20, seconds=2.0)
    with torch.no_grad():
        model.weight.fill_(3.0)
    assert not best.update(model, 1.5, step=30, seconds=3.0)
    assert not best.update(model, float("nan"), step=40, seconds=4.0)
    assert best.restore(model)
    assert (best.step, best.loss) == (20, 1.0)
    assert torch.equal(model.weight, torch.full((2, 2), 2.0))


class ScriptedHeldOut:
    """Stands in for HeldOut: returns the scripted losses one measurement after another."""

    examples = {"edit": 3}

    def __init__(self, losses):
        self.script = iter(losses)

    def losses(self, model):
        return {"edit": next(self.script), "write_function": 9.0}


def test_tracker_records_the_curve_and_restores_the_best_weights():
    from recipe.train import LossMeter, TrainConfig, Tracker

    model = torch.nn.Linear(2, 2)
    meter = LossMeter(torch.device("cpu"), 0.0)
    tracker = Tracker(ScriptedHeldOut([3.0, 1.0, 2.0]), TrainConfig(), log=lambda m: None)
    for step, value in [(5, 1.0), (10, 2.0), (15, 3.0)]:
        with torch.no_grad():
            model.weight.fill_(value)
        meter.last_loss = value / 10
        tracker.measure(model, step, seconds=step / 5, meter=meter)
    summary = tracker.finish(model)
    assert torch.equal(model.weight, torch.full((2, 2), 2.0))  # the step-10 weights
    assert summary["best"] == {"step": 10, "seconds": 2.0, "held_out_loss": 1.0, "restored": True}
    curve = summary["held_out_curve"]
    assert [(r["step"], r["train_loss"], r["held_out_loss"]) for r in curve] == [
        (5, 0.1, 3.0),
        (10, 0.2, 1.0),
        (15, 0.3, 2.0),
    ]
    assert summary["held_out_curve"][0]["held_out_write_function"] == 9.0


def test_tracker_keeps_the_last_weights_when_asked_to():
    from recipe.train import LossMeter, TrainConfig, Tracker

    model = torch.nn.Linear(2, 2)
    tracker = Tracker(ScriptedHeldOut([1.0, 2.0]), TrainConfig(keep_best=False), lambda m: None)
    meter = LossMeter(torch.device("cpu"), 0.0)
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(step)
        tracker.measure(model, step, seconds=step, meter=meter)
    best = tracker.finish(model)["best"]
    assert (best["step"], best["restored"]) == (1, False)  # recorded, not restored
    assert torch.equal(model.weight, torch.full((2, 2), 2.0))


def _dropout_model(dropout: float, attention_dropout: float = 0.0) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = small_config(64, hidden_size=32, intermediate_size=48)
    return Qwen2ForCausalLM(config, dropout=dropout, attention_dropout=attention_dropout)


def test_dropout_acts_in_training_only_and_adds_no_weights():
    ids = torch.randint(0, 64, (2, 16))
    plain, dropped = _dropout_model(0.0), _dropout_model(0.3, attention_dropout=0.3)
    assert plain.state_dict().keys() == dropped.state_dict().keys()
    dropped.load_state_dict(plain.state_dict())
    plain.eval(), dropped.eval()
    with torch.no_grad():
        assert torch.equal(plain(ids), dropped(ids))
        dropped.train()
        assert not torch.allclose(dropped(ids), plain(ids))


def test_held_out_losses_are_eval_mode_answer_losses():
    from recipe.train import IGNORE_INDEX, Examples, HeldOut, make_batch

    model = _dropout_model(0.5)
    model.train()
    examples = Examples.from_pairs([[1, 5, 6], [1, 9, 9, 9]], [[7, 8, 2], [2]], max_len=64)
    held_out = HeldOut({"edit": examples}, pad_id=0, batch_tokens=4096)
    losses = held_out.losses(model)
    assert model.training  # put back as it was
    model.eval()
    inputs, targets = make_batch(examples, np.array([0, 1]), pad_id=0)
    with torch.no_grad():
        logits = model(torch.from_numpy(inputs))
    expected = torch.nn.functional.cross_entropy(
        logits.view(-1, 64), torch.from_numpy(targets).view(-1), ignore_index=IGNORE_INDEX
    ).item()
    assert losses == {"edit": pytest.approx(expected, rel=1e-5)}
    assert held_out.losses(model) == losses  # deterministic: no dropout


def test_training_with_held_out_ends_on_the_best_measured_weights():
    from recipe.train import Examples, HeldOut, TrainConfig, train

    rng = np.random.default_rng(0)
    bodies = [rng.integers(4, 32, size=8).tolist() for _ in range(80)]
    examples = Examples.from_pairs([[1, *b, 3] for b in bodies], [[*b, 2] for b in bodies], 64)
    held = Examples.from_pairs([[1, *b, 3] for b in bodies[:8]], [[*b, 2] for b in bodies[:8]], 64)
    model = _dropout_model(0.1)
    held_out = HeldOut({"edit": held}, pad_id=0, batch_tokens=1024)
    config = TrainConfig(
        max_steps=30,
        batch_tokens=512,
        lr=1e-2,
        warmup_steps=5,
        device="cpu",
        compile="off",
        log_every_s=0.0,  # measure after every step
    )
    summary = train(model, examples, config, pad_id=0, log=lambda m: None, held_out=held_out)
    curve = summary["held_out_curve"]
    assert [r["step"] for r in curve] == list(range(1, 31))
    best = min(curve, key=lambda r: r["held_out_loss"])
    assert summary["best"]["step"] == best["step"]
    assert held_out.losses(model)["edit"] == pytest.approx(best["held_out_loss"], abs=1e-4)
