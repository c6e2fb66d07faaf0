"""Predicted outputs (a job's `prediction`) against prompt lookup alone: whole
`batchgen run` processes over the same edit jobs, each side in turn.

    python bench/predicted_outputs.py [--jobs N] [--every K] [--rounds R] [--out F] -- [batchgen run options]

Takes every K-th job of jobs/edits.jsonl (N of them) and writes them twice: as they
are, and with the expected answer (jobs/answers/edits.jsonl, in the fence the demo
model writes) as each job's `prediction`. Each side runs as a fresh process
(`--batch-size 1`: drafting is the one-at-a-time path) for R rounds, in turn.
Reports per side: outputs identical to the other side's, completion tokens, forward
passes, accepted draft tokens, and decode tok/s (the jobs' decode seconds summed).
A prediction is the user's guess: here the reference answer, which the model's
output matches in whole or in part; where it matches less, fewer drafts come from it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def job_files(workdir: Path, jobs: int, every: int) -> dict[str, Path]:
    lines = (ROOT / "jobs/edits.jsonl").read_text().splitlines()
    answers = {a["id"]: a["answer"] for a in map(json.loads, (ROOT / "jobs/answers/edits.jsonl").read_text().splitlines())}
    picked = [json.loads(line) for line in lines[1:]][::every][:jobs]
    files = {}
    for side in ("lookup", "predicted"):
        path = workdir / f"{side}.jsonl"
        rows = [lines[0]]
        for job in picked:
            if side == "predicted":
                job = {**job, "prediction": {"type": "content", "content": f"```python\n{answers[job['id']]}\n```"}}
            rows.append(json.dumps(job))
        path.write_text("\n".join(rows) + "\n")
        files[side] = path
    return files


def run(jobs: Path, out: Path, options: list[str]) -> dict:
    cmd = [sys.executable, "-m", "batchgen", "run", str(jobs), "-o", str(out), "-q", "--batch-size", "1", *options]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    out.unlink()
    return results


def totals(results: dict) -> dict:
    stats = [r["stats"] for r in results.values()]
    tokens = sum(r["usage"]["completion_tokens"] for r in results.values())
    decode_s = sum(s["decode_s"] for s in stats)
    return {
        "completion_tokens": tokens,
        "forward_passes": sum(s["forward_passes"] for s in stats),
        "pld_accepted": sum(s["pld_accepted"] for s in stats),
        "decode_tok_s": round(tokens / max(decode_s, 1e-9), 1),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("options", nargs="*")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        files = job_files(Path(tmp), args.jobs, args.every)
        rounds = []
        for r in range(args.rounds):
            sides = ("lookup", "predicted") if r % 2 == 0 else ("predicted", "lookup")
            got = {side: run(files[side], Path(tmp) / f"{side}.out.jsonl", args.options) for side in sides}
            same = sum(got["lookup"][k]["text"] == got["predicted"][k]["text"] for k in got["lookup"])
            row = {"round": r, "identical": f"{same} of {len(got['lookup'])}", **{s: totals(got[s]) for s in sides}}
            print(json.dumps(row), flush=True)
            rounds.append(row)
    if args.out:
        args.out.write_text(json.dumps({"options": args.options, "jobs": args.jobs, "every": args.every,
                                        "rounds": rounds}, indent=1))  # fmt: skip
    return rounds


if __name__ == "__main__":
    main()
