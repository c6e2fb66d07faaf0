"""transformers' continuous batching (`generate_batch`) over a batchgen job file: the
peer row beside a whole-file `batchgen run`, on the same model folder and prompts.

    python3 bench/peer_transformers.py JOBS --model DIR|SHAPE [--max-tokens 128] [--attn paged|sdpa]
                                       [--repeats 2] [--out F]

--model takes a model folder, or a shape name (`batchgen.config.SHAPES`, e.g. qwen2.5-7b):
random weights of that config, built on the GPU, with the demo model's tokenizer, as
`batchgen bench --shape` and `bench/shape_model.py` make them (the seeds differ; a
random model's speed does not depend on its values). Each job's messages (the file's
system prompt included, as batchgen reads them) go through the model's chat template
with the generation prompt, greedy, `--max-tokens` new tokens at most, the tokenizer's
end token stopping a job as it stops batchgen's.
Reports output tok/s over `generate_batch`'s wall time, load left out as batchgen's
"less load" figures leave it out; the first repeat pays transformers' own warm-up.
Needs torch and transformers >= 5 (the H200 machine has both), not batchgen's deps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the batchgen of the tree this script is in

from batchgen.config import DEMO_MODEL_DIR, SHAPE_COMMON, SHAPES  # noqa: E402
from batchgen.jobs import Job, iter_jobs, scan_jobs  # noqa: E402


def job_messages(jobs: Path, max_tokens: int) -> list[tuple]:
    """Each valid job's chat messages, in file order (completion-format jobs have none
    and are skipped: the peer row is for chat files)."""
    report, defaults = scan_jobs(jobs, max_tokens, None)
    items = iter_jobs(jobs, defaults, report.format, report.header_line)
    return [j.messages for j in items if isinstance(j, Job) and j.messages]


def outputs_tokens(results: dict) -> list[int]:
    """Generated tokens a request (transformers' `GenerationOutput.generated_tokens`).
    A result without them, a request that failed (its `error`), or a run where no
    request generated a token is an error, not a count of 0: generate_batch logs a
    failed step and returns the requests empty."""
    counts = []
    for r in results.values():
        tokens = getattr(r, "generated_tokens", None)
        if tokens is None:
            raise TypeError(f"a generate_batch result without generated_tokens: {type(r).__name__} {r!r:.200}")
        if getattr(r, "error", None):
            raise RuntimeError(f"a generate_batch request failed: {r.error!s:.300}")
        counts.append(len(tokens))
    if counts and not any(counts):
        raise RuntimeError(f"generate_batch returned {len(counts)} requests and no generated token")
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("jobs", type=Path)
    p.add_argument("--model", required=True, help="a model folder or a shape name")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--attn", default="paged|sdpa", help="attn_implementation (paged|sdpa, paged|flash_attention_2, ...)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation import GenerationConfig

    t0 = time.perf_counter()
    shape = args.model in SHAPES
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR if shape else args.model)
    prompts = [tok.encode(tok.apply_chat_template(list(m), add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for m in job_messages(args.jobs, args.max_tokens)]  # fmt: skip
    if shape:
        config = transformers.AutoConfig.for_model(**{**SHAPE_COMMON, **SHAPES[args.model]})
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=args.attn)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map="cuda",
                                                     attn_implementation=args.attn)  # fmt: skip
    model.eval()
    load_s = time.perf_counter() - t0
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    generation = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                                  pad_token_id=pad)  # fmt: skip
    runs = []
    for i in range(args.repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        # No torch.inference_mode() here: generate_batch runs its steps on a thread of its own and updates
        # its static input tensors in place, which tensors made under inference mode refuse.
        results = model.generate_batch(inputs=prompts, generation_config=generation, progress_bar=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        n = outputs_tokens(results)
        runs.append({"repeat": i, "wall_s": round(wall, 3), "requests": len(n), "completion_tokens": sum(n),
                     "tok_s": round(sum(n) / wall, 1)})  # fmt: skip
        print(json.dumps(runs[-1]), flush=True)
    row = {"peer": "transformers generate_batch", "transformers": transformers.__version__, "torch": torch.__version__,
           "attn_implementation": args.attn, "model": args.model, "jobs": len(prompts),
           "prompt_tokens": sum(map(len, prompts)), "max_tokens": args.max_tokens, "load_s": round(load_s, 2),
           "device": torch.cuda.get_device_name(), "runs": runs}  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=2) + "\n")
    print(f"peer {args.attn}: " + ", ".join(f"{r['tok_s']} tok/s ({r['completion_tokens']} tokens, {r['wall_s']} s)"
                                            for r in runs))  # fmt: skip


if __name__ == "__main__":
    main()
