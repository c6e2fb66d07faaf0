import os
import sys
from pathlib import Path

# Float32 exactness means float32: MLX's CUDA backend runs float32 matmuls as TF32
# (10-bit mantissa) unless told otherwise, so two passes of different shapes could
# part at a near-tie (bench/batch_pld_margin.py). Set before anything imports MLX;
# no effect on the CPU.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(arch, **kw) -> path of a tiny random model, built once per session."""
    built = {}

    def make(arch: str, **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in built:
            name = arch + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
            built[key] = tiny.build_model(arch, tmp_path_factory.mktemp(name), **kw)
        return built[key]

    return make
