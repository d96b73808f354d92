"""Matrix products for decode- and verify-sized inputs on CPU (fp32): the fastest of three
kernels per weight shape and row count, chosen by measuring them on this machine (cold cache).

A decode step multiplies every weight matrix by one row; a verify step by a handful of rows
(the block's tokens). Which kernel does that fastest depends on the CPU, and by a lot:
- `plain`: `F.linear` (MKL's sgemm / sgemv). On an Intel Xeon it repacks the whole weight
  into its panel layout on every call, which for 4-16 rows costs more than the arithmetic;
  on an AMD EPYC its few-row products run at a third of the speed of the others below.
- `mkl`: MKL's sgemm on a weight packed once for a fixed row count (about 3x the weight's
  memory per count). On the Intel CPU it brought an 8-token forward from 2.5 to about 1.5
  decode steps.
- `onednn`: oneDNN's inner product on a weight reordered once into its blocked layout
  (the weight's memory once, for 1-16 rows). On the AMD CPU the LM head's product over 3 rows takes 10 ms
  against plain's 42 ms and mkl's 26 ms.
(`python benchmarks/engine_costs.py` prints the forward's cost per row count.)

`pack_linears(model)` swaps every `nn.Linear` of a model for a `PackedLinear` that shares
its parameters (state-dict keys and tied weights are unchanged). An input of m rows with
`min_rows <= m <= max(sizes)` goes to the row-count bucket `size`, the next of `sizes` at
or above m; the first product of a (weight shape, bias, size) times every available kernel
on that shape (a few runs each, once per process: `kernel_choices()`) and keeps the fastest.
Every kernel gets the input padded with zero rows up to `size`, so a row's result does not
depend on what else is in the batch or on the padding.
Rounding differs between kernels in the last bits, as any change of kernel does;
verification compares the target's own argmax either way.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_SIZES = (1, 2, 3, 4, 8, 16)
DEFAULT_MIN_ROWS = 1
KERNELS = ("plain", "mkl", "onednn")

# (out features, in features, has bias, row bucket) -> the fastest kernel measured here
_choices: dict[tuple[int, int, bool, int], str] = {}


@functools.cache
def mkl_packing_available() -> bool:
    """True when this torch build has MKL's packed sgemm (x86 builds with MKL)."""
    try:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def onednn_available() -> bool:
    """True when this torch build has oneDNN's reordered-weight linear (CPU builds with mkldnn)."""
    try:
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


def available_kernels() -> tuple[str, ...]:
    return tuple(
        k for k, ok in (("plain", True), ("mkl", mkl_packing_available()), ("onednn", onednn_available())) if ok
    )


def packing_available() -> bool:
    """True when any kernel besides `plain` exists in this torch build."""
    return len(available_kernels()) > 1


def kernel_choices() -> dict[tuple[int, int, bool, int], str]:
    """The kernels chosen so far: (out features, in features, has bias, rows) -> kernel."""
    return dict(_choices)


def tensor_version(t: torch.Tensor) -> int:
    """The in-place edit counter of `t` (-1 for inference tensors, which have none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


ONEDNN_HINT = 16  # oneDNN's layout hint: one reordered copy serves every row count, 1 to 16


def _pack_key(kernel: str, size: int):
    """Which packed copy a (kernel, size) product uses: MKL packs per row count; oneDNN's
    copy reordered for 16 rows is as fast for any 2-16 rows and, on an AVX-512 AMD EPYC, for
    one row too (a copy made for 1 row took 1.0-1.7x its time there, cold cache; measured with
    every weight shape of the default target), so all row counts share it."""
    if kernel == "mkl":
        return ("mkl", size)
    if kernel == "onednn":
        return ("onednn", ONEDNN_HINT)
    return None


def _pack(kernel: str, weight: torch.Tensor, size: int):
    with torch.no_grad():
        if kernel == "mkl":
            return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), size)
        if kernel == "onednn":
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _pack_key(kernel, size)[1])
    return None


def _run(kernel: str, flat: torch.Tensor, pack, weight: torch.Tensor, bias, size: int) -> torch.Tensor:
    """The product of `flat` [size or fewer rows, in] by the weight through `kernel`."""
    if kernel == "plain":
        return F.linear(flat, weight, bias)
    if kernel == "mkl":
        return torch.ops.mkl._mkl_linear(flat, pack, weight, bias, size)
    return torch.ops.mkldnn._linear_pointwise(flat, pack, bias, "none", [], "")


MEASURE_BYTES = 64 << 20  # weight copies cycled through when timing a kernel: more than a CPU's cache
# At most this many copies: a weight under MEASURE_BYTES / MEASURE_COPIES (256 KiB; none of the
# default target's) is timed over fewer bytes than that, where any kernel takes microseconds; the
# 65,536 copies (and as many packed ones) of a 16 x 16 weight left the test process 3.2 GB larger.
MEASURE_COPIES = 256


def _measure(weight: torch.Tensor, bias, size: int, runs: int = 3) -> str:
    """The fastest available kernel for this weight's shape at `size` rows (median of `runs`).
    Timed as a forward meets it, with the weight not in cache: one product each over enough
    copies of the weight to outgrow the caches (a few-row product streams its weight from
    memory; timing one weight again and again, hot in cache, picked kernels that were 2x
    slower in the model on an AMD EPYC)."""
    count = min(MEASURE_COPIES, MEASURE_BYTES // (weight.numel() * weight.element_size()))
    copies = [weight.detach()] + [torch.randn_like(weight) for _ in range(count - 1)]
    repeat = max(1, 8 // len(copies))  # a weight larger than the caches: 8 products a run
    x = torch.randn(size, weight.shape[1], dtype=weight.dtype)
    best, best_time = "plain", float("inf")
    with torch.no_grad():
        for kernel in available_kernels():
            pairs = [(w, _pack(kernel, w, size)) for w in copies] * repeat
            for w, pack in pairs:  # warm-up
                _run(kernel, x, pack, w, bias, size)
            times = []
            for _ in range(runs):
                t = time.perf_counter()
                for w, pack in pairs:
                    _run(kernel, x, pack, w, bias, size)
                times.append(time.perf_counter() - t)
            del pairs
            if statistics.median(times) < best_time:
                best, best_time = kernel, statistics.median(times)
    return best


class WeightPacks:
    """One weight matrix's products per row-count bucket: the kernel measured fastest for its
    shape (or `kernel` if given), with the weight packed for it, repacked when it changes."""

    def __init__(self, sizes=DEFAULT_SIZES, min_rows: int = DEFAULT_MIN_ROWS, kernel: str | None = None):
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.sizes, self.min_rows, self.kernel = tuple(sorted(sizes)), min_rows, kernel
        self._kernels: dict[int, str] = {}  # row bucket -> kernel
        self._packs: dict[tuple, object] = {}  # _pack_key -> packed weight
        self._key = None

    @property
    def buckets(self) -> dict[int, str]:
        """Row-count buckets used so far -> the kernel each runs (empty until a product ran)."""
        return dict(self._kernels)

    @property
    def packed_weights(self) -> int:
        """Packed copies of the weight held now (0: none made, e.g. only autograd inputs came)."""
        return len(self._packs)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(x, weight, bias)`, through the bucket's kernel when the row count allows."""
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if (
            not self.min_rows <= rows <= self.sizes[-1]
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or not weight.is_contiguous()
            or torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad)
        ):
            return F.linear(x, weight, bias)
        size = next(s for s in self.sizes if s >= rows)
        kernel, pack = self._packed(weight, bias, size)
        flat = x.reshape(rows, x.shape[-1])
        if size != rows:
            flat = torch.cat([flat, flat.new_zeros(size - rows, flat.shape[1])])
        out = _run(kernel, flat.contiguous(), pack, weight, bias, size)
        return out[:rows].reshape(*x.shape[:-1], weight.shape[0])

    def _packed(self, weight: torch.Tensor, bias, size: int):
        key = (weight.data_ptr(), tensor_version(weight), tuple(weight.shape))
        if key != self._key:  # another tensor, or edited in place: repack
            self._packs, self._key = {}, key
        kernel = self._kernels.get(size)
        if kernel is None:
            kernel = self.kernel
            if kernel is None:
                shape = (weight.shape[0], weight.shape[1], bias is not None, size)
                kernel = _choices.get(shape)
                if kernel is None:
                    kernel = _choices[shape] = _measure(weight, bias, size)
            if kernel not in available_kernels():
                kernel = "plain"
            self._kernels[size] = kernel
        where = _pack_key(kernel, size)
        if where is not None and where not in self._packs:
            self._packs[where] = _pack(kernel, weight, size)
        return kernel, self._packs.get(where)


def _linear_sharing(cls, linear: nn.Linear) -> nn.Linear:
    """A `cls` (an nn.Linear class) holding `linear`'s own Parameter objects, so ties and
    state-dict keys survive the swap."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    new.weight, new.bias = linear.weight, linear.bias
    return new


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose small row counts go through the kernel measured fastest (`WeightPacks`)."""

    @classmethod
    def wrap(
        cls, linear: nn.Linear, sizes=DEFAULT_SIZES, min_rows: int = DEFAULT_MIN_ROWS, kernel: str | None = None
    ) -> PackedLinear:
        new = _linear_sharing(cls, linear)
        new.packs = WeightPacks(sizes, min_rows, kernel)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packs.linear(x, self.weight, self.bias)


def pack_linears(
    model: nn.Module, sizes=DEFAULT_SIZES, min_rows: int = DEFAULT_MIN_ROWS, kernel: str | None = None
) -> int:
    """Swap the fp32 CPU `nn.Linear`s of `model` for `PackedLinear`s; returns how many.
    `kernel` forces one kernel (`KERNELS`) instead of the fastest measured. (A drafter's product
    with its rows of the target's LM head is outside any `nn.Linear`: `draft_head.pack_drafter`.)
    Does nothing (returns 0) where no kernel besides `F.linear` is available."""
    if not packing_available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear.wrap(child, sizes, min_rows, kernel))
                swapped += 1
    return swapped


def unpack_linears(model: nn.Module) -> int:
    """Undo `pack_linears` (frees the packed copies); returns how many were restored."""
    restored = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, _linear_sharing(nn.Linear, child))
                restored += 1
    return restored
