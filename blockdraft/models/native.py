"""blockdraft's own bf16 product for CPUs with AVX512-BF16 (`native_linear.cpp`), built once per
machine on first use and kept under `$BLOCKDRAFT_HOME/native/`.

Why: a decode step multiplies every weight by one row, so it should run at the speed memory
delivers the weights. oneDNN's one-row bf16 product runs at about half that on a 2-core AMD
EPYC, and MKL's has no bf16 path. This kernel streams each weight once per four input rows with
`vdpbf16ps` and is row-independent by construction (see the source), so `models.exact` can use it
for the plain step and the verify pass alike. It is offered only where the CPU reports
avx512_bf16, a C++ compiler and ninja exist, and `BLOCKDRAFT_NATIVE` is not 0; a failed build
warns once and leaves the other kernels.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = [HERE / n for n in ("native_linear.cpp", "native_step.cpp", "native_hybrid.cpp", "native_draft.cpp")]
HEADER = HERE / "native.h"
# -fopenmp: at::parallel_for is OpenMP in torch's CPU builds, inlined from its headers, and runs on one
# thread without it (the libgomp.so.1 torch already loaded serves the extension too)
FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"]


def supported() -> bool:
    """Whether this machine can build and run the kernel (without building it)."""
    from ..machine import cpu_flags

    if os.environ.get("BLOCKDRAFT_NATIVE", "1") == "0":
        return False
    if "avx512_bf16" not in cpu_flags():
        return False
    from torch.utils import cpp_extension

    here = os.path.dirname(sys.executable)  # the virtualenv's bin: where pip's ninja lives, maybe not on PATH
    if shutil.which("ninja") is None and os.path.exists(os.path.join(here, "ninja")):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    return shutil.which(os.environ.get("CXX", "c++")) is not None and cpp_extension.is_ninja_available()


def build_tag(files) -> str:
    """The build folder's name: the sources' bytes, the flags, torch's version and the sources'
    folder (torch's build files name the sources by path: two checkouts sharing `$BLOCKDRAFT_HOME`
    with one folder rebuilt it for each other, and waited on each other's build lock)."""
    code = b"".join(p.read_bytes() for p in files)
    where = str(Path(files[0]).resolve().parent).encode()
    return hashlib.sha256(code + " ".join(FLAGS).encode() + torch.__version__.encode() + where).hexdigest()[:12]


@functools.cache
def module():
    """The built extension, or None (not supported here, or the build failed: one warning)."""
    if not supported():
        return None
    from torch.utils import cpp_extension

    from .default import cache_home

    tag = build_tag([*SOURCES, HEADER])
    folder = cache_home() / "native" / tag
    folder.mkdir(parents=True, exist_ok=True)
    fresh = not any(folder.glob("*.so"))
    if fresh:
        print(
            "blockdraft: building the native bf16 product kernel (once per machine, about a minute)...",
            file=sys.stderr,
            flush=True,
        )
    t0 = time.perf_counter()
    try:
        mod = cpp_extension.load(
            name=f"blockdraft_native_{tag}",
            sources=[str(p) for p in SOURCES],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as exc:  # a compiler or toolchain problem: the other kernels still run
        warnings.warn(
            "the native bf16 kernel did not build "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "using torch's kernels",
            stacklevel=2,
        )
        return None
    if fresh:
        print(f"blockdraft: native kernel built in {time.perf_counter() - t0:.0f} s ({folder})", file=sys.stderr)
    return mod


def available() -> bool:
    """Whether the kernel is built (or builds now) and runs here."""
    return module() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] in the layout the packed products read in address order: panels of 32
    outputs, [ceil(N/32), ceil(K/2), 32, 2] (pairs of inputs innermost), zero-padded
    (`native_linear.cpp`, `product_packed`)."""
    n, k = weight.shape
    w = torch.nn.functional.pad(weight.detach(), (0, k % 2, 0, -n % 32))
    return w.view(w.shape[0] // 32, 32, w.shape[1] // 2, 2).transpose(1, 2).contiguous()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` (the first of tied maxima, a NaN counted as the maximum), 4-10x faster on CPU
    bf16 / fp32 logits where the native kernels run (torch's bf16 argmax over a 49,152-token
    vocabulary: ~90 us a row on a 2-core AMD EPYC)."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or x.dim() == 0 or not available():
        return x.argmax(-1)
    flat = x.reshape(-1, x.shape[-1])
    out = module().argmax_rows(flat)
    bad = out < 0
    if bool(bad.any()):  # rows holding a NaN: torch's answer
        out[bad] = flat[bad].argmax(-1)
    return out.view(x.shape[:-1])


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probabilities) of each row's k likeliest tokens, as `log_softmax(-1).topk(k)` gives
    them, for CPU bf16 logits [..., V] where the native kernels run (equal logits: the lower id
    first); one pass over each row, no fp32 copy of the logits, no log-probabilities of the rest
    (a training step's soft labels: ~4x faster than torch's on a 2-core AMD EPYC). Elsewhere, and
    for rows holding a NaN or an infinity, torch's."""
    k = min(k, logits.shape[-1])
    if logits.device.type != "cpu" or logits.dtype != torch.bfloat16 or not available() or not logits.numel():
        logp, ids = logits.float().log_softmax(-1).topk(k, dim=-1)
        return ids, logp
    flat = logits.reshape(-1, logits.shape[-1])
    ids, logp = module().top_logprobs(flat, k)
    bad = ids[:, 0] < 0
    if bool(bad.any()):
        logp[bad], ids[bad] = flat[bad].float().log_softmax(-1).topk(k, dim=-1)
    return ids.view(*logits.shape[:-1], k), logp.view(*logits.shape[:-1], k)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, K] @ weight[N, K].T (+ bias), bf16, row-independent."""
    return module().linear_bf16(x, weight, bias)


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x [R, K] @ weight.T (+ bias) from a weight of n rows packed by `pack`: row-independent, its
    own order of sums (not `linear`'s: one weight runs through one of the two)."""
    return module().linear_packed(x.contiguous(), packed, bias, n)
