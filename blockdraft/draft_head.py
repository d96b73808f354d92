"""How a drafter multiplies its hidden states by its rows of the target's LM head.

A drafter has no LM head of its own: it scores the target's rows (all of them, or its draft
vocabulary's). The product is the bulk of a draft pass, so how it runs is a back-end object
the drafter is given (`drafter.head`), not a flag on its class:

- `FloatHead` (default): `F.linear` over the rows, gathered once outside autograd;
- `PackedHead`: the same through prepacked weights (`models.packed.WeightPacks`, given by
  `pack_linears`);
- `Int8Head`: from int8 copies of the rows (`models.quant.quantize_drafter`), inference only.

Each back-end keeps what it derived from the head (gathered rows, packs, int8 copies) until
the head's weights or the draft vocabulary change.
"""

from __future__ import annotations

import torch

from .models.packed import tensor_version


class FloatHead:
    name = "float"

    def __init__(self):
        self._kept: dict[str, tuple] = {}

    def keep(self, what: str, lm_head_weight: torch.Tensor, vocab: torch.Tensor | None, make):
        """`make()`, kept under `what` until the head or the draft vocabulary changes."""
        key = (lm_head_weight.data_ptr(), tensor_version(lm_head_weight))
        if vocab is not None:
            key += (vocab.data_ptr(), tensor_version(vocab))
        cached = self._kept.get(what)
        if cached is None or cached[0] != key:
            cached = self._kept[what] = (key, make())
        return cached[1]

    def rows(self, lm_head_weight: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """The head's rows the drafter scores (all, or the draft vocabulary's); under autograd
        gathered afresh (the gradient flows to the head), else kept."""
        if vocab is None:
            return lm_head_weight
        if torch.is_grad_enabled() and lm_head_weight.requires_grad:
            return lm_head_weight[vocab]
        return self.keep("rows", lm_head_weight, vocab, lambda: lm_head_weight.detach()[vocab])

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


class Int8Head(FloatHead):
    name = "int8"

    def logits(self, flat, lm_head_weight, vocab):
        if torch.is_grad_enabled():
            return super().logits(flat, lm_head_weight, vocab)
        from .models.quant import Int8Linear

        # (the int8 rows only: no float copy of the gathered rows is kept)
        head = self.keep("int8", lm_head_weight, vocab, lambda: Int8Linear.from_float(
            lm_head_weight.detach() if vocab is None else lm_head_weight.detach()[vocab]))
        return head(flat)
