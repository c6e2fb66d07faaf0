"""Where a batched run's time goes, function by function (cProfile), and each
prompt pass's shape, seconds and peak memory, on a model of a real shape.

    python bench/batch_profile.py jobs/freeform.jsonl --shape qwen2.5-0.5b --batch 32 --jobs 256 --out r.json

Device work is asynchronous: a function's time includes waiting for the
device only where it reads a result back (prompt passes evaluate their
caches; a step's tokens are read one step later). `--sync-steps` evaluates
each step as it is queued instead (no pipelining: slower overall) and records
its seconds to queue and to finish, by what came before it (a window flush,
rows placed, neither): where a step's time goes in a whole run, as against a
probe's steady steps. `--keep-buffers` leaves MLX's buffer cache alone for
the run (batchgen empties it after prompt passes): a step that must allocate
anew waits on the allocator. `--flash-min-queries N`: TurboQuant prompt passes
of fewer than N queries attend without cuDNN (no plan per pass shape).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the batchgen of the tree this script is in

from batchgen.bench import BenchConfig, repeat_jobs, bench_jobs, load_pair  # noqa: E402
from batchgen.config import DEMO_MODEL_DIR, EngineConfig, KVConfig  # noqa: E402
from batchgen.engine import entering  # noqa: E402
from batchgen.engine.core import Engine  # noqa: E402
from batchgen.engine.scheduler import BatchScheduler  # noqa: E402
from batchgen.step.compiled import CompiledSteps  # noqa: E402


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
    single = Engine.prefill_tokens

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
        cached = cache[0].offset - length  # (plain or TurboQuant group caches)
        log.append({"rows": rows, "tails": len(tails), "length": length, "cached": cached,
                    "s": round(time.perf_counter() - start, 4), "peak_before_gb": before,
                    "peak_gb": _pass_peak()})  # fmt: skip
        return out

    entering.prefill_rows = timed
    Engine.prefill_tokens = timed_single


def _synced_steps(log: list) -> None:
    """Evaluate each step as it is queued; record (kind, queue_s, finish_s)."""
    queue, place, flush = BatchScheduler._queue_step, BatchScheduler._place, CompiledSteps.flush
    events = set()

    def placed(self, index, row):
        events.add("placed")
        return place(self, index, row)

    def flushed(self, cache):
        if self.used:
            events.add("flush")
        return flush(self, cache)

    def timed(self, prev):
        start = time.perf_counter()
        step = queue(self, prev)
        queued = time.perf_counter()
        mx.eval(step.tokens)
        kind = "+".join(sorted(events)) or "plain"
        events.clear()
        log.append((kind, queued - start, time.perf_counter() - queued, self.B, self.step))
        return step

    BatchScheduler._queue_step, BatchScheduler._place, CompiledSteps.flush = timed, placed, flushed


def step_summary(log: list) -> dict:
    """Per kind of step: count, and median / total ms to queue and to finish."""
    out = {}
    for kind in sorted({x[0] for x in log}):
        q = sorted(x[1] for x in log if x[0] == kind)
        f = sorted(x[2] for x in log if x[0] == kind)
        out[kind] = {"steps": len(q), "queue_ms_median": round(q[len(q) // 2] * 1e3, 3),
                     "finish_ms_median": round(f[len(f) // 2] * 1e3, 3), "queue_s": round(sum(q), 3),
                     "finish_s": round(sum(f), 3)}  # fmt: skip
    return out


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
    ap.add_argument("--kv-cache", default="fp16", choices=["fp16", "turboquant"])
    ap.add_argument("--cold", action="store_true", help="empty the prompt pool after the warm-up (as --throughput runs)")
    ap.add_argument("--sync-steps", action="store_true", help="evaluate each step as queued; time it by kind")
    ap.add_argument("--no-shrink", action="store_true", help="keep every row to the end (no `_shrink` of the batch)")
    ap.add_argument("--keep-buffers", action="store_true",
                    help="skip mx.clear_cache during the run (MLX's freed buffers stay cached for reuse)")
    ap.add_argument("--fused-prefill-queries", type=int, default=None,
                    help="FUSED_PREFILL_QUERIES for the run: TurboQuant passes of fewer queries skip cuDNN")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.fused_prefill_queries is not None:
        from batchgen.cache import turboquant

        turboquant.FUSED_PREFILL_QUERIES = a.fused_prefill_queries
    engine_cfg = EngineConfig(model=a.model, batch_size=a.batch, compiled_batch_step=not a.uncompiled,
                              kv=KVConfig(kind=a.kv_cache))  # fmt: skip
    cfg = BenchConfig(engine_cfg, jobs_path=a.jobs, shape=a.shape, max_tokens=a.max_tokens)
    _, tokenizer, engine, _ = load_pair(cfg)
    base, system = bench_jobs(cfg, tokenizer)
    if system:
        engine.prewarm(system, "bench")
    jobs = repeat_jobs(base, a.jobs_total)
    list(engine.run_all(jobs[: a.batch], total=a.batch))  # warm-up
    if a.cold and engine.pool is not None:
        engine.pool.forget()
    passes: list = []
    _timed_passes(passes)
    steps: list = []
    if a.sync_steps:
        _synced_steps(steps)
    if a.keep_buffers:
        mx.clear_cache = lambda: None
    if a.no_shrink:
        BatchScheduler._shrink = lambda self: None
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
               "compiled": not a.uncompiled, "keep_buffers": a.keep_buffers, "shrink": not a.no_shrink,
               "flash_min_queries": a.flash_min_queries,
               "cache_memory_gb": round(mx.get_cache_memory() / 1e9, 3),
               "peak_memory_gb": round(max(_peak[0], mx.get_peak_memory()) / 1e9, 3),
               "active_memory_gb": round(mx.get_active_memory() / 1e9, 3), "steps": step_summary(steps),
               "passes": passes, "step_log": [[k, round(q * 1e3, 2), round(f * 1e3, 2), b, i] for k, q, f, b, i in steps]}  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k not in ("passes", "step_log")}))
    if a.out:
        a.out.write_text(json.dumps(summary, indent=1))
        a.out.with_suffix(".txt").write_text(text.getvalue())


if __name__ == "__main__":
    main()
