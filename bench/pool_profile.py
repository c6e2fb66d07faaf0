"""Where a job's time to first token goes, with the prewarmed pool and without.

    python bench/pool_profile.py jobs/long-system.jsonl --shape qwen2.5-7b --jobs 4 --out r.json

Per job (after one warm-up job): tokenizing, the pool fetch (clone + trim), the
tail prefill up to the first token read back (the prompt's last pass gives it),
the next two decode steps, each synced; then the same job cold (a fresh cache,
the whole prompt prefilled up to the first token). `--stock-attention` leaves
mlx's fused attention on for the tail (no short-pass attention); `--no-pad` runs
each pass at its own length (no power-of-two padding, no tail warm-up).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from batchgen.kernels.attention import uninstall_short_attention
from batchgen.bench import BenchConfig, bench_jobs, random_model
from batchgen.config import DEMO_MODEL_DIR, DecodeConfig, EngineConfig
from batchgen.engine.core import Engine, load_model


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1e3, 2)


def next_steps(model, cache, token: int) -> tuple[float, float]:
    """The two decode steps after the first token (ms each)."""
    y = mx.array([[token]])
    out = []
    for _ in range(2):
        start = time.perf_counter()
        y = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1, keepdims=True)
        mx.eval(y)
        out.append(_ms(start))
    return out[0], out[1]


def prompt_pass(engine: Engine, cache: list, tokens: list[int]) -> tuple[float, int]:
    """Prefill `tokens` and read the first token back: (ms, token)."""
    start = time.perf_counter()
    token = mx.argmax(engine.prefill_tokens(cache, tokens, logits=True), axis=-1).item()
    return _ms(start), token


def profile(engine: Engine, job) -> dict:
    row = {"id": job.id}
    start = time.perf_counter()
    job, tokens, _ = engine.checked_job(job)
    plan = engine.plan(job)
    row["tokenize_ms"] = _ms(start)
    start = time.perf_counter()
    hit = engine.pool.fetch(tokens, plan.kv_kind)
    cache, cached = (hit.cache, hit.cached_tokens) if hit.cache is not None else (engine.make_cache(plan.kv), 0)
    mx.eval([c.state for c in cache])
    row["fetch_ms"] = _ms(start)
    row["tail_prefill_ms"], first = prompt_pass(engine, cache, tokens[cached:])
    row["step_ms"], row["second_step_ms"] = next_steps(engine.model, cache, first)
    row.update(prompt_tokens=len(tokens), cached_tokens=cached)
    row["warm_ttft_ms"] = round(row["fetch_ms"] + row["tail_prefill_ms"], 2)
    cold = engine.make_cache(plan.kv)
    row["cold_ttft_ms"], _ = prompt_pass(engine, cold, tokens)
    row["warm_over_cold"] = round(row["warm_ttft_ms"] / row["cold_ttft_ms"], 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobs", type=Path)
    ap.add_argument("--model", default=str(DEMO_MODEL_DIR), help="model, or the tokenizer for --shape")
    ap.add_argument("--shape", default=None)
    ap.add_argument("--jobs", dest="n_jobs", type=int, default=4)
    ap.add_argument("--stock-attention", action="store_true")
    ap.add_argument("--no-pad", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    engine_cfg = EngineConfig(model=a.model, fuse=False, decode=DecodeConfig(draft="none"), pad_prompts=not a.no_pad)
    if a.shape:
        from mlx_lm.utils import load_tokenizer

        model, config = random_model(a.shape, "bfloat16", None, 0)
        tokenizer = load_tokenizer(Path(a.model))
    else:
        model, tokenizer, config = load_model(a.model)
    engine = Engine(model, tokenizer, engine_cfg, config)
    engine.make_fast()
    if a.stock_attention:
        uninstall_short_attention(engine.model)
    jobs, system = bench_jobs(BenchConfig(engine=engine_cfg, jobs_path=a.jobs, max_jobs=a.n_jobs), tokenizer)
    info = engine.prewarm(system, "profile") if system else {}
    rows = []
    for i, job in enumerate(jobs):
        row = profile(engine, job)
        if i:  # the first job warms up kernels
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.out:
        a.out.write_text(json.dumps({"model": a.shape or a.model, "device": str(mx.default_device()),
                                     "stock_attention": a.stock_attention, "pad_prompts": engine.pad_prompts,
                                     "prewarm": info, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
