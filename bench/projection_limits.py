"""batchgen's CLI with the few-row projection kernel's limits set first, for
side-by-side runs (`batchgen.projection`'s MAX_ROWS and MAX_WEIGHT_BYTES):

    python bench/projection_limits.py MAX_ROWS MAX_MB bench jobs/edits.jsonl --shape qwen2.5-0.5b ...

`0 0` runs every projection through MLX's matmul.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from projection_probe import limits  # noqa: E402

from batchgen.cli import main  # noqa: E402

max_rows, max_bytes = int(sys.argv[1]), int(float(sys.argv[2]) * (1 << 20))
sys.argv = ["batchgen"] + sys.argv[3:]
with limits(max_rows, max_bytes):
    main()
