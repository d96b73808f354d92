"""The repetition table of docs/benchmarks.md from one `blockdraft bench` run.

    .venv/bin/python benchmarks/repetition_table.py bench-results/cpu-amd-eq-20261205 --doc docs/benchmarks.md

Per dataset and method: output tokens, the share that repeats (runs of 16 tokens seen earlier in
the same answer), τ and τ over the verify steps that commit no repeated token
(`blockdraft.bench.repetition`, recomputed from the run's results.json files). With --doc the
table replaces what stands between the `<!-- repetition -->` markers; without it, it is printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import doctable  # noqa: E402

from blockdraft.bench.repetition import table  # noqa: E402

if __name__ == "__main__":
    sys.exit(doctable.main(__doc__, "repetition", lambda a: table(a.run), run=(None, "a bench --out folder")))
