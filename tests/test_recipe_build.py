"""The build's pure helpers: training subsample, tracked held-out subset, tokenizer texts."""

from __future__ import annotations

from collections import Counter

import pytest

from recipe import build, data
from recipe.evaluate import select_tasks
from recipe.model_config import ModelConfig

SOURCE = (
    "def area(width, height, scale=1):\n"
    '    """Return the scaled area."""\n'
    "    w = width * scale  # scaled\n"
    "    return w * height"
)


def functions(count: int) -> list[data.Function]:
    return [
        data.Function(f"m{i % 7}.py", f"m{i % 7}", f"area{i}", SOURCE.replace("area", f"area{i}"))
        for i in range(count)
    ]


def test_subsample_is_a_fixed_subset_in_order():
    fns = functions(50)
    picked = build.subsample(fns, 10)
    assert len(picked) == 10 and picked == build.subsample(fns, 10)
    assert [fns.index(f) for f in picked] == sorted(fns.index(f) for f in picked)
    assert set(build.subsample(fns, 20)) > set(picked)  # a larger limit extends it
    assert build.subsample(fns, 0) == fns and build.subsample(fns, 99) == fns


def test_tracked_tasks_are_balanced_and_leave_out_the_eval_sample():
    held = data.build_tasks(functions(120), processes=1)
    tracked = build.tracked_tasks(held, per_edit_kind=5, eval_limit=20)
    kinds = Counter(t.kind for t in tracked["edit"])
    assert kinds == {kind: 5 for kind in data.EDIT_KINDS}
    assert [t.kind for t in tracked["write_function"]] == ["write_function"]
    evaluated = {t.function for t in select_tasks(held, 40)}  # at least the default 40
    assert not evaluated & {t.function for ts in tracked.values() for t in ts}
    assert tracked == build.tracked_tasks(held, per_edit_kind=5, eval_limit=20)


def test_tokenizer_texts_do_not_depend_on_variants_or_the_data_mix():
    fns = functions(12)
    pools = data.harvest_pools(fns, processes=1)
    plain = data.build_tasks(fns, variants=3, processes=1)
    mixed = data.build_tasks(fns, 6, processes=1, pools=pools, write_function_percent=25)
    assert len(mixed) > len(plain)
    assert build.tokenizer_texts(fns, plain) == build.tokenizer_texts(fns, mixed)


def test_architecture_flags_default_to_the_shipped_model():
    args = build.parse_args(["--out", "x"])
    assert build.model_config(args, 4096) == ModelConfig()
    assert args.arch == "qwen2" and args.head_dim is None


def test_architecture_flags_make_the_model_config():
    flags = "--arch qwen3_moe --hidden-size 256 --layers 6 --heads 4 --kv-heads 2 --head-dim 64"
    flags += " --experts 8 --experts-per-token 2 --moe-intermediate-size 128 --rope-theta 1e6"
    config = build.model_config(build.parse_args(["--out", "x", *flags.split()]), 4096)
    assert (config.arch, config.num_hidden_layers, config.head_dim) == ("qwen3_moe", 6, 64)
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert config.moe_intermediate_size == 128 and config.rope_theta == 1e6
    # The expert flags belong to qwen3_moe only: other archs get no experts.
    dense = build.parse_args(["--out", "x", "--arch", "llama", "--head-dim", "128"])
    assert build.model_config(dense, 4096).num_experts == 0


def test_architecture_flags_mlx_lm_cannot_load_are_refused(capsys):
    with pytest.raises(SystemExit):
        build.parse_args(["--out", "x", "--head-dim", "64"])  # qwen2, 8 heads of 256
    assert "head_dim" in capsys.readouterr().err
