"""What a batched decode step dispatches, and what each kind of op costs in it.

    python bench/step_ops_probe.py --shape qwen2.5-0.5b --rows 8 --out r.json

A compiled batch step of a small model is host-bound: its time follows the
number of primitives MLX evaluates, not their work. This counts the primitives
of one compiled step (by kind, from `mx.export_to_dot`) through the model's own
layers and through `batchgen.step_forward`, times both, and times the former
with one kind of layer taken out (timing only, the outputs are wrong): RoPE,
the RMS norms, the MLP (`--kinds`). What a layer kind costs a step is what
taking it out saves.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).parent))

from batch_step import _compiled_steps, _filled, step_model  # noqa: E402

from batchgen.step.compiled import CompiledSteps  # noqa: E402
from batchgen.kernels.turboquant import available as cuda_available  # noqa: E402


class _Skip(nn.Module):
    """Stands in for a layer: returns its input (RoPE's offset and the like ignored)."""

    def __call__(self, x, *args, **kwargs):
        return x


def primitives(model, rows: int, context: int, own_forward: bool) -> dict:
    """Primitives of one compiled step (the second: the first's window is new), by kind."""
    cache = _filled(model, rows, context, True, True)
    stepper = CompiledSteps(model, cuda_available(), {}, own_forward)
    mx.eval(stepper(cache, mx.zeros((rows,), mx.uint32), sample=False)[0], stepper.keys, stepper.values)
    tokens, _ = stepper(cache, mx.zeros((rows,), mx.uint32), sample=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), tokens, *stepper.keys, *stepper.values)
        labels = re.findall(r'label ="([^"]+)"', path.read_text())
    return dict(collections.Counter(labels).most_common())


def _take_out(model, kind: str) -> None:
    """Take `kind` out of every layer of `model` (in place)."""
    for layer in model.layers:
        if kind in ("rope", "all"):
            layer.self_attn.rope = _Skip()
        if kind in ("norm", "all"):
            layer.input_layernorm = _Skip()
            layer.post_attention_layernorm = _Skip()
        if kind in ("mlp", "all"):
            layer.mlp = _Skip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--kinds", default="", help="e.g. rope,norm,mlp,all")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model, _ = step_model(a.shape)
    result = {"shape": a.shape, "rows": a.rows, "layers": len(model.layers), "device": str(mx.default_device())}
    cache = _filled(model, a.rows, a.context, True, True)
    for own, name in ((False, "model_layers"), (True, "step_forward")):
        counts = primitives(model, a.rows, a.context, own)
        result[f"{name}_primitives"] = sum(counts.values())
        result[f"{name}_by_kind"] = counts
        result[f"{name}_ms"] = round(_compiled_steps(model, cache, a.rows, a.steps, own_forward=own), 3)
        print(name, result[f"{name}_primitives"], result[f"{name}_ms"], json.dumps(counts), flush=True)
    saved = {}
    for kind in filter(None, a.kinds.split(",")):
        parts = [(layer.self_attn.rope, layer.input_layernorm, layer.post_attention_layernorm, layer.mlp)
                 for layer in model.layers]  # fmt: skip
        _take_out(model, kind)
        result[f"without_{kind}_ms"] = round(_compiled_steps(model, cache, a.rows, a.steps, own_forward=False), 3)
        result[f"without_{kind}_primitives"] = sum(primitives(model, a.rows, a.context, False).values())
        for layer, (rope, n1, n2, mlp) in zip(model.layers, parts):
            layer.self_attn.rope, layer.input_layernorm, layer.post_attention_layernorm, layer.mlp = rope, n1, n2, mlp
        saved[kind] = round(result["model_layers_ms"] - result[f"without_{kind}_ms"], 3)
    result["model_layers_again_ms"] = round(_compiled_steps(model, cache, a.rows, a.steps, own_forward=False), 3)
    result["step_forward_again_ms"] = round(_compiled_steps(model, cache, a.rows, a.steps), 3)
    result["saved_ms"] = saved
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("by_kind")}), flush=True)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
