"""Where a batched step's host time goes, free rows against JSON-schema rows
(and logprobs rows): each scheduler phase's wall time per step, on a model of
a real shape. The step of a small model at many rows is bound by the host, so
its phases add up to the step.

    python bench/feature_phases.py --shape qwen2.5-0.5b --jobs 256 --rows auto --out r.json

`--synthetic N`: each job a random prompt of N tokens (rows that attend over long
contexts) instead of jobs/freeform.jsonl's short prompts.

Phases: `queue` (the forward pass queued: its graph and dispatch), `wait`
(reading the previous step's tokens: the device's remainder), `read+wait` (the rows
taking their tokens, the grammar's `consume` within it), `pick` (the masks filled
on the host, `fill` within it, and the pick queued), `start` (rows entering: their prompt passes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the batchgen of the tree this script is in

from batchgen.bench import BenchConfig, bench_jobs, load_pair, repeat_jobs  # noqa: E402
from batchgen.bench_features import FEATURE_SCHEMA, _timed_run  # noqa: E402
from batchgen.config import EngineConfig  # noqa: E402
from batchgen.decode import grammar  # noqa: E402
from batchgen.engine.scheduler import BatchScheduler  # noqa: E402

T = defaultdict(float)
# (owner, method, phase): each method's wall time is added to its phase's
PHASES = [(BatchScheduler, "_queue_step", "queue"), (BatchScheduler, "_read", "read+wait"),
          (BatchScheduler, "_pick", "pick"), (BatchScheduler, "_start", "start"),
          (grammar.Grammars, "fill", "fill"), (grammar.Grammars, "consume", "consume")]


def timed(owner, name, key):
    real = getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            T[key] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default=None, help="the shape's dtype (default bfloat16)")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a model folder's tokenizer for the shape (default the demo's; bench/grammar_masks.py "
                         "--save-tokenizer makes one of a real model's size)")
    ap.add_argument("--jobs", type=int, default=256)
    ap.add_argument("--rows", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--synthetic", type=int, default=None,
                    help="random prompts of N tokens (one a job) instead of jobs/freeform.jsonl: long rows")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="free,json,logprobs", help="which of free, json, logprobs to run")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    jobs_path = Path(__file__).resolve().parents[1] / "jobs/freeform.jsonl"
    cfg = BenchConfig(engine=EngineConfig(model=a.shape), jobs_path=jobs_path, shape=a.shape, dtype=a.dtype,
                      max_tokens=a.max_tokens, tokenizer_path=a.tokenizer, synthetic_prompt_tokens=a.synthetic,
                      synthetic_jobs=a.jobs)
    _, tokenizer, engine, _ = load_pair(cfg, plain=False)
    jobs = repeat_jobs(bench_jobs(cfg, tokenizer)[0], a.jobs)
    schema = json.dumps(FEATURE_SCHEMA, sort_keys=True)
    variants = {"free": jobs, "json": [replace(j, json_schema=schema) for j in jobs],
                "logprobs": [replace(j, logprobs=True, top_logprobs=5) for j in jobs]}
    variants = {k: variants[k] for k in a.variants.split(",")}
    rows = a.rows if a.rows == "auto" else int(a.rows)
    real_read = BatchScheduler._read

    def read(self, step):
        t0 = time.perf_counter()
        mx.eval(step.tokens, *[x for x in step.logprobs or () if x is not None])
        T["wait"] += time.perf_counter() - t0
        return real_read(self, step)

    saved = {(owner, name): getattr(owner, name) for owner, name, _ in PHASES}
    BatchScheduler._read = read
    for owner, name, key in PHASES:
        timed(owner, name, key)
    out = {}
    try:
        for name, v in variants.items():  # warm-up
            _timed_run(engine, v[:64], rows)
        for r in range(a.repeats):
            for name, v in variants.items():
                T.clear()
                run = _timed_run(engine, v, rows)
                steps = run["steps"]
                phases = {k: round(t / steps * 1e3, 3) for k, t in sorted(T.items())}
                line = {"tok_s": round(run["tokens_per_s"]), "steps": steps, "step_ms": round(run["step_ms"], 2),
                        "tokens": run["completion_tokens"], "prompt_tokens": run["prompt_tokens"],
                        "prompt_s": round(run["prompt_s"], 3), "ms_per_step": phases}  # fmt: skip
                out.setdefault(name, []).append(line)
                print(name, json.dumps(line), flush=True)
    finally:
        for (owner, name), real in saved.items():
            setattr(owner, name, real)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
