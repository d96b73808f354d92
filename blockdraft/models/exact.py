"""Exact speculation in every dtype: a token verified in a block gets, bit for bit, the logits it
gets decoded alone.

Speculative decoding is lossless only if the target's verify pass (a block of W tokens, or W
tokens of each of B rows) computes for every position what the plain one-token step computes
there. Floating-point sums depend on their order, and a kernel may order a product's sum by how
many rows it multiplies (MKL's sgemm takes another path for 1, 2-3 and 4+ rows on an AMD EPYC;
oneDNN's AMX kernels block rows in tiles). In fp32 such a last-bit difference rarely changes a
token; with bf16 activations one flipped rounding grows into another token (measured: 5 of 12
chat prompts differed within 48 greedy tokens on a 2-core AMD EPYC, prompt lookup included).

`make_exact(model)` makes every step row-independent:
- products: each linear layer (the LM head included) runs through ONE kernel for every row count,
  chosen per (weight shape, dtype) among those this machine computes row-independently (in bf16 on a
  CPU with AVX512-BF16 also blockdraft's own, `models.native`, built on first use), the fastest of
  them at 1 + 4 rows (a plain step and a verify of the shipped block), checked
  here on random data (`exact_kernel`): a row's product is the same alone, among up to
  `CHECK_ROWS[-1]` rows, and at any place among them; longer inputs run in calls of at most that
  many rows;
- attention: `layers.attend_chunked` over whole chunks of key slots (masked keys add exact zeros,
  chunks are summed in order), checked by `layers.chunked_attention_is_exact`;
- norms, rotary and activations are per-row arithmetic already.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.nn.functional as F

from torch import nn

from ..machine import machine_key
from . import native
from .layers import chunked_attention_is_exact
from .packed import _linear_sharing, tensor_version

ATTENTION_CHUNK = 64
# Row counts the check compares (every width a verify or a small batch uses, and past them);
# inputs longer than the last run in calls of at most that many rows.
CHECK_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64)
PAD_ROWS = 16  # the `padded` kernel: every call gets exactly this many rows (zero rows appended)
# The row counts a kernel is timed at: a plain step and a verify of the shipped block (4). One kernel
# serves every width (row-independence), so it is chosen for the widths that run most: on a 2-core AMD
# EPYC the packed native LM head takes 1.1 / 1.2 ms at 1 / 4 rows against oneDNN's 1.7 / 1.7, and
# 4.6 against 3.0 at 16.
TIMED_ROWS = (1, 4)


def _padded(x: torch.Tensor, weight: torch.Tensor, bias, rows: int = PAD_ROWS) -> torch.Tensor:
    out = []
    for s in range(0, x.shape[0], rows):
        part = x[s : s + rows]
        short = rows - part.shape[0]
        if short:
            part = torch.cat([part, part.new_zeros(short, part.shape[1])])
        out.append(F.linear(part, weight, bias)[: rows - short])
    return torch.cat(out)


def _kernels(weight: torch.Tensor, only: str | None = None) -> dict:
    """Candidate products of x [rows, in] by `weight`, in the order they are preferred (`only`: that
    one alone, so that a layer does not pack copies for the kernels it does not run)."""
    from .packed import _pack, _run, onednn_available

    out = {}
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and native.available():
        # blockdraft's own (`models.native`), from a copy packed in the order it is read (the LM head
        # of the default target: 0.8 ms a row against 2.0 unpacked on a 2-core AMD EPYC), then unpacked
        if only in (None, "native-packed"):
            packed = native.pack(weight)
            out["native-packed"] = lambda x, w, b, packed=packed: native.linear_packed(x, packed, b, w.shape[0])
        out["native"] = native.linear
    if weight.device.type == "cpu" and onednn_available() and only in (None, "onednn"):
        try:
            pack = _pack("onednn", weight, 16)
            out["onednn"] = lambda x, w, b, pack=pack: _run("onednn", x, pack, w, b, 16)
        except RuntimeError:  # e.g. bf16 on a CPU without AVX-512 or AMX: oneDNN refuses it
            pass
    out["plain"] = F.linear
    out["padded"] = _padded
    return out


def _row_independent(fn, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether every row of a product of each of `CHECK_ROWS` rows equals that row's product alone."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(CHECK_ROWS[-1], weight.shape[1], generator=gen).to(weight)
    with torch.no_grad():
        alone = torch.cat([fn(x[i : i + 1], weight, bias) for i in range(x.shape[0])])
        return all(torch.equal(fn(x[:rows], weight, bias), alone[:rows]) for rows in CHECK_ROWS[1:])


def _seconds(fn, weight: torch.Tensor, bias: torch.Tensor | None, runs: int = 5) -> float:
    """Median seconds of one product of each of `TIMED_ROWS` rows through `fn` (after a warm-up call)."""
    import statistics
    import time

    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(rows, weight.shape[1], generator=gen).to(weight) for rows in TIMED_ROWS]
    with torch.no_grad():
        for x in xs:
            fn(x, weight, bias)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            for x in xs:
                fn(x, weight, bias)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@functools.cache
def _choice(out_features: int, in_features: int, has_bias: bool, dtype: torch.dtype, device: str) -> str | None:
    """The check, kept per machine in `$BLOCKDRAFT_HOME/exact-kernels.json` (CPU only: a GPU's
    kernels are checked in every process)."""
    import json

    from .default import cache_home

    own = (
        " | native, native-packed panels" if dtype == torch.bfloat16 and device == "cpu" and native.available() else ""
    )
    timed = "+".join(map(str, TIMED_ROWS))
    key = f"{machine_key()}{own} | timed {timed} | {out_features}x{in_features}{' +bias' if has_bias else ''} | {dtype}"
    store = cache_home() / "exact-kernels.json"
    known = {}
    if device == "cpu":
        try:
            known = json.loads(store.read_text())
        except (OSError, ValueError):
            known = {}
        if key in known:
            return known[key]
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    bias = torch.randn(out_features).to(weight) if has_bias else None
    exact = {name: fn for name, fn in _kernels(weight).items() if _row_independent(fn, weight, bias)}
    # the fastest of them for a plain step and a verify of 16 together (measured here, a few runs each)
    found = min(exact, key=lambda name: _seconds(exact[name], weight, bias), default=None)
    if device == "cpu":
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            tmp = store.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**known, key: found}, indent=1, sort_keys=True))
            tmp.replace(store)
        except OSError:
            pass
    return found


def exact_kernel(weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """The fastest kernel (`native-packed`, `native`, `onednn`, `plain` or `padded`) that computes a product with this
    weight's shape and dtype row-independently on this machine, or None if none does. Checked and
    timed once per shape and dtype on a machine (about a second each for the default target's)."""
    return _choice(weight.shape[0], weight.shape[1], bias is not None, weight.dtype, str(weight.device))


@functools.cache
def attention_is_exact(heads: int, kv_heads: int, head_dim: int) -> bool:
    """`chunked_attention_is_exact` at `ATTENTION_CHUNK` for a head shape, checked once a process."""
    return chunked_attention_is_exact(heads, kv_heads, head_dim, ATTENTION_CHUNK)


class ExactProduct:
    """One weight's products, row-independent: the kernel `exact_kernel` chose, at most
    `CHECK_ROWS[-1]` rows a call."""

    def __init__(self, kernel: str):
        self.kernel = kernel
        self._key, self._fn = None, None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), tensor_version(weight))
        if key != self._key:  # a packed copy is remade when the weight changes
            self._key, self._fn = key, _kernels(weight.detach(), self.kernel)[self.kernel]
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        limit = CHECK_ROWS[-1]
        with torch.no_grad():
            if flat.shape[0] <= limit:
                out = self._fn(flat, weight, bias)
            else:
                out = torch.cat([self._fn(flat[s : s + limit], weight, bias) for s in range(0, flat.shape[0], limit)])
        return out.reshape(*x.shape[:-1], weight.shape[0])


class ExactLinear(nn.Linear):
    """An `nn.Linear` whose inference products are row-independent (`ExactProduct`); it shares
    the wrapped layer's parameters (ties and state-dict keys are unchanged)."""

    @classmethod
    def wrap(cls, linear: nn.Linear, kernel: str) -> ExactLinear:
        new = _linear_sharing(cls, linear)
        new.product = ExactProduct(kernel)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product.linear(x, self.weight, self.bias)


def native_linears(module) -> int:
    """Swap `module`'s bf16 CPU `nn.Linear`s for products through blockdraft's native kernel
    (`models.native`: at decode sizes faster than oneDNN's bf16 products); returns how many. For
    drafters: the kernel is row-independent, though a drafter, which only proposes, needs no more
    than speed."""
    if not native.available():
        return 0
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu":
                setattr(parent, name, ExactLinear.wrap(child, "native-packed"))
                swapped += 1
    return swapped


def make_exact(model) -> dict:
    """Make `model`'s cached forwards row-independent (see the module's docstring): its linear
    layers through `ExactLinear`, its attention chunked. Returns what it did, as the engine
    reports it: {"exact": bool, "kernels": {kernel: layers}, "attention_chunk": C}; "exact" is
    False (with a warning) when some product or the attention has no row-independent kernel here."""
    cfg = model.config
    # (a hybrid target's linear-attention layers are exact as they are: every cached forward after a
    # prefill runs their recurrence token by token, the same arithmetic for a token alone or in a block)
    kernels: dict[str, int] = {}
    missing = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            kernel = exact_kernel(child.weight, child.bias)
            if kernel is None:
                missing.append(f"{tuple(child.weight.shape)}")
                continue
            setattr(parent, name, ExactLinear.wrap(child, kernel))
            kernels[kernel] = kernels.get(kernel, 0) + 1
    attention = attention_is_exact(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    model.set_attention_chunk(ATTENTION_CHUNK)
    step = use_native_step(model)
    exact = (attention or step == "native") and not missing
    if not exact:
        what = ", ".join(
            ([f"products of weights {', '.join(sorted(set(missing)))}"] if missing else [])
            + ([] if attention else ["attention"])
        )
        warnings.warn(
            f"{what}: no kernel here gives a token verified in a block bit for bit what it gets "
            "decoded alone; speculative output may then differ from plain decoding where two tokens "
            "nearly tie",
            stacklevel=2,
        )
    model.exactness = {"exact": exact, "kernels": kernels, "attention_chunk": ATTENTION_CHUNK, "step": step}
    return model.exactness


def use_native_step(model) -> str:
    """Turn on the fused native step (`models.native_step`) where it runs and is row-independent
    here; returns "native", or "eager: <why not>"."""
    from . import native_step

    why = native_step.unsupported(model)
    if why is None:
        step = native_step.step_for(model)
        with torch.no_grad():
            if native_step.row_independent(model, step):
                model.native_step = step
                return "native"
        why = "its check on random tokens failed"
    model.native_step = None
    return f"eager: {why}"
