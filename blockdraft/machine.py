"""Facts about the machine this process runs on, read once: the CPU's name and its bf16
instruction sets, and the key under which per-machine measurements are kept (the exact kernels,
the dtype `auto` picks). A leaf module: it imports nothing of blockdraft's."""

from __future__ import annotations

import functools
import platform

import torch


@functools.cache
def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(name)), None)
    except OSError:
        return None


def cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` says."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The bf16-related instruction sets the CPU reports (Linux), e.g. ['amx_bf16', 'avx512_bf16']."""
    flags = (_cpuinfo_field("flags") or "").split()
    return sorted({f for f in flags if f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f")})


def machine_key() -> str:
    """What a kernel's arithmetic and speed depend on besides its inputs: torch, the CPU and its threads."""
    return f"torch {torch.__version__} | {cpu_name()} | {torch.get_num_threads()} threads"
