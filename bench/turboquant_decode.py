"""Decode speed over a TurboQuant cache against mlx-lm's fp16 cache: one model, one
loop, one process.

    python bench/turboquant_decode.py qwen2.5-7b 1024,8192,32768 [--rounds 5] [--tokens 33]
        [--out results.jsonl]

For each context: one random prompt prefilled into mlx-lm's KVCache (fp16: the model's
bf16) and into batchgen's TurboQuant cache (4 bits: keys 5, values 3, its default sinks
and window), then `rounds` rounds of `tokens` greedy steps through mlx-lm's own
`generate_step` on each side, the sides taking turns so that a machine's drift falls on
both. Both sides run the same loop and model: the figure is the cache's alone (no
fusion, no prompt lookup). Another version of batchgen is compared by running this
script in both trees (`BASELINE=DIR bash bench/h200.sh headline7b`).

Prints a JSON line a context: each side's ms a token in each round and their median,
TurboQuant's decode speed over fp16's (`tq_over_fp16`, from the medians;
`tq_over_fp16_paired`, the median of the rounds' own ratios) and each cache's bytes
after the prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the batchgen of the tree this script is in

from batchgen.bench import random_model  # noqa: E402
from batchgen.cache.factory import make_turboquant_cache  # noqa: E402


def decode_ms(model, cache, token: int, n: int) -> tuple[float, int]:
    """ms a token over n greedy steps from `token` (the first step's own time left out)."""
    start, last = None, token
    for i, (tok, _) in enumerate(generate_step(mx.array([token]), model, max_tokens=n, prompt_cache=cache)):
        if i == 0:
            start = time.perf_counter()
        last = tok
    return (time.perf_counter() - start) / (n - 1) * 1e3, int(last)


def prefilled(model, prompt: mx.array, cache) -> int:
    """The prompt into `cache`; its next token."""
    tok, _ = next(generate_step(prompt, model, max_tokens=1, prompt_cache=cache, prefill_step_size=2048))
    mx.eval([c.state for c in cache])
    return int(tok)


def measure(model, vocab: int, context: int, rounds: int, tokens: int) -> dict:
    prompt = mx.random.randint(0, vocab, (context,), key=mx.random.key(context))
    sides = {"fp16": make_prompt_cache(model), "tq": make_turboquant_cache(model, 4)}
    last = {name: prefilled(model, prompt, cache) for name, cache in sides.items()}  # each side's last token
    row = {"context": context, "tokens": tokens,
           "kv_bytes": {name: sum(c.nbytes for c in cache) for name, cache in sides.items()}}  # fmt: skip
    ms = {name: [] for name in sides}
    for r in range(rounds):
        for name in list(sides) if r % 2 == 0 else list(reversed(sides)):
            t, last[name] = decode_ms(model, sides[name], last[name], tokens)
            ms[name].append(round(t, 3))
    for name in sides:
        row[f"{name}_ms"] = ms[name]
        row[f"{name}_ms_median"] = statistics.median(ms[name])
    row["tq_over_fp16"] = row["fp16_ms_median"] / row["tq_ms_median"]
    # Round by round (the two sides back to back): steadier where the machine drifts.
    row["tq_over_fp16_paired"] = statistics.median(a / b for a, b in zip(ms["fp16"], ms["tq"]))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description="TurboQuant decode against mlx-lm's fp16 cache, one loop, sides in turn")
    ap.add_argument("shape", help="a `batchgen bench --shape` name, e.g. qwen2.5-7b")
    ap.add_argument("contexts", help="comma-separated prompt lengths, e.g. 1024,8192,32768")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=33, help="greedy steps a round (the first one's time left out)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out")
    a = ap.parse_args()
    model, config = random_model(a.shape, a.dtype, None, 0)
    for context in (int(x) for x in a.contexts.split(",")):
        row = {"shape": a.shape, "device": str(mx.default_device()),
               **measure(model, config["vocab_size"], context, a.rounds, a.tokens)}  # fmt: skip
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        mx.clear_cache()


if __name__ == "__main__":
    main()
