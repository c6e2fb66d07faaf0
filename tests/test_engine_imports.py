"""engine/imports.py: mlx-lm's first import hides torch from transformers, whose
tokenizers never need it (a torch install costs every process seconds otherwise).

Each case runs in a fresh interpreter beside a stand-in `torch` package (a module and
its dist-info, version 2.9.0) that marks being imported."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, code: str, **env) -> list[str]:
    site = tmp_path / "site"
    if not site.exists():
        (site / "torch").mkdir(parents=True)
        (site / "torch" / "__init__.py").write_text("STAND_IN = 'imported'\n")
        meta = site / "torch-2.9.0.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0\n")
    base = {k: v for k, v in os.environ.items() if k != "BATCHGEN_IMPORT_TORCH"}
    full_env = {**base, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), **env}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_transformers_runs_without_torch_and_torch_still_imports_after(tmp_path):
    code = """
import sys
from batchgen.engine.imports import import_mlx_lm
seconds = import_mlx_lm()
from transformers.utils import is_torch_available
from mlx_lm import load
from batchgen.config import DEMO_MODEL_DIR
_, tok = load(str(DEMO_MODEL_DIR))
text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
print(is_torch_available(), "torch" in sys.modules, seconds > 0, "hi" in text, import_mlx_lm())
import torch
print(torch.STAND_IN)
"""
    # transformers saw no torch and did not import it; the tokenizer works; a second
    # call does nothing; torch imports afterwards (the stand-in's marker).
    assert _run(tmp_path, code) == ["False", "False", "True", "True", "0.0", "imported"]


def test_transformers_sees_the_stand_in_when_nothing_hides_it(tmp_path):
    # The case above would pass without the hiding if transformers ignored the stand-in.
    code = "from transformers.utils import is_torch_available; print(is_torch_available())"
    assert _run(tmp_path, code) == ["True"]


def test_batchgen_import_torch_leaves_it_visible(tmp_path):
    # A stand-in mlx_lm reports what its import sees: None is torch hidden.
    fake = tmp_path / "fake"
    (fake / "mlx_lm").mkdir(parents=True)
    (fake / "mlx_lm" / "__init__.py").write_text("import sys\nprint(repr(sys.modules.get('torch', 'absent')))\n")
    code = f"""
import sys
sys.path.insert(0, {str(fake)!r})
from batchgen.engine.imports import import_mlx_lm
import_mlx_lm()
print("torch" in sys.modules)
"""
    assert _run(tmp_path, code) == ["None", "False"]
    assert _run(tmp_path, code, BATCHGEN_IMPORT_TORCH="1") == ["'absent'", "False"]
