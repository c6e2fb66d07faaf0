"""One job's forward passes over a TurboQuant cache against the fp16 cache, through the
engine as `batchgen run` makes them (fusion, the attention dispatch, the cache types the
device takes): a plain one-token step and verify passes of a few tokens, each followed by
the trim a rejected draft makes, at a few history lengths.

    python bench/turboquant_passes.py [--model DIR] [--contexts 300,2000] [--lengths 1,6]
        [--rounds 3] [--reps 20] [--out F]

Where a one-at-a-time TurboQuant run is slower than fp16's, this says whether the plain
steps or the verify passes pay, and whether the gap grows with the history. The sides take
turns round by round; each figure is ms a pass, the median of the rounds (every pass
synchronized: what a one-job loop waits for). Prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the batchgen of the tree this script is in

from batchgen.config import DEMO_MODEL_DIR, EngineConfig, KVConfig  # noqa: E402
from batchgen.engine.core import Engine, device_name  # noqa: E402

KINDS = ("fp16", "turboquant")


def pass_ms(model, cache: list, length: int, reps: int) -> float:
    """ms of one pass feeding `length` tokens and reading its argmax back, then trimming
    them off (the history stays where it was), over `reps` passes after one untimed."""
    total = 0.0
    for rep in range(reps + 1):
        start = time.perf_counter()
        out = model(mx.array([[11] * length]), cache=cache)
        mx.eval(mx.argmax(out[0], axis=-1))
        if rep:
            total += time.perf_counter() - start
        for c in cache:
            c.trim(length)
    return total / reps * 1e3


def measure(engine: Engine, contexts: list[int], lengths: list[int], rounds: int, reps: int) -> list[dict]:
    vocab = engine.model_config.get("vocab_size", 1000)
    rows = []
    for context in contexts:
        prompt = mx.random.randint(0, vocab, (1, context), key=mx.random.key(context))
        caches = {}
        for kind in KINDS:
            caches[kind] = engine.make_cache(KVConfig(kind=kind, bits=4))
            mx.eval(engine.model(prompt, cache=caches[kind]))
        ms = {(kind, n): [] for kind in KINDS for n in lengths}
        for r in range(rounds):
            for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                for n in lengths:
                    ms[kind, n].append(round(pass_ms(engine.model, caches[kind], n, reps), 3))
        for n in lengths:
            fp16, tq = (round(statistics.median(ms[k, n]), 3) for k in KINDS)
            rows.append({"context": context, "tokens_fed": n, "fp16_ms": fp16, "turboquant_ms": tq,
                         "turboquant_over_fp16": round(tq / fp16, 3), "rounds": {k: ms[k, n] for k in KINDS}})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEMO_MODEL_DIR))
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    ap.add_argument("--contexts", default="300,2000")
    ap.add_argument("--lengths", default="1,6", help="tokens a pass feeds: 1 is a plain step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    engine = Engine.load(EngineConfig(model=a.model, dtype=a.dtype))
    rows = measure(engine, [int(x) for x in a.contexts.split(",")], [int(x) for x in a.lengths.split(",")],
                   a.rounds, a.reps)  # fmt: skip
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device_name(), "model": a.model, "dtype": a.dtype or "as stored", "reps": a.reps, "rows": rows}  # fmt: skip
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
