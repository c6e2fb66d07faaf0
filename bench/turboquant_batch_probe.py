"""Where a batched decode step over TurboQuant rows spends its time.

    python bench/turboquant_batch_probe.py --shape qwen2.5-0.5b --rows 8 --context 4096 \
        [--baseline path/to/turboquant_batch.py] --out r.json

Rows of `context` tokens (one prefilled TurboQuant cache placed in every row)
step through the compiled step as the scheduler runs it (window flushed into
the codes when full); beside it, fp16 rows of the same lengths (`batch_step`).
Reports ms a step (pipelined, as the scheduler queues them), the step's
primitives by kind, ms a step with the attention as ops (the step kernel
off), and ms of one layer's ops attention alone (evaluated each call: the
GPU's time plus one launch chain). `--baseline`: ms a step with another
version's step kernel (its `STEP_SOURCE` and `STEP_HEADER`, e.g. another
commit's file) in place of the shipped one.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))

from attention_baseline import TURBOQUANT_BATCH_KERNEL, load_baseline  # noqa: E402
from batch_step import _compiled_steps, _filled, _timed, step_model  # noqa: E402
from projection_probe import patched  # noqa: E402

from batchgen.cache import turboquant, turboquant_rows as turboquant_batch  # noqa: E402
from batchgen.step.compiled import CompiledSteps, fit_capacity  # noqa: E402
from batchgen.decode.passes import prefill  # noqa: E402
from batchgen.cache.turboquant_rows import TurboQuantBatchLayer, TurboQuantStepCache  # noqa: E402
from batchgen.kernels.turboquant import available as cuda_available  # noqa: E402


def turboquant_rows(model, rows: int, context: int, bits: int) -> list:
    job = turboquant.make_turboquant_cache(model, bits=bits, trim_reserve=12)
    prefill(model, job, mx.random.randint(0, 1000, (context,)).tolist(), 2048)
    mx.eval([c.state[:8] for c in job])
    cache = [TurboQuantBatchLayer(rows) for _ in job]
    for layer, c in zip(cache, job):
        layer._idx = context
        for r in range(rows):
            layer.place(r, c, context, rows)
    mx.eval([layer.step_arrays() for layer in cache])
    return cache


def step_primitives(model, cache: list, rows: int) -> dict:
    stepper = CompiledSteps(model, cuda_available(), {}, True)
    y = mx.zeros((rows,), mx.uint32)
    mx.eval(stepper(cache, y, sample=False)[0], stepper.keys, stepper.values)
    tokens, _ = stepper(cache, y, sample=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), tokens, *stepper.keys, *stepper.values)
        labels = re.findall(r'label ="([^"]+)"', path.read_text())
    stepper.flush(cache)
    return dict(collections.Counter(labels).most_common())


def attention_ms(layer: TurboQuantBatchLayer, n_heads: int, n: int = 50) -> float:
    """One layer's step attention, evaluated each call."""
    fit_capacity([layer])
    B, H, dk, dv, dtype = layer.window_like()
    w = layer.layout.window
    rk, rv = mx.zeros((B, H, w, dk), dtype), mx.zeros((B, H, w, dv), dtype)
    meta = mx.array([layer._idx, 3, layer.key_codes.shape[2], w], mx.int32)
    q = mx.random.normal((B, n_heads, 1, dk)).astype(dtype)
    fn = mx.compile(lambda q, arrays, rk, rv, meta, lp: TurboQuantStepCache(layer.layout, arrays, rk, rv, meta, lp, {})
                    .attention(q, dk**-0.5))  # fmt: skip
    args = (q, layer.step_arrays(), rk, rv, meta, layer.left_padding)
    for _ in range(3):
        mx.eval(fn(*args))
    start = time.perf_counter()
    for _ in range(n):
        mx.eval(fn(*args))
    return (time.perf_counter() - start) * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--rows", default="8")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--baseline", type=Path, help="another turboquant_batch.py whose step kernel to time")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    baseline = load_baseline(a.baseline, TURBOQUANT_BATCH_KERNEL) if a.baseline else None
    model, _ = step_model(a.shape)
    out = {"shape": a.shape, "context": a.context, "bits": a.bits, "device": str(mx.default_device()), "rows": {}}
    n_heads = model.layers[0].self_attn.n_heads
    for rows in map(int, a.rows.split(",")):
        r = {}
        cache = turboquant_rows(model, rows, a.context, a.bits)
        r["turboquant_primitives"] = step_primitives(model, cache, rows)
        r["turboquant_ms"] = compiled_ms(model, cache, rows, a.steps)
        if baseline:
            with patched(turboquant_batch, **baseline):
                r["baseline_ms"] = compiled_ms(model, cache, rows, a.steps)
            r["turboquant_again_ms"] = compiled_ms(model, cache, rows, a.steps)
        r["turboquant_ops_ms"] = compiled_ms(model, cache, rows, a.steps, kernel=False)
        CompiledStepsOnce.reset()
        r["attention_one_layer_ms"] = attention_ms(cache[0], n_heads)
        r["turboquant_bytes_per_row"] = sum(layer.nbytes for layer in cache) // rows
        cache = None  # let go before the next row count's rows are built
        fp16 = _filled(model, rows, a.context, True, True)
        r["fp16_ms"] = _compiled_steps(model, fp16, rows, a.steps)
        r["fp16_bytes_per_row"] = sum(c.keys.nbytes + c.values.nbytes for c in fp16) // rows
        del fp16
        r["turboquant_primitives_total"] = sum(r["turboquant_primitives"].values())
        out["rows"][rows] = r
        print(rows, json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                                if k != "turboquant_primitives"}), flush=True)  # fmt: skip
        print(json.dumps(r["turboquant_primitives"]), flush=True)
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))


def compiled_ms(model, cache: list, rows: int, steps: int, kernel: bool = True) -> float:
    """ms a step through a stepper recorded anew (its step kernel on or off)."""
    CompiledStepsOnce.reset(kernel)
    return _timed(lambda y: CompiledStepsOnce.step(model, cache, y), rows, steps)


class CompiledStepsOnce:
    """One stepper per setting (recorded anew after `reset`)."""

    stepper = None
    kernel = True

    @classmethod
    def step(cls, model, cache, y):
        if cls.stepper is None:
            cls.stepper = CompiledSteps(model, cls.kernel and cuda_available(), {}, True)
        return cls.stepper(cache, y, sample=False)[0].astype(mx.uint32)

    @classmethod
    def reset(cls, kernel: bool = True):
        cls.stepper, cls.kernel = None, kernel


if __name__ == "__main__":
    main()
