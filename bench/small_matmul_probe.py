"""Few-row projections on CUDA: MLX's matmul (gemv at one row, cuBLASLt above)
against batchgen's `small_matmul` kernel, then a whole batch step with each.

    python bench/small_matmul_probe.py --out r.json [--shapes qwen2.5-0.5b,qwen2.5-7b]

- `check`: the kernel against a float32 reference (and MLX's matmul in the same
  dtype), largest error over the output's largest value; whether a row's result
  is the same alone as among 8 rows (bitwise);
- `host_us`: a chain of 96 dependent 896 x 896 projections (GPU work ~nil), us a
  call, built and evaluated each time (`eager`) and as one compiled function
  (`compiled`), rows 1..32;
- `gpu`: the 7B shape's projections (weights ~30-140 MB: bandwidth-bound), ms a
  call over 20 independent calls, and the weight bytes read per second;
- `step`: batchgen's compiled batch step (bench/batch_step.py), ms, stock and with
  `install_small_matmul`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).parent))

from batchgen.small_matmul import RowsLinear, install_small_matmul, small_matmul  # noqa: E402


def _reference(x, w, bias):
    y = x.astype(mx.float32) @ w.astype(mx.float32).T
    return y if bias is None else y + bias.astype(mx.float32)


def check() -> list:
    out = []
    for dtype in (mx.bfloat16, mx.float32):
        for n, k, with_bias in ((1152, 896, True), (896, 4864, False), (37, 64, True), (4608, 3584, True)):
            w = mx.random.normal((n, k)).astype(dtype) * 0.05
            bias = mx.random.normal((n,)).astype(dtype) if with_bias else None
            x8 = mx.random.normal((16, k)).astype(dtype)
            for rows in (1, 2, 3, 5, 8, 9, 16):
                x = x8[:rows]
                ours = small_matmul(x, w, bias)
                ref = _reference(x, w, bias)
                theirs = x @ w.T + (0 if bias is None else bias)
                scale = mx.abs(ref).max().item()
                out.append({"dtype": str(dtype), "n": n, "k": k, "bias": with_bias, "rows": rows,
                            "err_kernel": mx.abs(ours.astype(mx.float32) - ref).max().item() / scale,
                            "err_mlx": mx.abs(theirs.astype(mx.float32) - ref).max().item() / scale})  # fmt: skip
            alone = mx.concatenate([small_matmul(x8[i : i + 1], w, bias) for i in range(8)])
            out[-1]["rows_independent"] = bool(mx.array_equal(alone, small_matmul(x8[:8], w, bias)).item())
    return out


def _median_s(fn, reps: int = 15) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_us(calls: int = 96) -> list:
    out = []
    layer = nn.Linear(896, 896, bias=True)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    for rows in (1, 2, 4, 8, 16, 32):
        x = mx.random.normal((rows, 896)).astype(mx.bfloat16)
        row = {"rows": rows}
        for name, cls in (("mlx", nn.Linear), ("kernel", RowsLinear)):
            layer.__class__ = cls

            def chain(y):
                for _ in range(calls):
                    y = layer(y) * 0.01
                return y

            compiled = mx.compile(chain)
            row[f"{name}_eager"] = round(_median_s(lambda: mx.eval(chain(x))) * 1e6 / calls, 2)
            row[f"{name}_compiled"] = round(_median_s(lambda: mx.eval(compiled(x))) * 1e6 / calls, 2)
        layer.__class__ = nn.Linear
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def gpu(calls: int = 20) -> list:
    out = []
    for name, n, k in (("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)):
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        mx.eval(w)
        for rows in (1, 8, 16, 32):
            xs = [mx.random.normal((rows, k)).astype(mx.bfloat16) for _ in range(calls)]
            mx.eval(xs)
            row = {"proj": name, "n": n, "k": k, "rows": rows}
            ways = [("mlx", lambda x: x @ w.T)]
            if rows <= 16:
                ways.append(("kernel", lambda x: small_matmul(x, w)))
            for way, f in ways:
                s = _median_s(lambda: mx.eval([f(x) for x in xs]), reps=7) / calls
                row[f"{way}_ms"] = round(s * 1e3, 4)
                row[f"{way}_gbs"] = round(w.nbytes / s / 1e9, 1)
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def step(shapes: list, rows_list: list, context: int, steps: int) -> list:
    from batch_step import _compiled_steps, _filled

    from batchgen.attention import install_short_attention
    from batchgen.bench import random_model
    from batchgen.fusion import fuse_model

    out = []
    for shape in shapes:
        model, _ = random_model(shape, "bfloat16", None, 0)
        fuse_model(model)
        install_short_attention(model)
        for rows in rows_list:
            row = {"shape": shape, "rows": rows, "context": context}
            for way in ("stock", "small_matmul", "stock_again"):
                for m in model.modules():
                    if isinstance(m, nn.Linear):
                        m.__class__ = nn.Linear
                if way == "small_matmul":
                    row["layers"] = install_small_matmul(model)
                cache = _filled(model, rows, context, True, True)
                row[f"{way}_ms"] = round(_compiled_steps(model, cache, rows, steps), 3)
                del cache
                mx.clear_cache()
            print(json.dumps(row), flush=True)
            out.append(row)
        del model
        mx.clear_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-7b")
    ap.add_argument("--rows", default="2,8,16,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--parts", default="check,host,gpu,step")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    parts = a.parts.split(",")
    result = {"device": str(mx.default_device())}
    if "check" in parts:
        result["check"] = check()
        worst = max(result["check"], key=lambda r: r["err_kernel"] / max(r["err_mlx"], 1e-7))
        print("check: worst kernel/mlx error", json.dumps(worst), flush=True)
        print("check: rows independent", [r.get("rows_independent") for r in result["check"] if "rows_independent" in r])
    if "host" in parts:
        result["host_us"] = host_us()
    if "gpu" in parts:
        result["gpu"] = gpu()
    if "step" in parts:
        result["step"] = step(a.shapes.split(","), [int(r) for r in a.rows.split(",")], a.context, a.steps)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
