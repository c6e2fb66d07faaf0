"""The backbone's own cost, on the CPU: batchgen's plain path against
`mlx_lm.generate` on the same prompts in one process, and peak RSS of a
10,000-job run against a 100-job one (subprocesses).

    python bench/backbone_overhead.py --out bench/results/backbone_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def tiny_model(path: Path) -> Path:
    import tiny

    return tiny.build_model("qwen2", path, hidden_size=128, num_hidden_layers=4, intermediate_size=384)


def write_jobs(path: Path, n: int, max_tokens: int) -> Path:
    words = ["alpha", "beta", "gamma", "delta", "def add(a, b):", "return", "print(x)"]
    with open(path, "w") as f:
        f.write(json.dumps({"batchgen": {"system": "You are terse.", "defaults": {"max_tokens": max_tokens}}}) + "\n")
        for i in range(n):
            text = " ".join(words[(i + k) % len(words)] for k in range(3 + i % 5)) + f" #{i}"
            f.write(json.dumps({"id": f"j{i}", "messages": [{"role": "user", "content": text}]}) + "\n")
    return path


def overhead(model_dir: Path, jobs_path: Path, rounds: int) -> dict:
    from mlx_lm import generate

    from batchgen.config import DecodeConfig, EngineConfig, PromptCacheConfig
    from batchgen.engine.core import Engine
    from batchgen.jobs import Job, iter_jobs, scan_jobs

    cfg = EngineConfig(model=str(model_dir), fuse=False, decode=DecodeConfig(draft="none"),
                       prompt_cache=PromptCacheConfig(enabled=False))  # fmt: skip
    engine = Engine.load(cfg)
    scan, d = scan_jobs(jobs_path, 64, None)
    jobs = [j for j in iter_jobs(jobs_path, d, scan.format, scan.header_line) if isinstance(j, Job)]
    prompts = [engine.prompt_tokens(j) for j in jobs]

    def plain():
        start, tokens = time.perf_counter(), 0
        for p, j in zip(prompts, jobs):
            text = generate(engine.model, engine.tokenizer, prompt=p, max_tokens=j.max_tokens)
            tokens += len(engine.tokenizer.encode(text, add_special_tokens=False))
        return time.perf_counter() - start

    def ours():
        start = time.perf_counter()
        results = list(engine.run_all(jobs))
        wall = time.perf_counter() - start
        return wall, sum(r.usage.completion_tokens for r in results), results

    plain(), ours()  # warm-up
    p_walls, o_walls = [], []
    for r in range(rounds):  # alternate the order to cancel drift
        for side in (("p", "o") if r % 2 == 0 else ("o", "p")):
            if side == "p":
                p_walls.append(plain())
            else:
                wall, tokens, results = ours()
                o_walls.append(wall)
    p_wall, o_wall = sorted(p_walls)[len(p_walls) // 2], sorted(o_walls)[len(o_walls) // 2]
    same = sum(r.text == generate(engine.model, engine.tokenizer, prompt=p, max_tokens=j.max_tokens)
               for r, p, j in zip(results, prompts, jobs))  # fmt: skip
    return {
        "jobs": len(jobs), "completion_tokens": tokens, "rounds": rounds,
        "mlx_lm_generate": {"wall_s": p_wall, "jobs_per_s": len(jobs) / p_wall, "tokens_per_s": tokens / p_wall},
        "batchgen": {"wall_s": o_wall, "jobs_per_s": len(jobs) / o_wall, "tokens_per_s": tokens / o_wall},
        "overhead": o_wall / p_wall - 1, "identical_outputs": same,
    }  # fmt: skip


def peak_rss_mb(model_dir: Path, jobs_path: Path, out: Path) -> float:
    """Peak RSS of a `batchgen run` subprocess, in MB."""
    code = (
        "import resource, sys; from batchgen.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    args = [sys.executable, "-c", code, "run", str(jobs_path), "--model", str(model_dir), "-o", str(out),
            "--draft", "none", "-q", "--no-fsync"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1]) / 1024  # ru_maxrss is in KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "backbone_cpu.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--big", type=int, default=10_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tiny_model(tmp / "model")
        result = {"overhead_100_jobs": overhead(model, write_jobs(tmp / "j100.jsonl", 100, 32), args.rounds)}
        small = write_jobs(tmp / "small.jsonl", 100, 2)
        big = write_jobs(tmp / "big.jsonl", args.big, 2)
        rss_small = peak_rss_mb(model, small, tmp / "o_small.jsonl")
        rss_big = peak_rss_mb(model, big, tmp / "o_big.jsonl")
        result["peak_rss_mb"] = {"100_jobs": rss_small, f"{args.big}_jobs": rss_big, "ratio": rss_big / rss_small}
    import mlx.core as mx
    import platform

    result["device"] = f"{mx.default_device()} {platform.processor() or platform.machine()}"
    result["date"] = time.strftime("%Y-%m-%d")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
