"""Does llguidance spread a batch's masks over the host's cores? Per-step
`LLExecutor` mask time for `--rows` rows of one schema, as the rows' matchers
are made: copies of one kept matcher (`deep_copy` shares its lexer state, one
lock), copies of K kept matchers (K locks), or a fresh matcher each.

    python bench/grammar_threads.py --tokenizer TOKENIZER_JSON --n-vocab 151936 --rows 256 --out r.json

(`--write-schema F` here, then `--schema-file F` there: a machine without MLX.)

No model and no GPU: host work only. Each row takes a random allowed token
each step (the mask's own choice), so the rows walk the schema apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def schema_and_layout(path: Path | None) -> tuple[dict, dict]:
    """The features bench's schema and batchgen's JSON layout, or both from a
    file written by `--write-schema` (a machine without MLX, which batchgen's
    modules import)."""
    if path is not None:
        d = json.loads(path.read_text())
        return d["schema"], d["layout"]
    from batchgen.bench_features import FEATURE_SCHEMA
    from batchgen.decode.grammar import JSON_LAYOUT

    return FEATURE_SCHEMA, JSON_LAYOUT


def step_ms(lib, tokenizer, grammar, n_vocab, rows, kept, threads, steps, seed=0, contiguous=False) -> dict:
    """ms per step of the executor's mask call (the first 5 steps apart: cold lexer
    states). `contiguous`: the copies of one kept matcher on neighbouring rows
    (else the kept matchers take the rows in turn)."""
    if kept:
        seeds = [lib.LLMatcher(tokenizer, grammar, log_level=0) for _ in range(kept)]
        matchers = [seeds[i * kept // rows if contiguous else i % kept].deep_copy() for i in range(rows)]
    else:
        matchers = [lib.LLMatcher(tokenizer, grammar, log_level=0) for _ in range(rows)]
    ex = lib.LLExecutor(threads) if threads else lib.LLExecutor()
    words = (n_vocab + 31) // 32
    out = np.full((rows, words), -1, np.int32)
    rng = np.random.default_rng(seed)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        ex.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], out.ctypes.data, words * 4, rows)
        times.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            if m.is_stopped() or m.is_error():
                continue
            allowed = np.flatnonzero(np.unpackbits(out[i].view(np.uint8), bitorder="little")[:n_vocab])
            m.consume_token(int(rng.choice(allowed)))
    return {"first5_ms": round(sum(times[:5]) / 5 * 1e3, 3), "ms": round(float(np.median(times[5:])) * 1e3, 3)}


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", type=Path, default=Path(__file__).resolve().parents[1] / "batchgen/demo/tokenizer.json")
    p.add_argument("--n-vocab", type=int, default=None, help="the logits' width (default: the tokenizer's)")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--kept", default="1,4,16,16c,64,0",
                   help="kept matchers copied from (0: a fresh one per row; a trailing c: each one's copies on neighbouring rows)")
    p.add_argument("--threads", default="0", help="executor threads (0: llguidance's default)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--schema-file", type=Path)
    p.add_argument("--write-schema", type=Path, help="write the schema and layout to this file, and stop")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    schema, layout = schema_and_layout(a.schema_file)
    if a.write_schema:
        a.write_schema.write_text(json.dumps({"schema": schema, "layout": layout}))
        return None
    import llguidance as lib
    from tokenizers import Tokenizer

    text = a.tokenizer.read_text()
    parsed = Tokenizer.from_str(text)
    size = parsed.get_vocab_size()
    eos = [parsed.token_to_id("<|endoftext|>") or 0]
    n_vocab = a.n_vocab or size
    tok = lib.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
    grammar = lib.LLMatcher.grammar_from_json_schema(json.dumps(schema, sort_keys=True), defaults=layout)
    res = {"cpus": os.cpu_count(), "tokenizer": a.tokenizer.name, "vocab": size, "n_vocab": n_vocab, "rows": a.rows, "runs": []}
    for threads in map(int, a.threads.split(",")):
        for kept in a.kept.split(","):
            c = kept.endswith("c")
            r = {"threads": threads, "kept": kept,
                 **step_ms(lib, tok, grammar, n_vocab, a.rows, int(kept.rstrip("c")), threads, a.steps, contiguous=c)}
            res["runs"].append(r)
            print(json.dumps(r), flush=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
