"""What every stage of `accelerator_job.py` shares: the committed folders it reads, the log, a stage
that never costs the rest, a step profiler. Importing it puts the repository on sys.path."""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


COMMITTED_ANSWERS = [
    "data/regen/smollm2-135m-instruct",
    "data/regen/smollm2-135m-instruct-synth",
    "data/regen/smollm2-135m-instruct-t07",
    "data/regen/smollm2-135m-instruct-t08",
    "data/regen/smollm2-135m-instruct-t10",
    "data/regen/smollm2-135m-instruct-sampled",
]


PROMPTS = "data/prompts/smollm2-135m-instruct"


NEW_ANSWERS = "smollm2-135m-instruct-sampled"  # the folder under data/regen the new answers go to


PART = 15 * 2**20


MIN_RATE = 3000


T0 = time.time()


def log(msg: str):
    print(f"[{time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def stage(name: str, fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception:  # one stage failing leaves the others (and what it wrote) to come back
        log(f"{name} FAILED:\n{traceback.format_exc()}")
        return None


def profile_tables(prof, rows: int, *sort_keys: str) -> str:
    """A finished torch profile's ops, one table per sort key (the log's profiles)."""
    avg = prof.key_averages()
    return "".join(avg.table(sort_by=key, row_limit=rows, max_name_column_width=50) for key in sort_keys)


class StepProfiler:
    """Where `steps` decode steps' time goes on the device, once, `start_after` seconds into the
    answers (2,048 rows ran at 2.3 steps/s on an H200 in the second lease, far below the model's
    cost: the next lease reads why from this table)."""

    def __init__(self, start_after: float, steps: int):
        self.start_after, self.steps, self.prof, self.left, self.t = start_after, steps, None, steps, 0.0

    def tick(self, seconds: float):
        import torch

        if not torch.cuda.is_available() or self.left <= 0 or seconds < self.start_after:
            return
        from torch.profiler import ProfilerActivity, profile

        if self.prof is None:
            self.prof, self.t = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]), time.time()
            self.prof.__enter__()
            return
        self.left -= 1
        if self.left == 0:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            log(
                f"answers: profile of {self.steps} steps, {time.time() - self.t:.2f}s wall\n"
                + profile_tables(self.prof, 12, "self_device_time_total", "self_cpu_time_total")
            )


def use_fingerprints(path: Path):
    """The evaluation prompts' fingerprints from a file (their packages are not installed there)."""
    import blockdraft.datasets
    import blockdraft.train.data
    import blockdraft.train.prompts

    fps = json.loads(Path(path).read_text())
    for module in (blockdraft.datasets, blockdraft.train.data, blockdraft.train.prompts):
        if hasattr(module, "eval_fingerprints"):
            module.eval_fingerprints = lambda: fps
