"""A trained model (the demo model by default), jobs/edits.jsonl, float32: greedy outputs
with TurboQuant variants and with mlx-lm's affine 4-bit cache (group 64, or 32 where the
head dim is not a multiple of 64: mlx-lm's default group where it fits) against the
full-precision cache, and the teacher-forced perplexity of the expected answers.

    python bench/turboquant_demo_quality.py [--model DIR] [--jobs N] [--every K]
        [--variants A,B] [--out F]

Prints one line per job and a summary (also written to --out, by default
bench/results/turboquant_demo_quality.json). --every K takes every K-th edit job
(all four kinds) instead of the first N (the first 30 are renames).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import KVCache, QuantizedKVCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchgen.cache.factory import make_turboquant_cache  # noqa: E402
from batchgen.bench import answer_nll, greedy_ids, prefix_agreement  # noqa: E402


def head_dim(model) -> int:
    attn = model.layers[0].self_attn
    return getattr(attn, "head_dim", None) or attn.k_proj.weight.shape[0] // attn.n_kv_heads


def variants(model) -> dict:
    """Cache makers by name; "fp32" (the reference) first, then mlx-lm's 4-bit cache."""
    layers = len(model.layers)
    make = make_turboquant_cache
    group = 64 if head_dim(model) % 64 == 0 else 32
    return {
        "fp32": lambda: [KVCache() for _ in range(layers)],
        f"mlx4_g{group}": lambda: [QuantizedKVCache(group_size=group, bits=4) for _ in range(layers)],
        "tq4_default": lambda: make(model, 4),
        "tq4_k4v4": lambda: make(model, 4, key_bits=4, value_bits=4),
        "tq4_k5v3_w16s8": lambda: make(model, 4, window=16, sink_tokens=8),
        "tq4_k4v4_w16s8": lambda: make(model, 4, key_bits=4, value_bits=4, window=16, sink_tokens=8),
        "tq3_default": lambda: make(model, 3),
    }


def edit_jobs(jobs: int, every: int) -> tuple[str, list[dict], dict]:
    """(system prompt, the jobs taken, expected answer by job id)."""
    lines = [json.loads(line) for line in open(ROOT / "jobs" / "edits.jsonl")]
    taken = lines[1:][::every] if every else lines[1 : 1 + jobs]
    answers = {}
    for line in open(ROOT / "jobs" / "answers" / "edits.jsonl"):
        row = json.loads(line)
        answers[row["id"]] = row["answer"]
    return lines[0]["batchgen"]["system"], taken, answers


def measure(model, tok, system: str, jobs: list[dict], answers: dict, makers: dict) -> tuple[dict, int]:
    """Per variant: each job's prefix agreement with the reference's greedy output,
    bytes held, identical outputs, answer NLL; and the answer tokens counted."""
    res = {k: {"prefix": [], "identical": 0, "bytes": [], "nll": 0.0} for k in makers}
    eos, ntok, t0 = set(tok.eos_token_ids), 0, time.time()
    for job in jobs:
        ids = tok.apply_chat_template([{"role": "system", "content": system}] + job["messages"],
                                      add_generation_prompt=True)  # fmt: skip
        answer = tok.encode(answers[job["id"]], add_special_tokens=False) + [min(eos)]
        ntok += len(answer)
        ref = None
        for name, make in makers.items():
            cache = make()
            out = greedy_ids(model, ids, cache, job["max_tokens"], eos)
            ref = out if ref is None else ref  # "fp32" comes first
            row = res[name]
            row["identical"] += out == ref
            row["prefix"].append(prefix_agreement(out, ref))
            row["bytes"].append(sum(c.nbytes for c in cache))
            row["nll"] += answer_nll(model, ids, answer, make())
        print("job", job["id"], {k: (r["prefix"][-1], r["bytes"][-1]) for k, r in res.items()},
              round(time.time() - t0), flush=True)  # fmt: skip
    return res, ntok


def summarize(res: dict, ntok: int, jobs: int) -> dict:
    summary = {}
    for name, r in res.items():
        summary[name] = {"mean_prefix_match": round(float(np.mean(r["prefix"])), 4), "identical": r["identical"],
                         "jobs": jobs, "kv_bytes_mean": int(np.mean(r["bytes"])),
                         "answer_ppl": round(float(np.exp(r["nll"] / ntok)), 5)}  # fmt: skip
    full = summary["fp32"]
    for s in summary.values():
        s["kv_bytes_vs_fp16"] = round(s["kv_bytes_mean"] / (full["kv_bytes_mean"] / 2), 3)  # fp32 halves to fp16
        s["ppl_vs_full"] = round(s["answer_ppl"] / full["answer_ppl"], 5)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "batchgen" / "demo"))
    ap.add_argument("--jobs", type=int, default=24)
    ap.add_argument("--every", type=int, default=0)
    ap.add_argument("--variants", default="")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "turboquant_demo_quality.json")
    args = ap.parse_args()
    model, tok = load(args.model)
    model.set_dtype(mx.float32)
    makers = variants(model)
    if args.variants:
        makers = {k: v for k, v in makers.items() if k in args.variants.split(",") or k == "fp32"}
    system, jobs, answers = edit_jobs(args.jobs, args.every)
    t0 = time.time()
    res, ntok = measure(model, tok, system, jobs, answers, makers)
    summary = summarize(res, ntok, len(jobs))
    summary["_model"] = {"path": args.model, "head_dim": head_dim(model), "layers": len(model.layers)}
    for name, row in summary.items():
        print(name, row)
    print("seconds", round(time.time() - t0, 1))
    json.dump(summary, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
