"""Whole `batchgen run` processes as a cron user starts them: seconds from the
process's start to its first result line, and to its end, less the model load
the run's summary reports.

    python bench/first_line.py JOBS [--runs N] [--out F] -- [batchgen run options]

Each run is a fresh `python -m batchgen run JOBS -o TMP --summary TMP.json ...`
process; the output file is polled every 5 ms for its first complete line. A
machine's first process pays MLX's kernel builds (unless `batchgen warm-up` ran
before it); later ones load them: run this twice, or with --runs 2, to see both.
Prints one JSON object per run (each job's prefill and decode seconds, decode tok/s and
forward passes under `per_job`, their sums under `jobs_total`), then a line of its
figures, and writes them all to --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def first_line_s(out: Path, proc: subprocess.Popen, start: float, poll_s: float = 0.005) -> float | None:
    """Seconds from `start` until `out` holds a complete line (None: the process
    ended without writing one)."""
    while True:
        try:
            if b"\n" in out.read_bytes()[:1 << 20]:
                return time.perf_counter() - start
        except FileNotFoundError:
            pass
        if proc.poll() is not None:
            return None
        time.sleep(poll_s)


def one_run(jobs: Path, options: list[str], workdir: Path, i: int) -> dict:
    out, summary = workdir / f"run{i}.jsonl", workdir / f"run{i}.summary.json"
    cmd = [sys.executable, "-m", "batchgen", "run", str(jobs), "-o", str(out), "--summary", str(summary), "-q", *options]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = first_line_s(out, proc, start)
    first = None if first is None else round(first, 3)
    _, err = proc.communicate()
    total = time.perf_counter() - start
    row = {"run": i, "exit_code": proc.returncode, "first_line_s": first, "total_s": round(total, 3)}
    if summary.exists():
        s = json.loads(summary.read_text())
        load = round(s.get("load_s") or 0.0, 3)
        row.update(load_s=load, device=s.get("device"), jobs=s.get("jobs"),
                   first_line_less_load_s=None if first is None else round(first - load, 3),
                   completion_tokens=(s.get("tokens") or {}).get("completion"),
                   tok_s_less_load=round((s.get("tokens") or {}).get("completion", 0) / max(total - load, 1e-9), 1))
    row["per_job"] = per_job(out)
    row["jobs_total"] = job_totals(row["per_job"])
    if proc.returncode != 0:
        row["stderr_tail"] = err.decode(errors="replace")[-500:]
    return row


def per_job(out: Path) -> list[dict]:
    """Each result line's timing, in file order: where a run's time went by job (a
    first job that pays what later ones do not, a job much slower than the rest)."""
    rows = []
    for line in out.read_text().splitlines() if out.exists() else []:
        r = json.loads(line)
        s, u = r.get("stats") or {}, r.get("usage") or {}
        rows.append({"id": r.get("id"), "completion_tokens": u.get("completion_tokens"),
                     **{k: s.get(k) for k in ("prefill_s", "decode_s", "decode_tps", "forward_passes")}})  # fmt: skip
    return rows


def job_totals(jobs: list[dict]) -> dict:
    """The jobs' summed prompt-pass and decode seconds and forward passes: a run's time
    split between prompts and decoding, beside its wall time.

    >>> job_totals([{"prefill_s": 0.25, "decode_s": 1.0, "forward_passes": 9},
    ...             {"prefill_s": 0.5, "decode_s": None, "forward_passes": 3}])
    {'prefill_s': 0.75, 'decode_s': 1.0, 'forward_passes': 12}
    """
    return {k: round(sum(j.get(k) or 0 for j in jobs), 3) for k in ("prefill_s", "decode_s", "forward_passes")}


def brief(row: dict) -> str:
    """One line of a run's figures (the device script shows each step's last lines)."""
    t = row.get("jobs_total") or {}
    return (f"tok/s less load {row.get('tok_s_less_load')}, first line less load {row.get('first_line_less_load_s')} s, "
            f"prompts {t.get('prefill_s')} s, decode {t.get('decode_s')} s, passes {t.get('forward_passes')}, "
            f"tokens {row.get('completion_tokens')}")  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jobs", type=Path)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(own)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            row = one_run(args.jobs, extra, Path(tmp), i)
            print(json.dumps(row), flush=True)
            print(brief(row), flush=True)
            rows.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": extra, "jobs_file": str(args.jobs),
                                        "runs": rows}, indent=2) + "\n")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
