"""How a drafter multiplies its hidden states by its rows of the target's LM head.

A drafter has no LM head of its own: it scores the target's rows (all of them, or its draft
vocabulary's). The product is the bulk of a draft pass, so how it runs is a back-end object
the drafter is given (`drafter.head`), not a flag on its class:

- `FloatHead` (default): `F.linear` over the rows, gathered once outside autograd;
- `PackedHead`: the same through prepacked weights (`models.packed.WeightPacks`, given by
  `pack_drafter`);
- `Int8Head`: from int8 copies of the rows (`quantize_drafter`), inference only;
- `NativeHead`: bf16 rows through blockdraft's native kernel (`models.native`; `pack_drafter`
  on a CPU with AVX512-BF16), inference only.

This module stands between drafters and kernels: it knows both, the kernels (`models.packed`,
`models.quant`) know nothing of heads.

Each back-end keeps what it derived from the head (gathered rows, packs, int8 copies) until
the head's weights or the draft vocabulary change.
"""

from __future__ import annotations

import torch

from torch import nn

from .models.packed import WeightPacks, pack_linears, packing_available, tensor_version
from .models.quant import Int8Linear, quantize_linears


class FloatHead:
    name = "float"

    def __init__(self):
        self._kept: dict[str, tuple] = {}
        self.dtype: torch.dtype | None = None  # the drafter's, where it differs from the head's (kept rows cast)

    def keep(self, what: str, lm_head_weight: torch.Tensor, vocab: torch.Tensor | None, make):
        """`make()`, kept under `what` until the head or the draft vocabulary changes (or inference
        mode: a tensor made under it cannot enter a training step's autograd graph)."""
        key = (lm_head_weight.data_ptr(), tensor_version(lm_head_weight), torch.is_inference_mode_enabled())
        if vocab is not None:
            key += (vocab.data_ptr(), tensor_version(vocab))
        cached = self._kept.get(what)
        if cached is None or cached[0] != key:
            cached = self._kept[what] = (key, make())
        return cached[1]

    def rows(self, lm_head_weight: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """The head's rows the drafter scores (all, or the draft vocabulary's); under autograd
        gathered afresh (the gradient flows to the head), else kept (in `dtype`, where set and
        the head's differs: a bf16 drafter beside an fp32 target)."""
        cast = self.dtype is not None and self.dtype != lm_head_weight.dtype
        if vocab is None and not cast:
            return lm_head_weight
        if torch.is_grad_enabled() and lm_head_weight.requires_grad:
            return lm_head_weight if vocab is None else lm_head_weight[vocab]
        w = lm_head_weight.detach()
        return self.keep(
            "rows", lm_head_weight, vocab, lambda: (w if vocab is None else w[vocab]).to(self.dtype or w.dtype)
        )

    def logits(self, flat: torch.Tensor, lm_head_weight: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """Logits [N, V'] of hidden states [N, H]."""
        return torch.nn.functional.linear(flat, self.rows(lm_head_weight, vocab))


class PackedHead(FloatHead):
    name = "packed"

    def __init__(self, packs):
        super().__init__()
        self.packs = packs  # a models.packed.WeightPacks

    def logits(self, flat, lm_head_weight, vocab):
        return self.packs.linear(flat, self.rows(lm_head_weight, vocab))


class NativeHead(FloatHead):
    name = "native"

    def logits(self, flat, lm_head_weight, vocab):
        if torch.is_grad_enabled() or flat.dtype != torch.bfloat16:
            return super().logits(flat, lm_head_weight, vocab)
        from .models import native

        packed = self.keep(
            "native-packed", lm_head_weight, vocab, lambda: native.pack(self.rows(lm_head_weight, vocab))
        )
        return native.linear_packed(flat, packed, None, lm_head_weight.shape[0] if vocab is None else vocab.numel())


class Int8Head(FloatHead):
    name = "int8"

    def logits(self, flat, lm_head_weight, vocab):
        if torch.is_grad_enabled():
            return super().logits(flat, lm_head_weight, vocab)
        # (the int8 rows only: no float copy of the gathered rows is kept)
        head = self.keep(
            "int8",
            lm_head_weight,
            vocab,
            lambda: Int8Linear.from_float(lm_head_weight.detach() if vocab is None else lm_head_weight.detach()[vocab]),
        )
        return head(flat)


def pack_drafter(drafter: nn.Module) -> int:
    """A drafter's products through prepacked weights (fp32 on CPU: `models.packed`), its LM-head
    rows included (`PackedHead`); returns how many linears were packed."""
    swapped = pack_linears(drafter)
    head = getattr(drafter, "head", None)
    if type(head) is FloatHead:
        from .models import native

        params = list(drafter.parameters())
        if params and params[0].dtype == torch.bfloat16 and params[0].device.type == "cpu" and native.available():
            drafter.head = NativeHead()  # bf16 rows: the native kernel (oneDNN's bf16 product is slower here)
        elif packing_available():
            drafter.head = PackedHead(WeightPacks())
    return swapped


def quantize_drafter(drafter: nn.Module) -> int:
    """Swap a drafter's linear layers for `Int8Linear`s in place and have it score its share of
    the target's LM head from int8 rows too (`Int8Head`); returns how many linears were swapped.

    Inference only (a drafter's weights in int8 read 4x fewer bytes; at the 1-8 rows of a
    draft pass its products are memory-bound here): what the target emits does not change,
    since every draft is verified by the target (and sampled verification uses the drafter's
    own probabilities, whatever weights made them). A quantized drafter cannot be saved."""
    swapped = quantize_linears(drafter)
    drafter.head = Int8Head()
    return swapped
