"""mlx-lm's first import, without torch.

mlx-lm loads tokenizers through transformers, and transformers imports torch wherever
torch is installed (and through torch-only modules scikit-learn and sympy), although a
tokenizer needs none of it, and on the H200 machine it was most of a tiny model's load
(bench/RESULTS.md#load-time). A `batchgen run` from cron pays that every process.

So while mlx-lm is first imported, torch is hidden: `sys.modules["torch"] = None` makes
`importlib.util.find_spec("torch")` answer None, which transformers reads as "not
installed" and then runs tokenizer-only, its answer cached for the process. Afterwards
torch imports again as usual. `BATCHGEN_IMPORT_TORCH=1` leaves it visible (a process that
wants transformers' torch side, e.g. a peer measured in the same process).
"""

from __future__ import annotations

import os
import sys
import time

HIDDEN = ("torch",)


def import_mlx_lm() -> float:
    """Import mlx_lm (with transformers) if not yet imported, torch hidden from it;
    returns the seconds it took (0 when it was already imported)."""
    if "mlx_lm" in sys.modules:
        return 0.0
    start = time.perf_counter()
    hide = [] if os.environ.get("BATCHGEN_IMPORT_TORCH") == "1" else [m for m in HIDDEN if m not in sys.modules]
    for name in hide:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        import mlx_lm  # noqa: F401
    finally:
        for name in hide:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    return time.perf_counter() - start
