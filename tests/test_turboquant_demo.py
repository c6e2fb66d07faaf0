"""TurboQuant on the bundled demo model (float32 on the CPU) against the
full-precision cache and mlx-lm's own 4-bit KV cache: teacher-forced perplexity of
the expected answers of edit jobs, and the bytes each cache holds. (Greedy-output
agreement is measured by bench/turboquant_demo_quality.py.)"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from batchgen import turboquant as tq
from batchgen.bench import answer_nll
from batchgen.config import DEMO_MODEL_DIR

JOBS = Path(__file__).resolve().parents[1] / "jobs"


@pytest.fixture(scope="module", autouse=True)
def _restore_stock_attention():
    yield
    tq.uninstall_attention()


@pytest.fixture(scope="module")
def measured():
    """Per cache: answer perplexity and total bytes held after each job's answer, over
    every 30th edit job (one of each kind; answers of 70 to 360 tokens)."""
    model, tokenizer = load(str(DEMO_MODEL_DIR))
    model.set_dtype(mx.float32)
    lines = [json.loads(line) for line in (JOBS / "edits.jsonl").read_text().splitlines()]
    system, jobs = lines[0]["batchgen"]["system"], lines[1:][::30]
    answers = {}
    for line in (JOBS / "answers" / "edits.jsonl").read_text().splitlines():
        row = json.loads(line)
        answers[row["id"]] = row["answer"]
    layers = len(model.layers)
    caches = {
        "full": lambda: [KVCache() for _ in range(layers)],
        "mlx4": lambda: [QuantizedKVCache(group_size=32, bits=4) for _ in range(layers)],  # head_dim 32
        "tq4": lambda: tq.make_turboquant_cache(model, 4),
    }
    eos = min(tokenizer.eos_token_ids)
    out = {name: {"nll": 0.0, "bytes": 0} for name in caches}
    count = 0
    for job in jobs:
        messages = [{"role": "system", "content": system}] + job["messages"]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        answer = tokenizer.encode(answers[job["id"]], add_special_tokens=False) + [eos]
        count += len(answer)
        for name, make in caches.items():
            cache = make()
            out[name]["nll"] += answer_nll(model, prompt, answer, cache)
            out[name]["bytes"] += sum(c.nbytes for c in cache)
    for row in out.values():
        row["ppl"] = float(np.exp(row["nll"] / count))
    return out


def test_turboquant_perplexity_within_one_percent_of_full(measured):
    full, ours = measured["full"]["ppl"], measured["tq4"]["ppl"]
    assert ours <= 1.01 * full, (ours, full, measured["mlx4"]["ppl"])


def test_turboquant_holds_no_more_bytes_than_mlx_4bit(measured):
    assert measured["tq4"]["bytes"] <= measured["mlx4"]["bytes"] < measured["full"]["bytes"]
