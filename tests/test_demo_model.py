"""The bundled demo model: loads offline with mlx-lm, and PLD's greedy text
equals plain greedy decoding over every job of jobs/edits.jsonl (float32)."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the demo model's whole files: minutes on two cores

from batchgen.config import DEMO_MODEL_DIR, DecodeConfig, EngineConfig, PromptCacheConfig
from batchgen.engine.core import Engine
from batchgen.jobs import Job, iter_jobs, scan_jobs

EDITS = Path(__file__).resolve().parents[1] / "jobs" / "edits.jsonl"


def demo_jobs(path=EDITS):
    scan, defaults = scan_jobs(path, 256, None)
    return [j for j in iter_jobs(path, defaults, scan.format, scan.header_line) if isinstance(j, Job)]


@pytest.fixture(scope="module")
def engines():
    def make(draft, **decode):
        cfg = EngineConfig(model=str(DEMO_MODEL_DIR), dtype="float32",
                           decode=DecodeConfig(draft=draft, **decode),
                           prompt_cache=PromptCacheConfig(enabled=True))  # fmt: skip
        return Engine.load(cfg)

    return make("none"), make("pld", pld_adaptive=False)


def test_demo_model_is_bundled_and_small():
    files = {p.name for p in DEMO_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert (DEMO_MODEL_DIR / "model.safetensors").stat().st_size <= 20 * 2**20


def test_pld_equals_plain_greedy_on_every_edit_job(engines):
    plain, pld = engines
    jobs = demo_jobs()
    assert len(jobs) >= 100
    accepted = passes = tokens = 0
    for job in jobs:
        a, b = plain.run(job), pld.run(job)
        assert a.ok and b.ok
        assert b.text == a.text, job.id
        assert b.usage.completion_tokens == a.usage.completion_tokens, job.id
        assert b.finish_reason == a.finish_reason
        accepted += b.stats.pld_accepted
        passes += b.stats.forward_passes
        tokens += b.usage.completion_tokens
    # the demo model copies its prompt: drafts are accepted and passes drop
    assert accepted > tokens // 4 and passes < 0.8 * tokens
