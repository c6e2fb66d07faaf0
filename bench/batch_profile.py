"""Where a batched run's time goes, function by function (cProfile), and each
prompt pass's shape, seconds and peak memory, on a model of a real shape.

    python bench/batch_profile.py jobs/freeform.jsonl --shape qwen2.5-0.5b --batch 32 --jobs 256 --out r.json

Device work is asynchronous: a function's time includes waiting for the
device only where it reads a result back (prompt passes evaluate their
caches; a step's tokens are read one step later).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import mlx.core as mx

from batchgen import entering
from batchgen.bench import BenchConfig, _repeat_jobs, bench_jobs, load_pair
from batchgen.config import DEMO_MODEL_DIR, EngineConfig
from batchgen.engine import Engine


_peak = [0]  # the run's peak memory, bytes, across the resets below


def _pass_peak() -> float:
    """GB of memory at the peak since the last call (which is reset)."""
    peak = mx.get_peak_memory()
    _peak[0] = max(_peak[0], peak)
    mx.reset_peak_memory()
    return round(peak / 1e9, 3)


def _timed_passes(log: list) -> None:
    """Record (rows, length, cached, seconds, peak memory) of every prompt pass
    (shared or single); `peak_before_gb`: the peak since the previous pass
    (decode steps, placing rows)."""
    real = entering.prefill_rows
    single = Engine._prefill

    def timed_single(self, cache, tokens, logits=False):
        before = _pass_peak()
        start = time.perf_counter()
        out = single(self, cache, tokens, logits)
        if out is not None:
            mx.eval(out)
        log.append({"rows": 1, "length": len(tokens), "cached": cache[0].offset - len(tokens),
                    "s": round(time.perf_counter() - start, 4), "peak_before_gb": before,
                    "peak_gb": _pass_peak()})  # fmt: skip
        return out

    def timed(model, cache, tails, length, rows):
        before = _pass_peak()
        start = time.perf_counter()
        out = real(model, cache, tails, length, rows)
        cached = cache[0].offset - length if cache[0].keys is not None else 0
        log.append({"rows": rows, "tails": len(tails), "length": length, "cached": cached,
                    "s": round(time.perf_counter() - start, 4), "peak_before_gb": before,
                    "peak_gb": _pass_peak()})  # fmt: skip
        return out

    entering.prefill_rows = timed
    Engine._prefill = timed_single


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobs", type=Path)
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--model", default=str(DEMO_MODEL_DIR))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--jobs-total", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--uncompiled", action="store_true", help="step the model uncompiled")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--cold", action="store_true", help="empty the prompt pool after the warm-up (as --throughput runs)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    engine_cfg = EngineConfig(model=a.model, batch_size=a.batch, compiled_batch_step=not a.uncompiled)
    cfg = BenchConfig(engine_cfg, jobs_path=a.jobs, shape=a.shape, max_tokens=a.max_tokens)
    _, tokenizer, engine, _ = load_pair(cfg)
    base, system = bench_jobs(cfg, tokenizer)
    if system:
        engine.prewarm(system, "bench")
    jobs = _repeat_jobs(base, a.jobs_total)
    list(engine.run_all(jobs[: a.batch], total=a.batch))  # warm-up
    if a.cold and engine.pool is not None:
        engine.pool.forget()
    passes: list = []
    _timed_passes(passes)
    profile = cProfile.Profile()
    mx.reset_peak_memory()
    start = time.perf_counter()
    profile.enable()
    results = list(engine.run_all(jobs, total=len(jobs)))
    profile.disable()
    wall = time.perf_counter() - start
    tokens = sum(r.usage.completion_tokens for r in results)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(a.top)
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(a.top)
    print(text.getvalue())
    summary = {"shape": a.shape, "batch": a.batch, "jobs": len(jobs), "wall_s": round(wall, 3),
               "tokens_per_s": round(tokens / wall, 1), "report": engine.batch_report,
               "compiled": not a.uncompiled, "peak_memory_gb": round(max(_peak[0], mx.get_peak_memory()) / 1e9, 3),
               "active_memory_gb": round(mx.get_active_memory() / 1e9, 3), "passes": passes}  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "passes"}))
    if a.out:
        a.out.write_text(json.dumps(summary, indent=1))
        a.out.with_suffix(".txt").write_text(text.getvalue())


if __name__ == "__main__":
    main()
