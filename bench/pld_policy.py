"""Prompt lookup's adaptive policy against fixed settings, one job at a time.

    python bench/pld_policy.py --model DIR [--jobs N] [--every K] [--dtype float32]
        [--lookups 2,3,5,8] [--adaptive-lookups 16,32] [--pipelines on,off] [--out F]

Settings, each with its own run-wide DraftPolicy (what it measured stays its own):
`none` (plain decoding through the engine), `adaptive` (the default: pld, the policy
decides per draft), `always-L` (verify every draft of up to L tokens) for each L of
--lookups. Jobs run in turn: job i runs under every setting before job i+1, the order
rotated by i, so drift (clocks, caches) falls on all settings alike. One warm-up job per
setting first (kernels, the policy's calibration).

Per setting: decode tok/s over all jobs (tokens after the first / decode seconds; not
prefill, which the prompt pool serves from the setting that ran the job first), forward passes per generated token, drafted and accepted draft tokens (accepted
as a share of generated tokens too), outputs identical to `none` (greedy: all should be).
The summary states `adaptive` against `none` and against the best fixed setting.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchgen.bench import run_batchgen, versions  # noqa: E402
from batchgen.config import EngineConfig  # noqa: E402
from batchgen.decode.drafts import DraftPolicy  # noqa: E402
from batchgen.engine.core import Engine, cast_floats, device_name, load_model  # noqa: E402
from batchgen.jobs import Job, iter_jobs, scan_jobs  # noqa: E402


def settings(lookups: list[int], default_lookup: int, pipelines: list[bool | None] = (None,),
             adaptive_lookups: list[int] = ()) -> dict:
    """name -> (job overrides, adaptive, verify pipeline: None for the engine's choice).
    `adaptive` is the policy at the default ceiling, `adaptive-N` at a ceiling of N.

    >>> list(settings([2], 16, [True, False]))
    ['none', 'adaptive/pipe-on', 'adaptive/pipe-off', 'always-2/pipe-on', 'always-2/pipe-off']
    >>> list(settings([8], 16, adaptive_lookups=[16, 24]))
    ['none', 'adaptive', 'adaptive-24', 'always-8']
    """
    drafting = {"adaptive": ({"draft": "pld", "pld_max_lookup": default_lookup}, True)}
    for n in adaptive_lookups:
        if n != default_lookup:
            drafting[f"adaptive-{n}"] = ({"draft": "pld", "pld_max_lookup": n}, True)
    for n in lookups:
        drafting[f"always-{n}"] = ({"draft": "pld", "pld_max_lookup": n}, False)
    out = {"none": ({"draft": "none"}, True, None)}
    for name, (overrides, adaptive) in drafting.items():
        for pipe in pipelines:
            label = name if pipe is None else f"{name}/pipe-{'on' if pipe else 'off'}"
            out[label] = (overrides, adaptive, pipe)
    return out


def load_jobs(path: Path, jobs: int, every: int, max_tokens: int | None) -> tuple[list[Job], str | None]:
    scan, defaults = scan_jobs(path, max_tokens or 256, None)
    found = [j for j in iter_jobs(path, defaults, scan.format, scan.header_line) if isinstance(j, Job)]
    found = found[::every] if every else found
    found = found[: jobs + 1]  # the first is the warm-up
    if max_tokens:
        found = [replace(j, max_tokens=max_tokens) for j in found]
    return found, scan.header.system or scan.common_system


def summarize(runs: dict) -> dict:
    out = {}
    for name, rs in runs.items():
        gen = sum(r.completion_tokens for r in rs)
        decode_tokens = sum(max(r.completion_tokens - 1, 0) for r in rs)
        decode_s = sum(r.decode_s for r in rs)
        drafted, accepted = sum(r.pld_drafted for r in rs), sum(r.pld_accepted for r in rs)
        out[name] = {
            "decode_tps": round(decode_tokens / decode_s, 2) if decode_s else 0.0,
            "passes_per_token": round(sum(r.forward_passes for r in rs) / gen, 4) if gen else 0.0,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "accepted_share": round(accepted / gen, 4) if gen else 0.0,
            "completion_tokens": gen,
        }
    base = out["none"]["decode_tps"]
    fixed = {k: v["decode_tps"] for k, v in out.items() if not k.startswith("adaptive")}
    best = max(fixed, key=fixed.get)
    verdict = {"best_fixed": best}
    for name in [k for k in out if k.startswith("adaptive")]:  # "adaptive", or one per pipeline setting
        ours = out[name]["decode_tps"]
        suffix = name[len("adaptive"):]
        verdict[f"adaptive{suffix}_over_none"] = round(ours / base, 4) if base else None
        verdict[f"adaptive{suffix}_over_best_fixed"] = round(ours / fixed[best], 4) if fixed[best] else None
    out["_verdict"] = verdict
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--jobs-file", type=Path, default=ROOT / "jobs" / "edits.jsonl")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--every", type=int, default=0, help="take every K-th job (all edit kinds)")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    ap.add_argument("--lookups", default="2,3,5,8")
    ap.add_argument("--adaptive-lookups", default="", help="the policy also at these ceilings (adaptive-N)")
    ap.add_argument("--pipelines", default="", help="on,off: every drafting setting with its verify passes "
                    "queued ahead (on) and not (off), in turn; default: the engine's choice for this device")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    model, tokenizer, config = load_model(args.model)
    if args.dtype:
        cast_floats(model, getattr(mx, args.dtype))
    cfg = EngineConfig(model=args.model)
    engine = Engine(model, tokenizer, cfg, config)
    engine.make_fast()
    jobs, system = load_jobs(args.jobs_file, args.jobs, args.every, args.max_tokens)
    if system and engine.pool is not None:
        engine.prewarm(system, "bench")
    pipelines = [{"on": True, "off": False}[x] for x in args.pipelines.split(",") if x] or [None]
    plans = settings([int(x) for x in args.lookups.split(",") if x], engine.config.decode.pld_max_lookup, pipelines,
                     [int(x) for x in args.adaptive_lookups.split(",") if x])
    policies = {name: DraftPolicy(adaptive=adaptive) for name, (_, adaptive, _) in plans.items()}
    default_pipeline = engine.verify_pipeline
    runs = {name: [] for name in plans}
    texts = {name: [] for name in plans}
    start = time.time()
    for i, job in enumerate(jobs):
        names = list(plans)
        names = names[i % len(names):] + names[: i % len(names)]
        for name in names:
            engine.draft_policy = policies[name]
            overrides, _, pipe = plans[name]
            engine.verify_pipeline = default_pipeline if pipe is None else pipe
            r = run_batchgen(engine, replace(job, **overrides))
            if i > 0:  # job 0 warms up every setting
                runs[name].append(r)
                texts[name].append(r.text)
        if i > 0:
            line = "  ".join(f"{n} {runs[n][-1].decode_tps:7.1f}" for n in plans)
            print(f"{job.id}: {line}", flush=True)
    summary = summarize(runs)
    for name in plans:
        summary[name]["identical_to_none"] = sum(a == b for a, b in zip(texts[name], texts["none"]))
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
        "versions": versions(),
        "model": args.model,
        "model_type": config.get("model_type"),
        "dtype": args.dtype or "as stored",
        "jobs_file": str(args.jobs_file),
        "jobs": len(jobs) - 1,
        "seconds": round(time.time() - start, 1),
        "settings": summary,
    }
    for name, s in summary.items():
        print(name, s)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
