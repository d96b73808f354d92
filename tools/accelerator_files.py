"""`accelerator_job.py`'s transfer: results packed in parts of at most 15 MB, earlier results set aside."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path
import accelerator_common as A  # noqa: E402


def pack(work: Path, out: Path, budget: int = 60 * 2**20):
    """Everything worth keeping as files of at most PART bytes: first the logs and the drafter,
    then the data; what does not fit in `budget` stays in work/ship (a second call fetches it)."""
    ship = work / "ship"
    shutil.rmtree(ship, ignore_errors=True)
    ship.mkdir(parents=True)

    def split(name: str, blob: bytes):
        for i in range(0, max(1, len(blob)), A.PART):
            (ship / f"{name}.part{i // A.PART:02d}").write_bytes(blob[i : i + A.PART])

    run = work / "train"
    if (run / "drafter").is_dir():
        import torch
        from safetensors.torch import load_file

        from blockdraft.checkpoint import write_model_folder

        half = work / "drafter-fp16"  # the drafter's folder with fp16 weights (half the bytes)
        write_model_folder(
            half,
            json.loads((run / "drafter" / "config.json").read_text()),
            load_file(str(run / "drafter" / "model.safetensors")),
            dtype=torch.float16,
        )
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(half, arcname="drafter")
            for name in ("metrics.jsonl", "blocks.json"):
                if (run / name).exists():
                    tar.add(run / name, arcname=name)
        split("drafter.tar", buf.getvalue())
    for what, folder in (("prompts", work / "prompts"), ("answers", work / "regen")):
        if folder.is_dir():
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:  # the shards are gzip files already
                tar.add(folder, arcname=what)
            split(f"data-{what}.tar", buf.getvalue())
    used = 0
    for f in sorted(ship.iterdir(), key=lambda p: (not p.name.startswith("drafter"), p.name)):
        if used + f.stat().st_size > budget:
            A.log(f"pack: {f.name} stays in {ship} (fetch it with a second call)")
            continue
        shutil.copy(f, out / f.name)
        used += f.stat().st_size
    A.log(f"pack: {used / 2**20:.1f} MB in {out}: {sorted(p.name for p in out.iterdir())}")


def set_aside(work: Path, name: str) -> Path:
    """Moves an earlier run's folder WORK/train to WORK/NAME (replacing what was there): left in
    place, its drafter would be packed as the next run's. Returns WORK/NAME."""
    earlier, aside = work / "train", work / name
    if earlier.exists():
        shutil.rmtree(aside, ignore_errors=True)
        earlier.rename(aside)
    return aside
