"""Where a batched verify pass's time goes (`batchgen.batch_pld`), on a model of
a real shape, against a plain batched step.

    python bench/batch_verify_probe.py --shape qwen2.5-0.5b --rows 8,32 --context 1024 --out r.json

Per batch size, rows left-padded to lengths context/2 .. context in a
`BatchKVCache`, fused weights, ms per pass, each evaluated alone (synced):
- `step`: one token a row, uncompiled, through the batch step kernel hook;
- `verify_short` / `verify_sdpa`: width tokens a row through the plain-op short
  attention (the hook) or MLX's fused attention, the cache trimmed back after;
- `verify_build`: building that pass's graph in Python, not evaluated;
- `cut`: `cut_rejected`'s per-row roll of every layer's buffers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))

from batch_step import _filled  # noqa: E402

from batchgen.kernels.attention import install_short_attention, uninstall_short_attention  # noqa: E402
from batchgen.engine.batch_pld import cut_rejected  # noqa: E402
from batchgen.bench import random_model  # noqa: E402
from batchgen.transforms.fusion import fuse_model  # noqa: E402


def _ms(fn, n: int) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) * 1e3 / n


def _pass(model, cache, rows: int, width: int):
    def run():
        for c in cache:
            c.offset = c._idx - c.left_padding
        logits = model(mx.zeros((rows, width), mx.uint32), cache=cache)
        mx.argmax(logits, axis=-1).tolist()
        for c in cache:
            c.trim(width)

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--width", type=int, default=6)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model, _ = random_model(a.shape, "bfloat16", None, 0)
    fuse_model(model)
    results = []
    for rows in [int(r) for r in a.rows.split(",")]:
        row = {"shape": a.shape, "rows": rows, "context": a.context, "width": a.width}
        install_short_attention(model)
        cache = _filled(model, rows, a.context, batch=True, marked=True)
        row["step_ms"] = _ms(_pass(model, cache, rows, 1), a.n)
        row["verify_short_ms"] = _ms(_pass(model, cache, rows, a.width), a.n)
        start = time.perf_counter()
        for _ in range(a.n):
            model(mx.zeros((rows, a.width), mx.uint32), cache=cache)
            for c in cache:
                c.trim(a.width)
        row["verify_build_ms"] = (time.perf_counter() - start) * 1e3 / a.n
        shifts = [i % a.width for i in range(rows)]

        def cut():
            cut_rejected(cache, shifts)
            mx.eval([c.state for c in cache])

        row["cut_ms"] = _ms(cut, a.n)
        uninstall_short_attention(model)
        row["verify_sdpa_ms"] = _ms(_pass(model, cache, rows, a.width), a.n)
        row["tok_s_step"] = rows * 1e3 / row["step_ms"]
        print(json.dumps(row), flush=True)
        results.append(row)
        cache = None  # (released before the next batch size)
        mx.clear_cache()
    if a.out:
        a.out.write_text(json.dumps({"device": str(mx.default_device()), "rows": results}, indent=1))


if __name__ == "__main__":
    main()
