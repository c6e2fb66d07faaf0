"""Quantized models through every path, with and without the dense route
(`transforms/quantized.py`): float32 on the CPU, greedy texts of batched,
PLD, fused, pooled and TurboQuant runs equal the one-at-a-time texts of the
same model through mlx-lm's own quantized layers. `rows` 1 forces the dense
route on every product (what a GPU takes from `CUDA_DEQUANTIZE_ROWS` rows
on); None leaves the layers as mlx-lm made them."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from test_batch import LENGTHS, TEXTS

from batchgen.config import (
    DecodeConfig,
    EngineConfig,
    KVConfig,
    PromptCacheConfig,
    SamplingConfig,
)
from batchgen.engine.core import Engine
from batchgen.jobs import NATIVE, Job
from batchgen.transforms import quantized as Q
from batchgen.transforms.fusion import QUANTIZED_SKIP, fuse_model

SYSTEM = "You are a helpful assistant. Answer briefly and exactly."
slow = pytest.mark.slow


def quantized_dir(model_dir, arch, bits, mode="affine", **kw):
    # qwen3_moe's experts are 48 wide by default, not a multiple of the group size
    moe = {"moe_intermediate_size": 64} if arch == "qwen3_moe" else {}
    mode_kw = {} if mode == "affine" else {"quantize_mode": mode}
    return model_dir(arch, quantize_bits=bits, **moe, **mode_kw, **kw)


def make(path, rows, *, fuse=False, draft="none", batch=1, kv="fp16", pool=False, dense=False) -> Engine:
    """An engine over `path`; `fuse` fuses the quantized layers too (not fused by default)."""
    cfg = EngineConfig(
        model=str(path), fuse=fuse, fuse_quantized=fuse, dequantize_rows=rows, dense_weights=dense, batch_size=batch,
        kv=KVConfig(kind=kv, bits=4),
        decode=DecodeConfig(draft=draft, pld_adaptive=False), prompt_cache=PromptCacheConfig(enabled=pool, prewarm=pool),
    )  # fmt: skip
    return Engine.load(cfg)


def jobs(system: bool = False) -> list[Job]:
    head = ({"role": "system", "content": SYSTEM},) if system else ()
    return [Job(id=f"q{i}", line=i + 1, format=NATIVE, max_tokens=n, prompt=None, sampling=SamplingConfig(),
                messages=head + ({"role": "user", "content": t},))
            for i, (t, n) in enumerate(zip(TEXTS, LENGTHS))]  # fmt: skip


_ALONE: dict = {}


def alone(path, kv: str, system: bool) -> dict:
    """id -> result of each job one at a time through mlx-lm's quantized layers
    (no route, unfused, no pool, plain decoding): the reference, once per model."""
    key = (str(path), kv, system)
    if key not in _ALONE:
        _ALONE[key] = {r.id: r for r in make(path, None, kv=kv).run_all(jobs(system))}
    return _ALONE[key]


# path -> (engine options, whether the jobs share the system prompt)
PATHS = {
    "batch": ({"batch": 4}, False),
    "pld": ({"draft": "pld"}, False),
    "fused": ({"fuse": True}, False),
    "pool": ({"pool": True, "fuse": True}, True),
    "turboquant-rows": ({"batch": 4, "kv": "turboquant", "fuse": True}, False),
}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("bits", [4, pytest.param(8, marks=slow)])
@pytest.mark.parametrize("rows", [None, 1])
@pytest.mark.parametrize("path", list(PATHS))
def test_paths_give_the_one_at_a_time_texts(model_dir, arch, bits, rows, path):
    """Batched rows, PLD, fusion, the prewarmed pool and TurboQuant rows (against
    TurboQuant one at a time) give the texts each job gets alone."""
    model = quantized_dir(model_dir, arch, bits)
    options, system = PATHS[path]
    want = alone(model, options.get("kv", "fp16"), system)
    e = make(model, rows, **options)
    if system:
        assert e.prewarm(SYSTEM, "test")["tokens"] > 0
    got = {r.id: r for r in e.run_all(jobs(system))}
    assert sorted(got) == sorted(want)
    for i, r in got.items():
        assert r.ok, r.error
        assert (r.text, r.finish_reason) == (want[i].text, want[i].finish_reason), (path, i)
    report = e.quantized_report
    assert report.dequantize_rows == rows and report.modes == (f"affine-{bits}-32",)
    assert (report.linear > 0) == (rows is not None) and (report.experts > 0) == (rows is not None and arch == "qwen3_moe")
    if options.get("batch", 1) > 1:
        assert e.batch_report["rows"] == 4 and e.batch_report.get("step") == "compiled"
    if path == "pld":
        assert sum(r.stats.pld_drafted for r in got.values()) > 0
    if path == "pool":
        assert all(r.usage.cached_tokens > 0 for r in got.values())


@pytest.mark.parametrize("mode,bits,group", [("affine", 4, 32), ("affine", 8, 64), ("affine", 4, 128), ("mxfp4", 4, 32),
                                             ("nvfp4", 4, 16), ("mxfp8", 8, 32)])  # fmt: skip
def test_the_dense_route_gives_the_quantized_logits(model_dir, mode, bits, group):
    """Every product dense over the dequantized weight (routed by rows, or the
    weights dense from load), against mlx-lm's quantized_matmul: a prompt pass's logits within 1e-4 (float32; the two round
    differently: on the CPU affine agrees to the bit, the fp modes within ~5e-6
    of logits of magnitude ~4), the same greedy text. The fp modes have their own group size."""
    path = quantized_dir(model_dir, "qwen2", bits, mode, group_size=group, hidden_size=128, intermediate_size=128)
    model, _ = load(str(path))
    inputs = mx.array([[5, 9, 17, 3, 11, 30, 7, 2, 40, 41]])
    want = model(inputs, cache=make_prompt_cache(model))
    fuse_model(model, quantized=True)
    assert Q.route_quantized(model, 1).linear > 0
    got = model(inputs, cache=make_prompt_cache(model))
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), mx.abs(got - want).max().item()
    job = jobs()[1]
    assert make(path, 1, fuse=True).run(job).text == make(path, None).run(job).text
    model, _ = load(str(path))  # weights dense from load: dense layers of the model's float dtype
    report = Q.dense_weights(model)
    assert report.dense and report.modes == (f"{mode}-{bits}-{group}",)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    got = model(inputs, cache=make_prompt_cache(model))
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), mx.abs(got - want).max().item()
    assert make(path, None, dense=True, fuse=True).run(job).text == make(path, None).run(job).text


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("bits", [4, pytest.param(8, marks=slow)])
def test_dense_weights_give_the_one_at_a_time_texts(model_dir, arch, bits):
    """Weights dequantized at load, then fused and batched, as TurboQuant rows,
    or one job at a time with PLD: the texts mlx-lm's quantized layers give each
    job alone (TurboQuant rows: TurboQuant alone)."""
    model = quantized_dir(model_dir, arch, bits)
    for options in ({"batch": 4, "fuse": True}, {"batch": 4, "kv": "turboquant", "fuse": True}, {"draft": "pld"}):
        want = alone(model, options.get("kv", "fp16"), False)
        e = make(model, None, dense=True, **options)
        got = {r.id: r for r in e.run_all(jobs())}
        assert {i: (r.text, r.finish_reason) for i, r in got.items()} == {
            i: (r.text, r.finish_reason) for i, r in want.items()}, options  # fmt: skip
        report = e.quantized_report
        assert report.dense and report.dequantize_rows is None and report.modes == (f"affine-{bits}-32",)
        assert (report.embedding, report.experts > 0) == (1, arch == "qwen3_moe")
        assert not any(Q._is_quantized(m) for _, m in e.model.named_modules())
    assert e.fusion_report is None or e.fusion_report.qkv == 0  # the PLD engine: unfused
    assert make(model, None, dense=True, fuse=True).fusion_report.qkv == 2  # dense layers fuse as bf16 ones


def test_dense_weights_layers_and_bytes(model_dir):
    """Each quantized layer becomes its dense twin holding the dequantized
    weight (bias kept); `dense_nbytes` counts them in the scales' dtype; a
    wrapped subclass stays quantized and is named."""

    class Wrapped(nn.QuantizedLinear):
        pass

    model, _ = load(str(quantized_dir(model_dir, "qwen2", 4)))
    q_proj = model.model.layers[0].self_attn.q_proj
    want_weight = Q.dequantized(q_proj, q_proj["scales"].dtype)
    want_bias = q_proj["bias"]
    model.model.layers[1].self_attn.o_proj = Wrapped(64, 64, bias=False, group_size=32, bits=4)
    dense = sum(m["weight"].size * 8 * 4 for _, m in model.named_modules()
                if type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding))  # fmt: skip
    assert Q.dense_nbytes(model) == dense  # float32 scales: 4 bytes a weight, 8 weights a uint32
    report = Q.dense_weights(model)
    new = model.model.layers[0].self_attn.q_proj
    assert type(new) is nn.Linear and mx.array_equal(new.weight, want_weight).item()
    assert mx.array_equal(new.bias, want_bias).item()
    assert type(model.model.embed_tokens) is nn.Embedding
    assert (report.dense, report.linear, report.embedding, report.skipped) == (True, 14, 1, ("Wrapped: 1",))


def test_dense_weights_drop_each_quantized_layer_as_they_go(monkeypatch):
    """Memory grows by a layer's dense bytes less its quantized ones at each layer
    (1,024 x 1,024 float32: 4 MiB dense, 0.625 MiB at 4 bits with float32 scales
    and biases): a replaced layer's arrays are freed before the next is made, so
    the peak is never the dense model plus the whole quantized one."""
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(6)])
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    mx.clear_cache()
    active, twin = [], Q._dense_twin
    monkeypatch.setattr(Q, "_dense_twin", lambda m, dtype: active.append(mx.get_active_memory()) or twin(m, dtype))
    assert Q.dense_weights(model).linear == 6
    assert [b - a for a, b in zip(active, active[1:])] == [(4 - 0.625) * 2**20] * 5


def test_the_kv_budget_counts_the_dense_weights(model_dir, monkeypatch):
    """The batch's default KV budget is half of what the model leaves as
    transformed: taken after the weights went dense, not before."""
    from batchgen.engine import core

    events, budget, dense = [], core.default_kv_budget, Q.dense_weights
    monkeypatch.setattr(core, "default_kv_budget", lambda: events.append(("budget", budget())) or events[-1][1])
    monkeypatch.setattr(Q, "dense_weights", lambda m: events.append(("dense", None)) or dense(m))
    e = make(quantized_dir(model_dir, "qwen2", 4), None, dense=True, batch=4)
    assert [name for name, _ in events][-2:] == ["dense", "budget"] and e.kv_budget_bytes == events[-1][1]


def test_wants_dense():
    """auto: on CUDA only, and only where the dense weights fit the share."""
    layer = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4)  # 2,048 weights, float32: 8,192 bytes
    model = nn.Sequential(layer)
    assert Q.dense_nbytes(model) == 8192
    share = Q.DENSE_MEMORY_SHARE
    assert Q.wants_dense("auto", model, cuda=True, memory=int(8192 / share)) is True
    assert Q.wants_dense("auto", model, cuda=True, memory=int(8192 / share) - 1) is False
    assert Q.wants_dense("auto", model, cuda=False, memory=10**12) is False
    assert Q.wants_dense("auto", nn.Sequential(nn.Linear(4, 4)), cuda=True, memory=10**12) is False  # nothing quantized
    assert Q.wants_dense(True, model) is True and Q.wants_dense(False, model, cuda=True, memory=10**12) is False
    if not Q.on_cuda():
        assert Q.wants_dense("auto", model) is False
    with pytest.raises(ValueError, match="str 'on'"):
        Q.wants_dense("on", model)


def test_fusion_leaves_quantized_groups_unless_asked(model_dir):
    model, _ = load(str(quantized_dir(model_dir, "qwen3_moe", 4)))
    report = fuse_model(model)
    assert (report.qkv, report.gate_up, report.experts) == (0, 0, 0)
    assert report.skipped == (f"<model>: 4 {QUANTIZED_SKIP}",)  # q/k/v and the experts' gate/up, 2 layers
    assert type(model.model.layers[0].self_attn.q_proj) is nn.QuantizedLinear
    report = fuse_model(model, quantized=True)
    assert (report.qkv, report.experts) == (2, 2)


def test_rows_pick_the_product(monkeypatch):
    """Below the threshold the layer's own quantized_matmul, from it on the dense
    form (expert layers: by the rows each expert sees on average, rounded up)."""
    dense = []
    real = Q.dequantized
    monkeypatch.setattr(Q, "dequantized", lambda m, dtype: dense.append(m) or real(m, dtype))
    layer = nn.QuantizedLinear(64, 32, bias=True, group_size=32, bits=4)
    routed = Q._routed(layer, 4)
    for rows, takes_dense in ((1, False), (3, False), (4, True), (9, True)):
        x = mx.random.normal((1, rows, 64), key=mx.random.key(rows))
        dense.clear()
        y = routed(x)
        assert bool(dense) == takes_dense and y.shape == (1, rows, 32)
        assert mx.allclose(y, layer(x), atol=1e-5).item()
    assert Q.dense(None, 10**6) is False


def test_resolve_rows():
    assert Q.resolve_rows("auto") == (Q.CUDA_DEQUANTIZE_ROWS if mx.default_device().type == mx.gpu
                                      and not mx.metal.is_available() else None)  # fmt: skip
    assert [Q.resolve_rows(v) for v in (None, 0, "off", 1, 300)] == [None, None, None, 1, 300]
    for bad in ("64", 1.5, True, -1):
        with pytest.raises(ValueError, match=type(bad).__name__):
            Q.resolve_rows(bad)


def test_off_leaves_the_layers_and_reports_them(model_dir):
    model, _ = load(str(quantized_dir(model_dir, "qwen2", 4)))
    types = {type(m) for _, m in model.named_modules()}
    report = Q.route_quantized(model, None)
    assert {type(m) for _, m in model.named_modules()} == types
    assert report.dequantize_rows is None and report.linear == 0
    assert report.skipped == ("not routed (dequantize_rows off): 16",)  # 7 a layer, 2 layers, head, embedding
    routed = Q.route_quantized(model, 8)
    assert routed.linear == 15 and routed.embedding == 1
    # routed again, then off: every layer back to its own op
    assert Q.route_quantized(model, None).dequantize_rows is None
    assert all(getattr(m, "dequantize_rows", None) is None for _, m in model.named_modules())


def test_other_quantized_types_are_left_and_named(model_dir):
    """A subclass (a LoRA wrapper, a tensor-parallel shard) may do more than the
    product: left as it is, named in the report."""

    class Wrapped(nn.QuantizedLinear):
        pass

    model, _ = load(str(quantized_dir(model_dir, "qwen2", 4)))
    attn = model.model.layers[0].self_attn
    wrapped = Wrapped(64, 64, bias=False, group_size=32, bits=4)
    attn.o_proj = wrapped
    report = Q.route_quantized(model, 1)
    assert attn.o_proj is wrapped and report.skipped == ("Wrapped: 1",)


def test_quantized_projections_never_take_the_bf16_kernel(model_dir, monkeypatch):
    """The step forward's quantized projections, with the kernel flag on (CUDA),
    run the layer's own product: `projection` (bf16 only) is never asked."""
    from batchgen.kernels import projection
    from batchgen.step.forward import StepForward

    def refuse(*a, **k):
        raise AssertionError("the bf16 projection kernel was asked about a quantized weight")

    monkeypatch.setattr(projection, "takes", refuse)
    monkeypatch.setattr(projection, "project", refuse)
    model, _ = load(str(quantized_dir(model_dir, "qwen2", 4, tie_word_embeddings=True)))
    fuse_model(model, quantized=True)
    Q.route_quantized(model, 2)
    step = StepForward(model)
    x = mx.random.normal((3, 64))
    for linear in (step.layers[0].qkv, step.layers[0].down, step.head):
        assert linear.dequantize_rows == 2
    assert step.layers[0].qkv(x, True).shape == (3, 128)  # q 4 heads, k and v 2, of 16
    assert step.head(x, True).shape[0] == 3


def test_run_summary_and_options(model_dir, tmp_path):
    from click.testing import CliRunner

    from batchgen.cli import main

    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps({"prompt": t, "max_tokens": 4}) + "\n" for t in TEXTS[:2]))
    model = str(quantized_dir(model_dir, "qwen2", 4))
    summary = tmp_path / "s.json"
    r = CliRunner().invoke(main, ["run", str(path), "--model", model, "-o", str(tmp_path / "o.jsonl"),
                                  "--dequantize-rows", "16", "--summary", str(summary), "-q"])  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(summary.read_text())
    q = d["quantized"]
    assert q["dequantize_rows"] == 16 and q["linear"] == 15 and q["modes"] == ["affine-4-32"]  # 7 a layer, head
    assert not q["dense"] and d["fusion"]["qkv"] == 0 and d["fusion"]["skipped"] == [f"<model>: 4 {QUANTIZED_SKIP}"]
    r = CliRunner().invoke(main, ["run", str(path), "--model", model, "-o", str(tmp_path / "d.jsonl"),
                                  "--dense-weights", "on", "--summary", str(summary), "-q"])  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(summary.read_text())
    assert d["quantized"]["dense"] and d["quantized"]["linear"] == 15 and d["fusion"]["qkv"] == 2  # dense layers fuse
    texts = [json.loads(line)["text"] for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert texts == [json.loads(line)["text"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    r = CliRunner().invoke(main, ["run", str(path), "--model", model, "-o", str(tmp_path / "p.jsonl"),
                                  "--dequantize-rows", "many"])  # fmt: skip
    assert r.exit_code == 2 and "--dequantize-rows" in r.output and not (tmp_path / "p.jsonl").exists()


def test_bench_quantizes_a_shape_in_each_mode():
    from batchgen.bench import random_model

    for mode, bits, group in (("affine", 8, 32), ("nvfp4", 4, 16)):  # mxfp4: the bench run below
        model, config = random_model("tiny", "float32", bits, 0, group_size=group, mode=mode)
        assert config["quantization"] == {"group_size": group, "bits": bits, "mode": mode}
        layer = model.model.layers[0].self_attn.q_proj
        assert (layer.mode, layer.bits, layer.group_size) == (mode, bits, group)
    with pytest.raises(ValueError, match="mxfp8 is 8-bit"):
        random_model("tiny", "float32", 4, 0, mode="mxfp8")


def test_bench_takes_the_quantization_and_route_options(model_dir, tmp_path):
    from click.testing import CliRunner

    from batchgen.cli import main

    out = tmp_path / "b.json"
    r = CliRunner().invoke(main, ["bench", "--shape", "tiny", "--model", str(model_dir("qwen2")), "--dtype", "float32",
                                  "--quantize", "4", "--quantize-mode", "mxfp4", "--dequantize-rows", "1",
                                  "--no-step-forward", "--synthetic", "8", "--synthetic-jobs", "1", "--max-tokens", "2",
                                  "--out", str(out), "--no-png"])  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["quantize_bits"] == 4 and d["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert d["batchgen"]["quantized"]["dequantize_rows"] == 1 and d["batchgen"]["quantized"]["modes"] == ["mxfp4-4-32"]
