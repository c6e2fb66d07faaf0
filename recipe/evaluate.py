"""Exact-match rate per task kind on held-out functions, with mlx-lm greedy decoding.

    python -m recipe.evaluate --model batchgen/demo --limit 40 [--out report.json]
        [--readme recipe/README.md]
    python -m recipe.evaluate --score outputs/edits.jsonl --answers jobs/answers/edits.jsonl

A reply counts as exact when it equals the expected answer after stripping trailing
whitespace. The similarity column (difflib ratio) shows how close the misses are.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from recipe import data

README_START = "<!-- quality:start -->"
README_END = "<!-- quality:end -->"


def select_tasks(tasks: list[data.Task], limit_per_kind: int) -> list[data.Task]:
    """A deterministic sample: the first `limit_per_kind` tasks of each kind in hash order."""
    ordered = sorted(tasks, key=lambda t: data.stable_hash(f"{t.function}|{t.kind}|eval"))
    picked, counts = [], defaultdict(int)
    for task in ordered:
        if counts[task.kind] < limit_per_kind:
            counts[task.kind] += 1
            picked.append(task)
    return picked


def interleave_kinds(tasks: list[data.Task]) -> list[data.Task]:
    """Round-robin over kinds: one of each kind, then the next of each kind, ..."""
    by_kind = defaultdict(list)
    for task in tasks:
        by_kind[task.kind].append(task)
    queues = [by_kind[kind] for kind in data.KINDS if by_kind[kind]]
    longest = max((len(q) for q in queues), default=0)
    return [q[i] for i in range(longest) for q in queues if i < len(q)]


def max_tokens_for(answer_tokens: int) -> int:
    """Room for the whole answer and its end token, plus a margin for near misses."""
    return int(answer_tokens * 1.15) + 8


def is_exact(reply: str, answer: str) -> bool:
    return reply.rstrip() == answer.rstrip()


def similarity(reply: str, answer: str) -> float:
    return difflib.SequenceMatcher(None, reply.rstrip(), answer.rstrip(), autojunk=False).ratio()


def summarize(rows: list[dict]) -> dict:
    """rows: {"kind", "exact", "similarity"} -> per-kind and overall rates."""
    by_kind = defaultdict(list)
    for row in rows:
        by_kind[row["kind"]].append(row)
        by_kind["all"].append(row)
    return {
        kind: {
            "n": len(items),
            "exact": sum(r["exact"] for r in items),
            "exact_rate": round(sum(r["exact"] for r in items) / len(items), 4),
            "mean_similarity": round(sum(r["similarity"] for r in items) / len(items), 4),
        }
        for kind, items in sorted(by_kind.items(), key=lambda kv: (kv[0] == "all", kv[0]))
    }


def generate_reply(model, tokenizer, task: data.Task) -> tuple[str, int]:
    from mlx_lm import stream_generate

    prompt = tokenizer.apply_chat_template(task.messages(), add_generation_prompt=True)
    limit = max_tokens_for(len(tokenizer.encode(task.answer)))
    text, count = "", 0
    for response in stream_generate(model, tokenizer, prompt, max_tokens=limit):
        text += response.text
        count = response.generation_tokens
    return text, count


def evaluate(
    model_dir: Path,
    tasks: list[data.Task],
    limit_per_kind: int,
    log=print,
    time_limit_s: float | None = None,
    dtype: str | None = None,
) -> dict:
    """Greedy-decode a per-kind sample of `tasks` with the model in `model_dir`; with a
    time limit, stop early (tasks are interleaved by kind, so every kind gets some).
    `dtype` ("float32", ...) casts the weights first: on a CPU float32 is several times
    faster than the stored bfloat16."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    if dtype:
        model.set_dtype(getattr(mx, dtype))
    rows, samples, generated, start = [], {}, 0, time.time()
    picked = interleave_kinds(select_tasks(tasks, limit_per_kind))
    for i, task in enumerate(picked, 1):
        if time_limit_s is not None and time.time() - start > time_limit_s:
            log(f"eval stopped by its time limit after {i - 1} tasks")
            break
        reply, count = generate_reply(model, tokenizer, task)
        generated += count
        row = {
            "kind": task.kind,
            "exact": is_exact(reply, task.answer),
            "similarity": similarity(reply, task.answer),
        }
        rows.append(row)
        if task.kind not in samples:
            samples[task.kind] = {
                "function": task.function,
                "user": task.user,
                "reply": reply,
                "answer": task.answer,
            }
        if i % 10 == 0 or i == len(picked):
            log(f"eval {i}/{len(picked)} exact so far {sum(r['exact'] for r in rows)}")
    seconds = time.time() - start
    return {
        "model": str(model_dir),
        "dtype": dtype or "as stored",
        "limit_per_kind": limit_per_kind,
        "tasks_done": len(rows),
        "per_kind": summarize(rows),
        "generated_tokens": generated,
        "seconds": round(seconds, 1),
        "samples": samples,
    }


# ---------------------------------------------------------------- scoring batchgen outputs


def reply_text(result: dict) -> tuple[str, str | None]:
    """(id, text) of a native or OpenAI-batch result line; text None for a failed job."""
    if "custom_id" in result:
        body = (result.get("response") or {}).get("body") or {}
        choices = body.get("choices") or [{}]
        return result["custom_id"], (choices[0].get("message") or {}).get("content")
    return result["id"], result.get("text")


def score_outputs(results_path: Path, answers_path: Path) -> dict:
    """Per-kind exact-match of a batchgen output file against jobs/answers/*.jsonl."""
    answers = {}
    for line in Path(answers_path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            answers[row["id"]] = row
    rows = []
    for line in Path(results_path).read_text().splitlines():
        if not line.strip():
            continue
        job_id, text = reply_text(json.loads(line))
        expected = answers.get(job_id)
        if expected is None:
            continue
        text = text or ""
        rows.append(
            {
                "kind": expected["kind"],
                "exact": is_exact(text, expected["answer"]),
                "similarity": similarity(text, expected["answer"]),
            }
        )
    return {"results": str(results_path), "answers": str(answers_path), "per_kind": summarize(rows)}


# ---------------------------------------------------------------- report


def quality_markdown(report: dict) -> str:
    lines = [
        "| kind | n | exact match | mean similarity |",
        "|---|---:|---:|---:|",
    ]
    for kind, stats in report["per_kind"].items():
        lines.append(
            f"| {kind} | {stats['n']} | {stats['exact_rate']:.0%} | {stats['mean_similarity']:.2f} |"
        )
    return "\n".join(lines)


def fill_readme(readme: Path, report: dict, note: str) -> None:
    """Replace the text between the quality markers of `readme`."""
    text = Path(readme).read_text()
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    body = f"\n{note}\n\n{quality_markdown(report)}\n"
    Path(readme).write_text(text[:start] + body + text[end:])


def held_out_tasks(processes: int | None = None) -> list[data.Task]:
    _train, held = data.split_functions(data.collect_functions(processes=processes))
    return data.build_tasks(held, processes=processes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="model directory for mlx_lm.load")
    parser.add_argument("--limit", type=int, default=40, help="held-out tasks per kind")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), help="cast the weights first"
    )
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--readme", type=Path, help="fill this README's quality section")
    parser.add_argument("--score", type=Path, help="a batchgen output file to score")
    parser.add_argument("--answers", type=Path, help="jobs/answers/*.jsonl for --score")
    args = parser.parse_args(argv)
    if args.score:
        if not args.answers:
            parser.error("--score needs --answers")
        report = score_outputs(args.score, args.answers)
    elif args.model:
        report = evaluate(
            args.model,
            held_out_tasks(),
            args.limit,
            log=lambda m: print(m, file=sys.stderr, flush=True),
            dtype=args.dtype,
        )
    else:
        parser.error("give --model or --score")
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(quality_markdown(report))
    if args.readme:
        note = (
            f"Greedy decoding with mlx-lm, {report.get('limit_per_kind', 'all')} held-out tasks "
            "per kind; exact = identical after stripping trailing whitespace."
        )
        fill_readme(args.readme, report, note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
