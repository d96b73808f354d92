"""Prepacked matrix products for verify-sized inputs on CPU (fp32, MKL builds of torch).

A decode step multiplies every weight matrix by one row: a matrix-vector product that
streams the weights once. A verify step multiplies them by a handful of rows (the block's
tokens), and MKL's sgemm then repacks the whole weight matrix into its panel layout on
every call; for a few rows that repacking costs more than the arithmetic. On the 2-core
CPU a forward over 8 tokens took 2.5 decode steps that way. MKL can pack a weight once for
a fixed row count and reuse the packed copy, which brings the same forward to about 1.5
decode steps (`python scripts/engine_costs.py` prints both).

`pack_linears(model)` swaps every `nn.Linear` of a model for a `PackedLinear` that shares
its parameters (state-dict keys and tied weights are unchanged). An input of m rows with
`min_rows <= m <= max(sizes)` is padded with zero rows up to the next packed size and
multiplied by the weights packed for that size (packed lazily on first use, about 3x the
weight's memory per size); other inputs take the ordinary path. Each output row depends only
on its own input row, so results do not depend on what else is in the batch or on the
padding. Rounding differs from the unpacked product in the last bits, as any change of
kernel does; verification compares the target's own argmax either way.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_SIZES = (8, 16)
DEFAULT_MIN_ROWS = 4  # up to 3 rows the unpacked product is as fast (measured on the 2-core CPU)


@functools.cache
def packing_available() -> bool:
    """True when this torch build has MKL's packed sgemm (x86 builds with MKL)."""
    try:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


def tensor_version(t: torch.Tensor) -> int:
    """The in-place edit counter of `t` (-1 for inference tensors, which have none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


class WeightPacks:
    """Packed copies of one weight matrix, one per row count, repacked when the weight changes."""

    def __init__(self, sizes=DEFAULT_SIZES, min_rows: int = DEFAULT_MIN_ROWS):
        self.sizes, self.min_rows = tuple(sorted(sizes)), min_rows
        self._packs: dict[int, torch.Tensor] = {}
        self._key = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(x, weight, bias)`, through a packed weight when the row count allows."""
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if rows < self.min_rows:  # decode steps: the common case, decided first
            return F.linear(x, weight, bias)
        if (not packing_available() or not self.min_rows <= rows <= self.sizes[-1]
                or x.dtype != torch.float32 or x.device.type != "cpu" or not weight.is_contiguous()
                or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return F.linear(x, weight, bias)
        size = next(s for s in self.sizes if s >= rows)
        flat = x.reshape(rows, x.shape[-1])
        if size != rows:
            flat = torch.cat([flat, flat.new_zeros(size - rows, flat.shape[1])])
        out = torch.ops.mkl._mkl_linear(flat.contiguous(), self._packed(weight, size), weight, bias, size)
        return out[:rows].reshape(*x.shape[:-1], weight.shape[0])

    def _packed(self, weight: torch.Tensor, size: int) -> torch.Tensor:
        key = (weight.data_ptr(), tensor_version(weight), tuple(weight.shape))
        if key != self._key:  # another tensor, or edited in place: repack
            self._packs, self._key = {}, key
        pack = self._packs.get(size)
        if pack is None:
            with torch.no_grad():
                pack = self._packs[size] = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), size)
        return pack


def _linear_sharing(cls, linear: nn.Linear) -> nn.Linear:
    """A `cls` (an nn.Linear class) holding `linear`'s own Parameter objects, so ties and
    state-dict keys survive the swap."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    new.weight, new.bias = linear.weight, linear.bias
    return new


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies small row counts by weights prepacked for MKL."""

    @classmethod
    def wrap(cls, linear: nn.Linear, sizes=DEFAULT_SIZES, min_rows: int = DEFAULT_MIN_ROWS) -> "PackedLinear":
        new = _linear_sharing(cls, linear)
        new.packs = WeightPacks(sizes, min_rows)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packs.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module, sizes=DEFAULT_SIZES, min_rows: int = DEFAULT_MIN_ROWS) -> int:
    """Swap the fp32 CPU `nn.Linear`s of `model` for `PackedLinear`s; returns how many.
    A module that multiplies by a weight outside an `nn.Linear` (a drafter's share of the
    target's LM head) declares a `head_packs` attribute, which gets a `WeightPacks`.
    Does nothing (returns 0) where MKL packing is unavailable."""
    if not packing_available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        if hasattr(parent, "head_packs"):
            parent.head_packs = WeightPacks(sizes, min_rows)
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.dtype == torch.float32
                    and child.weight.device.type == "cpu"):
                setattr(parent, name, PackedLinear.wrap(child, sizes, min_rows))
                swapped += 1
    return swapped


def unpack_linears(model: nn.Module) -> int:
    """Undo `pack_linears` (frees the packed copies); returns how many were restored."""
    restored = 0
    for parent in list(model.modules()):
        if hasattr(parent, "head_packs"):
            parent.head_packs = None
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, _linear_sharing(nn.Linear, child))
                restored += 1
    return restored
