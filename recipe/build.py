"""Build the demo chat model end to end, in one command:

    PYTHONPATH=$PWD python -m recipe.build --out DIR [--minutes 5] [--eval-limit N]

stdlib functions -> tasks -> tokenizer -> token ids -> training -> DIR/model.safetensors,
config.json, tokenizer files -> held-out evaluation (when mlx is importable) ->
DIR/recipe.json with the figures of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from recipe import data
from recipe import tokenizer as tok
from recipe.model_config import ARCHITECTURES, ModelConfig

START_S = time.time()


def log(message: str) -> None:
    print(f"[{time.time() - START_S:7.1f}s] {message}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--minutes", type=float, default=5.0, help="training wall-clock budget")
    parser.add_argument(
        "--total-minutes",
        type=float,
        default=9.0,
        help="cap on the whole build: training and eval are cut short to finish by then",
    )
    parser.add_argument("--max-steps", type=int, default=1_000_000)
    parser.add_argument(
        "--eval-limit", type=int, default=20, help="held-out tasks per kind (0: skip)"
    )
    parser.add_argument("--device", default="auto", help="auto (cuda, else cpu), cuda, cpu")
    parser.add_argument(
        "--batch-tokens", type=int, default=None, help="default 65536 on cuda, 4096 on cpu"
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--vocab-size", type=int, default=tok.DEFAULT_VOCAB_SIZE)
    parser.add_argument("--max-len", type=int, default=2048, help="longest training input, tokens")
    parser.add_argument(
        "--variants", type=int, default=8, help="training tasks per edit kind and function"
    )
    parser.add_argument(
        "--augment",
        choices=("on", "off"),
        default="on",
        help="on: variants >= 1 show the function with respelled identifiers, and draw new "
        "names, comments and docstrings from pools harvested from the training functions; "
        "off: variants only re-draw the choices of rename/docstring/reorder_args",
    )
    parser.add_argument(
        "--write-function-percent",
        type=int,
        default=25,
        help="share of training functions that keep their write_function task",
    )
    parser.add_argument(
        "--max-functions",
        type=int,
        default=0,
        help="train on this many training functions only (0: all); for quick runs",
    )
    model = parser.add_argument_group("model", "architecture (defaults: the shipped model)")
    model.add_argument("--arch", choices=sorted(ARCHITECTURES), default="qwen2")
    model.add_argument("--hidden-size", type=int, default=256)
    model.add_argument("--layers", type=int, default=8)
    model.add_argument("--heads", type=int, default=8, help="query heads")
    model.add_argument("--kv-heads", type=int, default=4)
    model.add_argument(
        "--head-dim",
        type=int,
        default=None,
        help="default hidden size // heads; qwen2 takes no other value (mlx-lm derives it)",
    )
    model.add_argument(
        "--intermediate-size", type=int, default=640, help="dense MLP width (not qwen3_moe's)"
    )
    model.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts per layer")
    model.add_argument(
        "--experts-per-token", type=int, default=2, help="qwen3_moe: experts chosen per token"
    )
    model.add_argument(
        "--moe-intermediate-size", type=int, default=128, help="qwen3_moe: expert MLP width"
    )
    model.add_argument(
        "--router-aux-loss-coef",
        type=float,
        default=0.01,
        help="qwen3_moe: weight of the load-balancing loss in training",
    )
    model.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--dropout", type=float, default=0.1, help="residual/embedding dropout")
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument(
        "--track-tasks",
        type=int,
        default=None,
        help="held-out edit tasks whose loss is tracked (default 256 on cuda, 32 on cpu)",
    )
    parser.add_argument(
        "--track-every-s",
        type=float,
        default=None,
        help="seconds between log lines and held-out losses (default 10 on cuda, 60 on cpu)",
    )
    parser.add_argument(
        "--keep-best",
        choices=("on", "off"),
        default="on",
        help="export the weights of the best held-out edit loss rather than the last ones",
    )
    parser.add_argument(
        "--processes", type=int, default=None, help="data workers (default: all cores)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    try:  # a bad architecture fails now, not after the data stage
        model_config(args, args.vocab_size)
    except ValueError as error:
        parser.error(str(error))
    return args


def build_data(args) -> tuple[list, list, dict, list]:
    functions = data.collect_functions(processes=args.processes)
    train_fns, held_fns = data.split_functions(functions)
    task_fns = subsample(train_fns, args.max_functions)
    pools = data.harvest_pools(train_fns, args.processes) if args.augment == "on" else None
    train_tasks = data.assign_training_systems(
        data.build_tasks(
            task_fns,
            variants=args.variants,
            processes=args.processes,
            pools=pools,
            write_function_percent=args.write_function_percent,
        )
    )
    held_tasks = data.build_tasks(held_fns, processes=args.processes)
    counts = {
        "stdlib": str(data.stdlib_root()),
        "functions": {"train": len(task_fns), "held_out": len(held_fns)},
        "modules": {
            "train": len({f.path for f in task_fns}),
            "held_out": len({f.path for f in held_fns}),
        },
        "tasks": {
            "train": dict(Counter(t.kind for t in train_tasks)),
            "held_out": dict(Counter(t.kind for t in held_tasks)),
        },
        "pools": None if pools is None else {k: len(v) for k, v in vars(pools).items()},
    }
    log(
        f"data: {counts['functions']} functions, {len(train_tasks)} train / {len(held_tasks)} held-out tasks"
    )
    # The tokenizer sees every training function, also with --max-functions.
    return train_tasks, held_tasks, counts, train_fns


def subsample(functions: list, limit: int) -> list:
    """`limit` functions in a fixed hash order (all when limit <= 0), in their order."""
    if limit <= 0 or limit >= len(functions):
        return functions
    order = sorted(range(len(functions)), key=lambda i: data.stable_hash(functions[i].name))
    keep = set(order[:limit])
    return [f for i, f in enumerate(functions) if i in keep]


def tracked_tasks(held_tasks: list, per_edit_kind: int, eval_limit: int) -> dict[str, list]:
    """The fixed held-out subset whose loss is tracked during training: `per_edit_kind`
    tasks of each edit kind ("edit", which picks the best weights) and a quarter as many
    write_function tasks, in hash order, leaving out the functions of the generation
    eval's sample (at its default 40 per kind at least) so that the eval is not the
    selection set."""
    from recipe.evaluate import select_tasks

    evaluated = {t.function for t in select_tasks(held_tasks, max(eval_limit, 40))}
    ordered = sorted(
        (t for t in held_tasks if t.function not in evaluated),
        key=lambda t: data.stable_hash(f"{t.function}|{t.kind}|track"),
    )
    wanted = {kind: per_edit_kind for kind in data.EDIT_KINDS}
    wanted["write_function"] = max(1, per_edit_kind // 4)
    picked = {"edit": [], "write_function": []}
    for task in ordered:
        if wanted.get(task.kind, 0) > 0:
            wanted[task.kind] -= 1
            picked["write_function" if task.kind == "write_function" else "edit"].append(task)
    return picked


def tokenizer_texts(train_fns: list, train_tasks: list) -> list[str]:
    """Each function once (not once per task variant) plus every distinct instruction of
    the canonical tasks, and a write_function instruction for every function: the
    tokenizer does not depend on --variants, --augment or --write-function-percent."""
    instructions = {
        t.user.split("\n\n```python", 1)[0]
        for t in train_tasks
        if t.variant == 0 and t.kind != "write_function"
    }
    instructions.update(data.write_function_instruction(f) for f in train_fns)
    return (
        [data.fenced(f.source) for f in train_fns]
        + sorted(instructions)
        + [data.SYSTEM, data.long_system_prompt()]
    )


def tokenize_tasks(tokenizer, tasks: list, max_len: int, chunk: int = 20000):
    from recipe.train import Examples

    prompt_ids, answer_ids = [], []
    for i in range(0, len(tasks), chunk):  # chunks: fewer Python lists alive at once
        part = tasks[i : i + chunk]
        prompts = [tok.render_chat(t.messages()) for t in part]
        answers = [t.answer + tok.EOS_TOKEN for t in part]
        prompt_ids += [np.array(e.ids, dtype=np.int32) for e in tokenizer.encode_batch(prompts)]
        answer_ids += [np.array(e.ids, dtype=np.int32) for e in tokenizer.encode_batch(answers)]
    return Examples.from_pairs(prompt_ids, answer_ids, max_len)


def write_report(out: Path, report: dict) -> None:
    (out / "recipe.json").write_text(json.dumps(report, indent=2) + "\n")


def mlx_available() -> bool:
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: skip evaluation
        return False
    return True


def run_eval(args, held_tasks: list, report: dict) -> None:
    time_left_s = args.total_minutes * 60 - (time.time() - START_S) - 15
    if args.eval_limit <= 0 or time_left_s < 30:
        log("skipping generation eval (disabled or no time left)")
        return
    if not mlx_available():
        log("mlx not importable: skipping generation eval (run python -m recipe.evaluate later)")
        report["eval"] = None
        return
    from recipe.evaluate import evaluate, quality_markdown

    try:
        report["eval"] = evaluate(
            args.out, held_tasks, args.eval_limit, log=log, time_limit_s=time_left_s
        )
        log("held-out quality:\n" + quality_markdown(report["eval"]))
    except Exception as error:  # noqa: BLE001 - the model is already exported; keep it
        log(f"eval failed: {type(error).__name__}: {error}")
        report["eval"] = {"error": f"{type(error).__name__}: {error}"}


def timed(seconds: dict, stage: str, func, *args):
    """func(*args), recording its wall time in seconds[stage]."""
    start = time.time()
    result = func(*args)
    seconds[stage] = round(time.time() - start, 1)
    return result


def tokenizer_stage(args, train_fns: list, train_tasks: list):
    tokenizer = tok.train_tokenizer(tokenizer_texts(train_fns, train_tasks), args.vocab_size)
    tok.save_tokenizer(tokenizer, args.out)
    log(
        f"tokenizer: {tokenizer.get_vocab_size()} tokens, specials {tok.special_token_ids(tokenizer)}"
    )
    return tokenizer


def tokenize_stage(args, tokenizer, train_tasks: list, held_tasks: list, counts: dict, device):
    train_examples = tokenize_tasks(tokenizer, train_tasks, args.max_len)
    held_examples = tokenize_tasks(tokenizer, held_tasks, args.max_len)
    per_kind = args.track_tasks
    if per_kind is None:
        per_kind = 256 if device.type == "cuda" else 32
    tracked = {
        name: tokenize_tasks(tokenizer, tasks, args.max_len)
        for name, tasks in tracked_tasks(held_tasks, per_kind // 4, args.eval_limit).items()
    }
    counts["examples"] = {
        "train": len(train_examples),
        "train_dropped_too_long": len(train_tasks) - len(train_examples),
        "train_tokens": int(train_examples.lengths.sum()),
        "train_answer_tokens": train_examples.target_tokens,
        "held_out": len(held_examples),
        "held_out_tokens": int(held_examples.lengths.sum()),
        "long_system_prompt_tokens": len(tokenizer.encode(data.long_system_prompt()).ids),
        "tracked_held_out": {name: len(ex) for name, ex in tracked.items()},
    }
    log(f"tokens: {counts['examples']}")
    return train_examples, held_examples, tracked


def train_stage(args, tokenizer, train_examples, tracked: dict, device):
    """A fresh model trained within the time left; returns (model, training summary)."""
    from recipe.train import (
        HeldOut,
        Qwen2ForCausalLM,
        StopFlag,
        TrainConfig,
        count_parameters,
        train,
    )

    model = Qwen2ForCausalLM(
        model_config(args, tokenizer.get_vocab_size()),
        dropout=args.dropout,
        attention_dropout=args.attention_dropout,
    )
    pad_id = tok.special_token_ids(tokenizer)[tok.PAD_TOKEN]
    held_out = HeldOut(tracked, pad_id, batch_tokens_for(args, device))
    # Leave time for export and the report within --total-minutes.
    minutes_left = args.total_minutes - (time.time() - START_S) / 60 - 0.75
    train_minutes = max(0.1, min(args.minutes, minutes_left))
    if train_minutes < args.minutes:
        log(f"training budget cut to {train_minutes:.2f} min to finish within --total-minutes")
    config = TrainConfig(
        minutes=train_minutes,
        max_steps=args.max_steps,
        batch_tokens=batch_tokens_for(args, device),
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        device=str(device),
        compile=args.compile,
        log_every_s=args.track_every_s or (10.0 if device.type == "cuda" else 60.0),
        keep_best=args.keep_best == "on",
        router_aux_loss_coef=args.router_aux_loss_coef,
    )
    log(
        f"model: {count_parameters(model):,} parameters, {model.config}, "
        f"dropout {args.dropout}, attention dropout {args.attention_dropout}"
    )
    stop = StopFlag()  # SIGTERM/Ctrl-C end training early; the model is still exported
    stop.install()
    try:
        summary = train(
            model, train_examples, config, pad_id, log=log, stop=stop, held_out=held_out
        )
    finally:
        stop.uninstall()
    best = summary.get("best") or {}
    log(
        f"training done: {summary['steps']} steps, loss {summary['final_loss']:.4f}; best "
        f"held-out loss {best.get('held_out_loss')} at step {best.get('step')}"
    )
    return model, summary


def model_config(args, vocab_size: int):
    """The ModelConfig of the architecture flags (experts only for qwen3_moe)."""
    moe = args.arch == "qwen3_moe"
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate_size,
        rope_theta=args.rope_theta,
        arch=args.arch,
        head_dim=args.head_dim,
        num_experts=args.experts if moe else 0,
        num_experts_per_tok=args.experts_per_token if moe else 0,
        moe_intermediate_size=args.moe_intermediate_size if moe else 0,
    )


def batch_tokens_for(args, device) -> int:
    return args.batch_tokens or (65536 if device.type == "cuda" else 4096)


def export_stage(args, model, tokenizer, held_examples, device) -> dict:
    from recipe.train import count_parameters, evaluate_loss, export_model

    specials = tok.special_token_ids(tokenizer)
    eos_id, pad_id = specials[tok.EOS_TOKEN], specials[tok.PAD_TOKEN]
    weight_bytes = export_model(model, args.out, eos_id, pad_id)
    eval_batches = 20 if device.type == "cuda" else 2  # CPU: a rough figure, quickly
    held_loss = evaluate_loss(
        model, held_examples, pad_id, batch_tokens_for(args, device), eval_batches
    )
    log(f"exported {weight_bytes:,} bytes to {args.out}; held-out answer loss {held_loss:.4f}")
    return {
        "parameters": count_parameters(model),
        "safetensors_bytes": weight_bytes,
        "held_out_answer_loss": round(held_loss, 4),
        "config": model.config.hf_config(eos_id, pad_id, "bfloat16"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    seconds = {}
    log(f"python {platform.python_version()}, {os.cpu_count()} cpus, stdlib {data.stdlib_root()}")
    # Data first: its worker processes are forked before torch starts any threads.
    train_tasks, held_tasks, counts, train_fns = timed(seconds, "data", build_data, args)

    import torch

    from recipe.train import pick_device

    log(f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    tokenizer = timed(seconds, "tokenizer", tokenizer_stage, args, train_fns, train_tasks)
    train_examples, held_examples, tracked = timed(
        seconds,
        "tokenize",
        tokenize_stage,
        *(args, tokenizer, train_tasks, held_tasks, counts, device),
    )
    model, summary = timed(
        seconds, "train", train_stage, args, tokenizer, train_examples, tracked, device
    )
    model_report = timed(
        seconds, "export", export_stage, args, model, tokenizer, held_examples, device
    )
    report = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "counts": counts,
        "model": model_report,
        "training": summary,
        "seconds": seconds,
    }
    write_report(args.out, report)  # before eval: a late failure still leaves the figures
    timed(seconds, "eval", run_eval, args, held_tasks, report)
    seconds["total"] = round(time.time() - START_S, 1)
    write_report(args.out, report)
    log(f"done in {seconds['total']}s: {sorted(p.name for p in args.out.iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
