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

from batchgen import attention
from batchgen.cli import main

spec = importlib.util.spec_from_file_location("batchgen.attention_baseline", sys.argv[1])
baseline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(baseline)
for name in ("fused_step_attention", "batch_step_attention", "batch_decode_attention"):
    setattr(attention, name, getattr(baseline, name))
sys.argv = ["batchgen"] + sys.argv[2:]
main()
