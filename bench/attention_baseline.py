"""batchgen's CLI with another version of `batchgen/attention.py`'s batch attention
(its `fused_step_attention`, `batch_step_attention` and `batch_decode_attention`) in
place of the shipped one, for side-by-side runs of a kernel change:

    git show REV:batchgen/attention.py > /tmp/attention_rev.py
    python bench/attention_baseline.py /tmp/attention_rev.py bench jobs/freeform.jsonl --shape qwen2.5-7b ...

    python bench/attention_baseline.py --turboquant-batch /tmp/turboquant_batch_rev.py bench ...

(the second: TurboQuant rows' step kernel, `turboquant_batch.STEP_SOURCE` and
`STEP_HEADER`, from that file). The file is loaded as a module of the batchgen
package (its relative imports work). Both versions' kernels may share names:
`attention.launch` keeps a kernel per source, and MLX compiles each anew.

Compare in one machine, and mind the order: MLX keeps the PTX of what it
compiles on disk (MLX_PTX_CACHE_DIR, by default under /tmp) for later
processes, so a machine's first run pays compilation that later runs skip
(H200: the first side run was 30% slower in a 64-job run). Alternate the
sides after a run that compiles both (`bench/h200.sh` stages attnab, tqab).
"""

import importlib.util
import sys
from pathlib import Path

from batchgen.kernels import attention

ENTRY_POINTS = ("fused_step_attention", "batch_step_attention", "batch_decode_attention")
TURBOQUANT_BATCH_KERNEL = ("STEP_SOURCE", "STEP_HEADER")  # turboquant_batch's step kernel


def load_baseline(path: Path, names: tuple = ENTRY_POINTS) -> dict:
    """`names` of the baseline file (by default its batch attention entry
    points), loaded as a module of the batchgen package."""
    spec = importlib.util.spec_from_file_location(f"batchgen.baseline_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return {name: getattr(module, name) for name in names}


if __name__ == "__main__":
    from batchgen.cache import turboquant_rows as turboquant_batch
    from batchgen.cli import main

    target, names, args = attention, ENTRY_POINTS, sys.argv[1:]
    if args[0] == "--turboquant-batch":  # FILE is a turboquant_batch.py: its step kernel's source
        target, names, args = turboquant_batch, TURBOQUANT_BATCH_KERNEL, args[1:]
    for name, value in load_baseline(Path(args[0]), names).items():
        setattr(target, name, value)
    sys.argv = ["batchgen"] + args[1:]
    main()
