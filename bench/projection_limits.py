"""batchgen's CLI with the few-row projection kernel's limits set first, for
side-by-side runs (`batchgen.projection`'s MAX_ROWS and MAX_WEIGHT_BYTES):

    python bench/projection_limits.py MAX_ROWS MAX_MB bench jobs/edits.jsonl --shape qwen2.5-0.5b ...

`0 0` runs every projection through MLX's matmul.
"""

import sys

from batchgen import projection

projection.MAX_ROWS = int(sys.argv[1])
projection.MAX_WEIGHT_BYTES = int(float(sys.argv[2]) * (1 << 20))
sys.argv = ["batchgen"] + sys.argv[3:]
from batchgen.cli import main  # noqa: E402

main()
