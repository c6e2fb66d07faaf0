"""The few-row projection kernel (`batchgen.projection`) against MLX's matmul.

    python bench/projection_probe.py --shape qwen2.5-7b --rows 8,32 --out r.json

Per projection of a real shape (every layer's own weights in turn, so the
weights come from memory, not L2) and per row count: us a product, TB/s of
weights read, and the largest error against a float32 product of the same
bf16 numbers, for MLX's matmul over the transposed view `step_forward`
holds (x @ w_t) and for the kernel. Then the compiled batch step
(`bench/batch_step.py`'s, through `step_forward`) with the kernel for no
weights, weights up to 48 MB, up to 300 MB and all, ms a step, and how far
their logits lie from the plain step's. (Products queued side by side may
run concurrently; a step's run one after another, so only the step says
what the kernel is worth.)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))

from batch_step import _compiled_steps, _filled  # noqa: E402

from batchgen.kernels import projection  # noqa: E402
from batchgen.kernels.attention import install_short_attention  # noqa: E402
from batchgen.bench import random_model  # noqa: E402
from batchgen.step.compiled import CompiledSteps  # noqa: E402
from batchgen.transforms.fusion import fuse_model  # noqa: E402
from batchgen.kernels.turboquant import available as cuda_available  # noqa: E402


SWEEP_ROWS = 32  # rows up to which the sweep gives products to the kernel (four column tiles)
LIMITS = {"plain": (0, 0), "under_48mb": (SWEEP_ROWS, 48 << 20), "under_300mb": (SWEEP_ROWS, 300 << 20),
          "all": (SWEEP_ROWS, 1 << 62)}  # fmt: skip


def weights(model) -> dict:
    """name -> [one (N, K) weight per layer] (the head: once)."""
    layers = model.model.layers
    head = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
    return {
        "qkv": [layer.self_attn.qkv_proj.weight for layer in layers],
        "o": [layer.self_attn.o_proj.weight for layer in layers],
        "gate_up": [layer.mlp.gate_up_proj.weight for layer in layers],
        "down": [layer.mlp.down_proj.weight for layer in layers],
        "head": [head.weight],
    }


def _us(fn, ws: list, x: mx.array, reps: int) -> float:
    """us a product, `reps` rounds over `ws` queued before one evaluation."""
    mx.eval([fn(x, w) for w in ws])
    start = time.perf_counter()
    mx.eval([fn(x, w) for _ in range(reps) for w in ws])
    return (time.perf_counter() - start) * 1e6 / (reps * len(ws))


@contextlib.contextmanager
def patched(module, **values):
    """`module`'s attributes set to `values` for a while (tuned constants, entry points)."""
    keep = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in keep.items():
            setattr(module, name, value)


def limits(max_rows: int, max_bytes: int):
    """`projection`'s limits set to these for a while."""
    return patched(projection, MAX_ROWS=max_rows, MAX_WEIGHT_BYTES=max_bytes)


def products(model, rows: int, reps: int) -> list:
    out = []
    for name, ws in weights(model).items():
        n, k = ws[0].shape
        x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(mx.bfloat16)
        want = x.astype(mx.float32) @ ws[0].astype(mx.float32).T
        with limits(SWEEP_ROWS, 1 << 62):
            row = {"proj": name, "rows": rows, "n": n, "k": k, "takes": projection.takes(x, ws[0])}
        views = [w.T for w in ws]  # as step_forward holds them: evaluated `.T` views
        mx.eval(views)
        ways = [("matmul_t", lambda x, v: x @ v, views)] + [("kernel", projection.project, ws)] * row["takes"]
        for way, fn, args in ways:
            us = _us(fn, args, x, reps)
            got = fn(x, args[0]).astype(mx.float32)
            row[f"{way}_us"] = round(us, 2)
            row[f"{way}_tbps"] = round(n * k * 2 / us / 1e6, 3)
            row[f"{way}_err"] = float(mx.abs(got - want).max() / mx.abs(want).max())
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def steps(model, rows: int, context: int, n: int) -> dict:
    """ms a compiled step with each of `LIMITS` (the kernel for weights up to
    that many bytes), and how far their logits lie from the plain step's."""
    install_short_attention(model)
    cache = _filled(model, rows, context, True, True)
    row = {"rows": rows, "context": context}
    logits = {}
    for label, limit in LIMITS.items():
        with limits(*limit):
            row[f"{label}_ms"] = round(_compiled_steps(model, cache, rows, n), 3)
            stepper = CompiledSteps(model, cuda_available(), {}, True)
            step = stepper([copy.copy(c) for c in cache], mx.zeros((rows,), mx.uint32), sample=True)
            logits[label] = step[1].astype(mx.float32)
    plain = logits["plain"]
    row["logits_rel_diff"] = max(round((mx.abs(plain - v).max() / mx.abs(plain).max()).item(), 5)
                                 for v in logits.values())  # fmt: skip
    row["same_argmax"] = min(mx.mean(plain.argmax(-1) == v.argmax(-1)).item() for v in logits.values())
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model, _ = random_model(a.shape, "bfloat16", None, 0)
    fuse_model(model)
    rows = [int(r) for r in a.rows.split(",")]
    result = {"shape": a.shape, "products": [p for r in rows for p in products(model, r, a.reps)],
              "steps": [steps(model, r, a.context, a.steps) for r in rows if r > 1]}  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
