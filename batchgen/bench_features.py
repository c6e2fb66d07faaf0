"""`batchgen bench --features`: the dataset-generation features on the batch path,
side by side in one process: JSON-schema rows against free rows, n samples against
separate jobs, logprobs on against off (bench/RESULTS.md, "Dataset-generation features").
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np

from .bench import BenchConfig, bench_jobs, load_pair, median_index, repeat_jobs, resolved_rows, result_head, runs_in_turn
from .config import SamplingConfig
from .engine.core import Engine
from .jobs import NATIVE, Job

# Bounded strings, enums, numbers and an array: JSON that a model of random
# weights closes too (each string ends at its maxLength), as real data rows do.
FEATURE_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "summary": {"type": "string", "maxLength": 48},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["title", "summary", "sentiment", "score", "confidence", "tags", "ok"],
    "additionalProperties": False,
}


def _timed_run(engine: Engine, jobs: list[Job], rows) -> dict:
    """One batched run of `jobs` from an empty pool: wall time and what the lines say."""
    engine.config = replace(engine.config, batch_size=rows)
    if engine.pool is not None:
        engine.pool.forget()
    start = time.perf_counter()
    results = list(engine.run_all(jobs, total=sum(j.n for j in jobs)))
    wall = time.perf_counter() - start
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"job {failed[0].id} failed: {failed[0].error.message}")
    tokens = sum(r.usage.completion_tokens for r in results)
    finishes = [s.finish_reason for r in results for s in (r.samples or [r])]
    return {"wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall, "lines": len(results),
            "prompt_tokens": sum(r.usage.prompt_tokens for r in results),
            "prefill_tokens": sum(r.usage.prompt_tokens - r.usage.cached_tokens for r in results),
            "stopped": finishes.count("stop"), "rows": engine.batch_report.get("rows"),
            "steps": engine.batch_report.get("steps"), "prompt_s": engine.batch_report.get("prompt_s"),
            # a step's time outside prompt passes: JSON rows stop early, so their tok/s also pays
            # the fixed costs over fewer tokens; this compares the steps themselves
            "step_ms": _step_ms(wall, engine.batch_report), "results": results}  # fmt: skip


def _step_ms(wall: float, report: dict) -> float | None:
    steps = report.get("steps")
    return (wall - report.get("prompt_s", 0.0)) / steps * 1e3 if steps else None


def _median_run(engine: Engine, variants: dict, rows, repeats: int) -> dict:
    """{name: its median run (by tokens/s), with every run's tokens/s}: the
    variants run in turn, their order reversed every other round."""
    runs = runs_in_turn(repeats, {name: (lambda jobs=jobs: _timed_run(engine, jobs, rows)) for name, jobs in variants.items()})
    out = {}
    for name, rs in runs.items():
        tps = [r["tokens_per_s"] for r in rs]
        out[name] = {**rs[median_index(tps)], "runs_tokens_per_s": tps}
    return out


def _parsed_json(results: list) -> int:
    n = 0
    for r in results:
        for s in r.samples or [r]:
            try:
                n += s.finish_reason == "stop" and isinstance(json.loads(s.text), dict)
            except ValueError:
                pass
    return n


def run_features(cfg: BenchConfig, batch_sizes: list, n_jobs: int = 256, n_prompts: int = 64, n_samples: int = 8,
                 prompt_tokens: int = 1536, repeats: int = 1, log=print, on_result=None) -> dict:  # fmt: skip
    """The three figures of the batch path's dataset-generation features, on
    batchgen's engine alone (`cfg.shape` random weights, or a model):

    - structured: `n_jobs` jobs (the JOBS file or synthetic prompts, cycled)
      with `FEATURE_SCHEMA` as their response format, against the same jobs
      free, at each batch size (tokens/s; target >= 0.85x);
    - logprobs: the same jobs with logprobs and 5 alternatives, against off
      (target >= 0.9x);
    - samples: `n_prompts` random prompts of `prompt_tokens` tokens at
      n=`n_samples` (temperature 1, seeded), against the same prompts as
      n_prompts x n_samples separate jobs seeded as the samples are (wall time
      and prompt tokens prefilled; target >= 3x), at the last batch size.

    `on_result(result)`: called after each part (a run cut short keeps them)."""
    _, tokenizer, engine, _ = load_pair(cfg, plain=False)
    base, _ = bench_jobs(cfg, tokenizer)
    jobs = repeat_jobs(base, n_jobs)
    schema = json.dumps(FEATURE_SCHEMA, sort_keys=True)
    variants = {
        "free": jobs,
        "json_schema": [replace(j, json_schema=schema) for j in jobs],
        "logprobs": [replace(j, logprobs=True, top_logprobs=5) for j in jobs],
    }
    result = {**result_head(cfg, engine), "schema": FEATURE_SCHEMA, "structured_and_logprobs": [], "samples": None}
    for size in batch_sizes:
        rows = resolved_rows(engine, size, len(jobs))
        for variant in variants.values():  # warm-up: each variant's recordings and kernels at this size
            _timed_run(engine, variant[: min(rows, len(jobs))], rows)
        runs = _median_run(engine, variants, rows, repeats)
        free = runs["free"]["tokens_per_s"]
        row = {"requested": size, "rows": rows, "jobs": len(jobs),
               "json_schema_over_free": runs["json_schema"]["tokens_per_s"] / free,
               "logprobs_over_free": runs["logprobs"]["tokens_per_s"] / free,
               "json_parsed": _parsed_json(runs["json_schema"]["results"])}  # fmt: skip
        for name, r in runs.items():
            row[name] = {k: v for k, v in r.items() if k != "results"}
        result["structured_and_logprobs"].append(row)
        log(f"rows {rows:3d}: free {free:8.1f} tok/s, json_schema {row['json_schema_over_free']:.2f}x "
            f"({row['json_parsed']}/{runs['json_schema']['stopped']} closed JSON parsed), "
            f"logprobs {row['logprobs_over_free']:.2f}x")  # fmt: skip
        if on_result is not None:
            on_result(result)
    result["samples"] = _samples_figure(cfg, engine, tokenizer, rows, n_prompts, n_samples, prompt_tokens, repeats, log)
    if on_result is not None:
        on_result(result)
    return result


def _samples_figure(cfg, engine, tokenizer, rows, n_prompts, n_samples, prompt_tokens, repeats, log) -> dict:
    rng = np.random.default_rng(cfg.seed + 1)
    vocab = min(len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else 4000, 4000)
    max_tokens = cfg.max_tokens or 128
    prompts = [tokenizer.decode(rng.integers(10, vocab, prompt_tokens).tolist()) for _ in range(n_prompts)]
    sampled = lambda seed: SamplingConfig(temperature=1.0, seed=seed)  # noqa: E731
    grouped = [Job(f"p{i}", i + 1, NATIVE, None, p, max_tokens, sampled(1000 * i), n=n_samples) for i, p in enumerate(prompts)]
    separate = [Job(f"p{i}.{k}", i + 1, NATIVE, None, p, max_tokens, sampled(1000 * i + k))
                for i, p in enumerate(prompts) for k in range(n_samples)]  # fmt: skip
    _timed_run(engine, grouped[:2], rows)  # warm-up
    runs = _median_run(engine, {"n": grouped, "separate": separate}, rows, repeats)
    same = sum(s.text == t.text for r in runs["n"]["results"] for s, t in
               zip(r.samples, sorted((x for x in runs["separate"]["results"] if x.id.startswith(r.id + ".")),
                                     key=lambda x: int(x.id.rsplit(".", 1)[1]))))  # fmt: skip
    out = {"prompts": n_prompts, "n": n_samples, "prompt_tokens_each": prompt_tokens, "rows": rows,
           "max_tokens": max_tokens, "separate_wall_over_n_wall": runs["separate"]["wall_s"] / runs["n"]["wall_s"],
           "samples_identical_to_separate_jobs": same}  # fmt: skip
    for name, r in runs.items():
        out[name] = {k: v for k, v in r.items() if k != "results"}
    log(f"n={n_samples} x {n_prompts} prompts of {prompt_tokens} tokens: {runs['n']['wall_s']:.2f}s, prefilled "
        f"{runs['n']['prefill_tokens']} tokens; {n_prompts * n_samples} separate jobs {runs['separate']['wall_s']:.2f}s, "
        f"prefilled {runs['separate']['prefill_tokens']} ({out['separate_wall_over_n_wall']:.2f}x the wall time)")  # fmt: skip
    return out
