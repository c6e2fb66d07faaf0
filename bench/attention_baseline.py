"""batchgen's CLI with another version of `batchgen/attention.py`'s batch attention
(its `fused_step_attention`, `batch_step_attention` and `batch_decode_attention`) in
place of the shipped one, for side-by-side runs of a kernel change:

    git show REV:batchgen/attention.py > /tmp/attention_rev.py
    python bench/attention_baseline.py /tmp/attention_rev.py bench jobs/freeform.jsonl --shape qwen2.5-7b ...

The file is loaded as a module of the batchgen package (its relative imports work);
give its kernels names of their own if the shipped ones share them.
"""

import importlib.util
import sys
from pathlib import Path

from batchgen import attention

ENTRY_POINTS = ("fused_step_attention", "batch_step_attention", "batch_decode_attention")


def load_baseline(path: Path) -> dict:
    """The baseline file's batch attention entry points, by name."""
    spec = importlib.util.spec_from_file_location("batchgen.attention_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: getattr(module, name) for name in ENTRY_POINTS}


if __name__ == "__main__":
    from batchgen.cli import main

    for name, fn in load_baseline(Path(sys.argv[1])).items():
        setattr(attention, name, fn)
    sys.argv = ["batchgen"] + sys.argv[2:]
    main()
