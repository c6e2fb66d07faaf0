import os
import sys
import tempfile
from pathlib import Path

# Float32 exactness means float32: MLX's CUDA backend runs float32 matmuls as TF32
# (10-bit mantissa) unless told otherwise, so two passes of different shapes could
# part at a near-tie (bench/RESULTS.md#float32-on-cuda). Set before anything imports MLX;
# no effect on the CPU.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# On a CUDA machine, kernels build as in a run, kept in a build folder (kernels/builds.py
# writes batchgen's own there): one of this session's, so the kernel tests run builds made
# now, not ones an earlier version left. No effect on the CPU.
os.environ.setdefault("MLX_PTX_CACHE_DIR", tempfile.mkdtemp(prefix="batchgen-test-kernels-"))
os.environ.setdefault("BATCHGEN_KERNEL_BUILDS", "1")

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


MATRIX_AXES = ("arch", "dtype")


def pytest_collection_modifyitems(config, items):
    """Two rules that keep the default suite fast and honest:

    - `cuda` tests need MLX's CUDA backend: skipped elsewhere (`pytest -m cuda`
      runs them on a GPU machine);
    - a matrix over model architectures or dtypes (a test parametrized by `arch`
      or `dtype`) runs its first value by default and the others under `slow`,
      so every test still runs in the fast suite and the whole matrix in `.ci/run`.
    """
    from batchgen.kernels.registry import available

    no_cuda = pytest.mark.skip(reason="needs MLX with a CUDA GPU")
    has_cuda = available()
    first_value: dict = {}
    for item in items:
        if item.get_closest_marker("cuda") is not None and not has_cuda:
            item.add_marker(no_cuda)
        params = getattr(getattr(item, "callspec", None), "params", {})
        for axis in MATRIX_AXES:
            if axis in params:
                key = (item.module.__name__, item.originalname, axis)
                if first_value.setdefault(key, params[axis]) != params[axis]:
                    item.add_marker(pytest.mark.slow)
