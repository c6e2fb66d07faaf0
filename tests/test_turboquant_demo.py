"""TurboQuant on the bundled demo model (float32 on the CPU) against the
full-precision cache and mlx-lm's own 4-bit KV cache: teacher-forced perplexity of
the expected answers of edit jobs, greedy outputs against the full cache's, and the
bytes each cache holds. (bench/turboquant_demo_quality.py measures more jobs and
variants.)"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # the demo model's whole files: minutes on two cores
from mlx_lm import load
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from batchgen.cache.factory import make_turboquant_cache
from batchgen.transforms.attention import unroute_attention
from batchgen.bench import answer_nll, greedy_ids, prefix_agreement
from batchgen.config import DEMO_MODEL_DIR

JOBS = Path(__file__).resolve().parents[1] / "jobs"


@pytest.fixture(scope="module", autouse=True)
def _restore_stock_attention():
    yield
    unroute_attention()


@pytest.fixture(scope="module")
def demo():
    """(model in float32, tokenizer, system prompt, edit jobs)."""
    model, tokenizer = load(str(DEMO_MODEL_DIR))
    model.set_dtype(mx.float32)
    lines = [json.loads(line) for line in (JOBS / "edits.jsonl").read_text().splitlines()]
    return model, tokenizer, lines[0]["batchgen"]["system"], lines[1:]


def caches(model) -> dict:
    """The three caches compared: full precision, mlx-lm's 4-bit (group 32, the demo's head_dim), TurboQuant 4-bit."""
    layers = len(model.layers)
    return {
        "full": lambda: [KVCache() for _ in range(layers)],
        "mlx4": lambda: [QuantizedKVCache(group_size=32, bits=4) for _ in range(layers)],
        "tq4": lambda: make_turboquant_cache(model, 4),
    }


def prompt(tokenizer, system: str, job: dict) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "system", "content": system}] + job["messages"],
                                         add_generation_prompt=True)  # fmt: skip


@pytest.fixture(scope="module")
def measured(demo):
    """Per cache: answer perplexity and total bytes held after each job's answer, over
    every 30th edit job (one of each kind; answers of 70 to 360 tokens)."""
    model, tokenizer, system, jobs = demo
    answers = {}
    for line in (JOBS / "answers" / "edits.jsonl").read_text().splitlines():
        row = json.loads(line)
        answers[row["id"]] = row["answer"]
    eos = min(tokenizer.eos_token_ids)
    makers = caches(model)
    out = {name: {"nll": 0.0, "bytes": 0} for name in makers}
    count = 0
    for job in jobs[::30]:
        answer = tokenizer.encode(answers[job["id"]], add_special_tokens=False) + [eos]
        count += len(answer)
        for name, make in makers.items():
            cache = make()
            out[name]["nll"] += answer_nll(model, prompt(tokenizer, system, job), answer, cache)
            out[name]["bytes"] += sum(c.nbytes for c in cache)
    for row in out.values():
        row["ppl"] = float(np.exp(row["nll"] / count))
    return out


@pytest.fixture(scope="module")
def agreement(demo):
    """Per cache: the mean fraction of each greedy output (up to 96 tokens) before its
    first difference from the full cache's, the outputs identical to it, and the
    bytes held, over every 15th edit job (eight jobs, two of each kind)."""
    model, tokenizer, system, jobs = demo
    makers = caches(model)
    out = {name: {"prefix": [], "identical": 0, "bytes": 0} for name in makers}
    for job in jobs[::15]:
        ids, ref = prompt(tokenizer, system, job), None
        for name, make in makers.items():
            cache = make()
            got = greedy_ids(model, ids, cache, 96, set(tokenizer.eos_token_ids))
            ref = got if ref is None else ref  # "full" comes first
            out[name]["prefix"].append(prefix_agreement(got, ref))
            out[name]["identical"] += got == ref
            out[name]["bytes"] += sum(c.nbytes for c in cache)
    return {name: {**row, "prefix": float(np.mean(row["prefix"]))} for name, row in out.items()}


def test_turboquant_perplexity_within_one_percent_of_full(measured):
    full, ours = measured["full"]["ppl"], measured["tq4"]["ppl"]
    assert ours <= 1.01 * full, (ours, full, measured["mlx4"]["ppl"])


def test_turboquant_holds_no_more_bytes_than_mlx_4bit(measured):
    assert measured["tq4"]["bytes"] <= measured["mlx4"]["bytes"] < measured["full"]["bytes"]


def test_turboquant_greedy_outputs_at_least_as_close_as_mlx_4bit(agreement):
    ours, theirs = agreement["tq4"], agreement["mlx4"]
    assert agreement["full"]["identical"] == 8  # the reference is the reference
    assert ours["identical"] >= theirs["identical"], agreement
    assert ours["prefix"] >= theirs["prefix"], agreement
    assert ours["bytes"] <= theirs["bytes"], agreement
