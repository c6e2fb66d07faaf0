"""Host time of logprob entries in a batch: each step hands every row its token
(`Entries.add`), and each row's result line writes its entries at the end (the
`orjson` dump `output.result_line` makes). Numbers random, the demo model's
tokenizer; no model runs. Run from a tree to time that tree's entries:

    python bench/logprob_entries.py [--rows 256] [--steps 128] [--k 5] [--repeats 3] [--out F]

Prints ms a step: `add` (every row's token, each step) and `lines` (the rows'
entries written at the end, spread over the steps), the host memory the rows' entries
hold before their lines are written (`tracemalloc`, bytes a token: what a run holds
for every logprobs token not yet written), and a digest of the lines (equal digests:
equal bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the batchgen of the tree this script is in

from batchgen.config import DEMO_MODEL_DIR  # noqa: E402
from batchgen.decode.logprobs import Entries, TokenText  # noqa: E402


def fragment(obj):
    return orjson.Fragment(obj.json())  # entries that write themselves (trees that have them)


def step(rows: list, tokens, chosen, top_ids, top_lps) -> None:
    """One step's numbers read back and handed to every row (`scheduler._read`)."""
    tokens, chosen, top_ids, top_lps = tokens.tolist(), chosen.tolist(), top_ids.tolist(), top_lps.tolist()
    for i, e in enumerate(rows):
        e.add(tokens[i], chosen[i], top_ids[i], top_lps[i])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    text = TokenText(tokenizer._tokenizer)
    vocab = len(tokenizer.vocab)
    rng = np.random.default_rng(0)
    # each step's numbers as arrays, read back into lists inside the step, as the scheduler reads them
    tokens = rng.integers(0, vocab, (a.steps, a.rows))
    chosen = (-rng.exponential(2.0, (a.steps, a.rows))).astype(np.float32)
    top_ids = rng.integers(0, vocab, (a.steps, a.rows, a.k)).astype(np.int32)
    top_lps = (-np.sort(rng.exponential(2.0, (a.steps, a.rows, a.k)), axis=-1)).astype(np.float32)
    warm = getattr(text, "pieces", text)  # every token's text (and JSON pieces) made once, as a long run has
    for t in range(vocab):
        warm(t)
    runs = []
    for _ in range(a.repeats):
        rows = [Entries(text, a.k) for _ in range(a.rows)]
        t0 = time.perf_counter()
        for s in range(a.steps):
            step(rows, tokens[s], chosen[s], top_ids[s], top_lps[s])
        t1 = time.perf_counter()
        lines = [orjson.dumps({"logprobs": {"content": e.result(set())}}, default=fragment) for e in rows]
        t2 = time.perf_counter()
        runs.append({"add_ms_a_step": round(1e3 * (t1 - t0) / a.steps, 3),
                     "lines_ms_a_step": round(1e3 * (t2 - t1) / a.steps, 3)})  # fmt: skip
        print(json.dumps(runs[-1]), flush=True)
    tracemalloc.start()  # untimed: the entries' memory, the same tokens handed over again
    rows = [Entries(text, a.k) for _ in range(a.rows)]
    before = tracemalloc.get_traced_memory()[0]
    for s in range(a.steps):
        step(rows, tokens[s], chosen[s], top_ids[s], top_lps[s])
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    digest = hashlib.sha1(b"\n".join(lines)).hexdigest()
    per_token = round(held / (a.rows * a.steps), 1)
    out = {"rows": a.rows, "steps": a.steps, "k": a.k, "runs": runs, "held_bytes": held,
           "held_bytes_a_token": per_token, "lines_sha1": digest}  # fmt: skip
    print(f"entries held {held / 1e6:.2f} MB ({per_token} bytes a token); lines sha1 {digest}")
    if a.out:
        a.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
