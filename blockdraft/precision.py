"""`--dtype auto`: the target's precision chosen by measuring this machine.

On a GPU bf16 is the natural choice. On a CPU it depends on the chip: with AMX a bf16 product runs
~6.6x as fast as fp32, with AVX512-BF16 ~2.4x at 128 rows, and without either torch runs bf16
through a slow path (2-3x slower than fp32 on a 2-core AVX2 AMD EPYC at 16 rows). What matters for
speculative decoding is a verify-sized product, so that is what is timed: 16 rows by a square
weight, in bf16 and fp32, once per machine (kept in `$BLOCKDRAFT_HOME/precision.json`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

import torch

from .machine import cpu_flags, machine_key

ROWS, WIDTH = 16, 1024
BF16_WINS_AT = 1.2  # bf16 is chosen when its product is at least this much faster than fp32's


@dataclass(frozen=True)
class Choice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def product_seconds(dtype: torch.dtype, rows: int = ROWS, width: int = WIDTH, runs: int = 7) -> float:
    """Median seconds of a [rows, width] x [width, width] product in `dtype` on the CPU."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    w = torch.randn(width, width, generator=gen).to(dtype)
    with torch.no_grad():
        torch.nn.functional.linear(x, w)
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def bf16_speedup() -> float:
    """How many times as fast a verify-sized bf16 product runs as an fp32 one on this CPU:
    measured once per machine, kept in `$BLOCKDRAFT_HOME/precision.json`."""
    from .models.default import cache_home

    store = cache_home() / "precision.json"
    key = machine_key()
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = round(product_seconds(torch.float32) / product_seconds(torch.bfloat16), 3)
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            tmp = store.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
            tmp.replace(store)
        except OSError:
            pass
    return float(known[key])


def _measured() -> str:
    flags = ", ".join(cpu_flags()) or "none of amx_bf16 / avx512_bf16"
    return f"a {ROWS}-row bf16 product runs {bf16_speedup():.2f}x as fast as fp32 on this CPU (flags: {flags})"


def auto_dtype(device: torch.device) -> Choice:
    """The dtype `auto` picks for a target on `device`, and why: on a CPU bf16 where its product
    beats fp32's by `BF16_WINS_AT`, else fp32."""
    if device.type == "cuda":
        return Choice(torch.bfloat16, "auto: bf16 on CUDA")
    if device.type != "cpu":
        return Choice(torch.float32, f"auto: fp32 on {device.type}")
    if bf16_speedup() >= BF16_WINS_AT:
        return Choice(torch.bfloat16, f"auto: {_measured()}")
    return Choice(torch.float32, f"auto: {_measured()}, under the {BF16_WINS_AT}x that bf16 needs")


def explain(dtype: torch.dtype, device: torch.device) -> str:
    """Why an explicitly chosen dtype runs; on a CPU that runs bf16 / fp16 slowly, with a note
    saying what was measured (the dtype is still used)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or bf16_speedup() >= 1.0:
        return "chosen"
    return f"chosen; note: {_measured()}"
