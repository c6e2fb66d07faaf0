"""Write batchgen job files from held-out tasks, with their exact answers.

    PYTHONPATH=$PWD python -m recipe.make_jobs --tokenizer batchgen/demo [--out jobs]

jobs/example.jsonl        10 quick jobs, mixed kinds
jobs/edits.jsonl          120 copy-heavy edit jobs (prompt-lookup decoding helps)
jobs/freeform.jsonl       60 write_function jobs (little to copy)
jobs/openai-batch.jsonl   20 jobs in the OpenAI Batch format
jobs/long-system.jsonl    30 jobs sharing a ~1.5k-token system prompt (prewarm helps)
jobs/answers/<stem>.jsonl the expected answer of every job, keyed by id (or custom_id)

Each job's max_tokens is a little above its answer's token count, so a correct reply
can finish. Tasks come from this interpreter's stdlib: the files are deterministic for
a given Python version and tokenizer.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections import defaultdict
from pathlib import Path

from recipe import data
from recipe.evaluate import held_out_tasks, max_tokens_for

QUICK_ANSWER_CHARS = 400
# The build trains on chats of up to 2048 tokens; keep a margin for template tokens.
LONG_CONTEXT_TOKENS = 2000
DEFAULT_MAX_TOKENS = 256


class TaskPool:
    """Held-out tasks per kind in a fixed hash order; each task is handed out once, so
    the job files do not overlap."""

    def __init__(self, tasks: list[data.Task]):
        self.by_kind = defaultdict(list)
        for task in sorted(tasks, key=lambda t: data.stable_hash(f"{t.function}|{t.kind}|jobs")):
            self.by_kind[task.kind].append(task)

    def take(self, kind: str, count: int, accept=None) -> list[data.Task]:
        """The first `count` remaining tasks of `kind` that `accept` (if given) approves."""
        pool = self.by_kind[kind]
        picked = [t for t in pool if accept is None or accept(t)][:count]
        if len(picked) < count:
            raise ValueError(f"only {len(picked)} held-out {kind} tasks left, {count} wanted")
        self.by_kind[kind] = [t for t in pool if t not in picked]
        return picked


def header_line(system: str) -> dict:
    return {"batchgen": {"system": system, "defaults": {"max_tokens": DEFAULT_MAX_TOKENS}}}


def native_job(job_id: str, task: data.Task, max_tokens: int) -> dict:
    return {
        "id": job_id,
        "messages": [{"role": "user", "content": task.user}],
        "max_tokens": max_tokens,
        "metadata": {"kind": task.kind, "function": task.function},
    }


def openai_job(job_id: str, task: data.Task, max_tokens: int) -> dict:
    return {
        "custom_id": job_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "batchgen-demo",
            "messages": [
                {"role": "system", "content": task.system},
                {"role": "user", "content": task.user},
            ],
            "max_tokens": max_tokens,
        },
    }


def answer_line(job_id: str, task: data.Task) -> dict:
    return {"id": job_id, "kind": task.kind, "function": task.function, "answer": task.answer}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    path.write_text(text, encoding="utf-8")


def job_set(tasks: list[data.Task], count_tokens, style: str = "native", system: str = data.SYSTEM):
    """(job lines, answer lines) for one file; ids are '<kind>-<nnn>' within the file."""
    jobs, answers, seen = [], [], defaultdict(int)
    for task in tasks:
        seen[task.kind] += 1
        job_id = f"{task.kind}-{seen[task.kind]:03d}"
        max_tokens = max_tokens_for(count_tokens(task.answer))
        make = openai_job if style == "openai" else native_job
        jobs.append(make(job_id, task, max_tokens))
        answers.append(answer_line(job_id, task))
    header = [] if style == "openai" else [header_line(system)]
    return header + jobs, answers


def plan(pool: TaskPool, count_tokens) -> dict[str, tuple[list[data.Task], str, str]]:
    """file stem -> (tasks, style, system). Quick jobs are taken first, from short answers."""

    def quick(task: data.Task) -> bool:
        return len(task.answer) <= QUICK_ANSWER_CHARS

    def fits_long_context(task: data.Task) -> bool:
        return count_tokens(task.user) + count_tokens(task.answer) <= long_budget

    # Whole long-system chats stay within the longest sequences the model was trained on.
    long_budget = LONG_CONTEXT_TOKENS - count_tokens(data.long_system_prompt())
    example = [t for kind in data.KINDS for t in pool.take(kind, 2, quick)]
    edits = [t for kind in data.EDIT_KINDS for t in pool.take(kind, 30)]
    freeform = pool.take("write_function", 60)
    openai = [t for kind in data.KINDS for t in pool.take(kind, 4)]
    long_system = [t for kind in data.KINDS for t in pool.take(kind, 6, fits_long_context)]
    return {
        "example": (example, "native", data.SYSTEM),
        "edits": (edits, "native", data.SYSTEM),
        "freeform": (freeform, "native", data.SYSTEM),
        "openai-batch": (openai, "openai", data.SYSTEM),
        "long-system": (long_system, "native", data.long_system_prompt()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokenizer", type=Path, default=Path("batchgen/demo"), help="dir with tokenizer.json"
    )
    parser.add_argument("--out", type=Path, default=Path("jobs"))
    args = parser.parse_args(argv)

    from recipe.tokenizer import load_tokenizer

    pool = TaskPool(held_out_tasks())  # forks workers: before the tokenizer starts threads
    tokenizer = load_tokenizer(args.tokenizer)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    manifest = {
        "python": platform.python_version(),
        "tokenizer_vocab": tokenizer.get_vocab_size(),
        "long_system_prompt_tokens": count_tokens(data.long_system_prompt()),
        "files": {},
    }
    for stem, (tasks, style, system) in plan(pool, count_tokens).items():
        jobs, answers = job_set(tasks, count_tokens, style, system)
        write_jsonl(args.out / f"{stem}.jsonl", jobs)
        write_jsonl(args.out / "answers" / f"{stem}.jsonl", answers)
        manifest["files"][stem] = {
            "jobs": len(answers),
            "bytes": (args.out / f"{stem}.jsonl").stat().st_size,
        }
        print(f"{stem}: {len(answers)} jobs", flush=True)
    (args.out / "answers" / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
