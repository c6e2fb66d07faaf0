"""Where batched prompt lookup's greedy text parts from plain decoding, how
close the plain step's top two logits were there (a near-tie, or a fault).

    python bench/batch_pld_margin.py --arch llama --batch 3 --out r.json

Builds the tests' tiny model (tests/tiny.py, float32), runs the tests' jobs
(tests/test_batch_pld.py) one at a time without drafts and batched with
`--pld-in-batch`, and for every job whose texts differ decodes it again
plainly with mlx-lm's cache, recording each token's top-1 minus top-2 logit.
Reports the smallest margins of those jobs and where they fall.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

import tiny  # noqa: E402
from test_batch_pld import engine, jobs  # noqa: E402


def margins(e, job) -> list[tuple[int, int, float]]:
    """(index, token, top-1 minus top-2 logit) of each plainly decoded token."""
    tokens = e.prompt_tokens(job)
    cache = make_prompt_cache(e.model)
    logits = e.model(mx.array(tokens)[None], cache=cache)[0, -1]
    out = []
    for i in range(job.max_tokens):
        top = mx.sort(logits)[-2:].tolist()
        token = int(mx.argmax(logits).item())
        out.append((i, token, top[1] - top[0]))
        if token in e.tokenizer.eos_token_ids:
            break
        logits = e.model(mx.array([[token]]), cache=cache)[0, -1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    path = tiny.build_model(a.arch, Path(tempfile.mkdtemp()))
    plain = {r.id: r for r in engine(path, 1, draft="none").run_all(jobs())}
    batched = {r.id: r for r in engine(path, a.batch).run_all(jobs())}
    e = engine(path, 1, draft="none")
    report = {"device": str(mx.default_device()), "arch": a.arch, "batch": a.batch, "jobs": len(plain), "parted": []}
    smallest = []
    for job in jobs():
        p, b = plain[job.id], batched[job.id]
        m = margins(e, job)
        smallest.append((min(t[2] for t in m), job.id))
        if p.text == b.text:
            continue
        common = next((i for i, (x, y) in enumerate(zip(p.text, b.text)) if x != y), min(len(p.text), len(b.text)))
        report["parted"].append({"id": job.id, "tokens": len(m), "first_differing_char": common,
                                 "plain_tail": p.text[-12:], "batched_tail": b.text[-12:],
                                 "smallest_margins": sorted(m, key=lambda t: t[2])[:3]})  # fmt: skip
    report["smallest_margin_of_each_job"] = sorted(smallest)
    print(json.dumps(report, indent=1))
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
