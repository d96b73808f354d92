"""Training examples for the drafter: anchors, blocks, the block attention mask, labels, weights.

For a sequence x_0..x_{L-1} whose answer starts at position s, each anchor a
(s <= a <= L-2) opens a block `[x_a, MASK x (B-1)]` at positions a..a+B-1.
In DFlash's layout block position k (1 <= k <= B-1) is labelled with x_{a+k} (the same
position: no shift), weighted by exp(-(k-1)/gamma); position 0 has no loss. In DSpark's
(`sample_from_anchor`, `shift` 1) every position k (0 <= k <= B-1) is labelled with the
token after it, x_{a+k+1}, weighted by exp(-k/gamma): B drafts a block. A block's queries
see the context features at positions STRICTLY before a, and their own block
(bidirectionally); never another block. These are exactly the conditions of the
decode loop, where a block is anchored at the last committed token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class BlockBatch:
    tokens: torch.Tensor  # [N, L] the sequences (right-padded)
    lengths: torch.Tensor  # [N]
    block_tokens: torch.Tensor  # [N, A*B] anchor token then MASKs
    block_positions: torch.Tensor  # [N, A*B]
    labels: torch.Tensor  # [N, A*B] (IGNORE where no loss)
    weights: torch.Tensor  # [N, A*B]
    mask: torch.Tensor  # [N, 1, A*B, L + A*B] bool: what each block query sees
    offsets: torch.Tensor  # [N, A*B] k, the position inside the block
    label_positions: torch.Tensor  # [N, A*B] the sequence position each block position's label is at
    starts: torch.Tensor  # [N] where each sequence's answer starts


def sample_anchors(
    answer_start: int, length: int, count: int, block_size: int, mode: str, generator: torch.Generator
) -> list[int]:
    """Anchor positions inside the answer: `random` (the recipe) or `fixed` block boundaries."""
    first, last = answer_start, length - 2
    if last < first:
        return []
    if mode == "fixed":
        return list(range(first, last + 1, block_size))[:count]
    span = last - first + 1
    pick = torch.randperm(span, generator=generator)[: min(count, span)]
    return sorted((pick + first).tolist())


def build_blocks(
    seqs: list[list[int]],
    answer_starts: list[int],
    *,
    block_size: int,
    num_anchors: int,
    mask_token_id: int,
    gamma: float | None,
    generator: torch.Generator,
    anchor_mode: str = "random",
    shift: int = 0,
) -> BlockBatch:
    """Blocks at random anchors; `shift` 1: DSpark's layout (each slot labelled with the token after it)."""
    if shift not in (0, 1):
        raise ValueError(f"shift is 0 (DFlash's layout) or 1 (DSpark's), got {shift}")
    n = len(seqs)
    width = max(len(s) for s in seqs)
    anchors = [
        sample_anchors(st, len(s), num_anchors, block_size, anchor_mode, generator)
        for s, st in zip(seqs, answer_starts, strict=False)
    ]
    a_max = max(1, max(len(a) for a in anchors))
    q = a_max * block_size
    # one tensor expression per field (a Python loop over sequences x anchors x positions cost
    # ~0.5 s of host time a step at 64 sequences x 64 anchors, a GPU step's largest share)
    tokens = torch.zeros(n, width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        tokens[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs])
    anchor = torch.full((n, a_max), -1, dtype=torch.long)  # -1: a padding block
    for i, anc in enumerate(anchors):
        anchor[i, : len(anc)] = torch.tensor(anc, dtype=torch.long)
    offsets = torch.arange(block_size).repeat(a_max).expand(n, -1).clone()
    at = anchor.repeat_interleave(block_size, dim=1)  # [n, q] each query's anchor
    pos = at + offsets  # [n, q] each query's position
    real_q = at >= 0
    block_tokens = torch.full((n, q), mask_token_id, dtype=torch.long)
    first = real_q & (offsets == 0)
    block_tokens[first] = tokens.gather(1, at.clamp(min=0))[first]
    block_positions = torch.where(real_q, pos, torch.zeros_like(pos))
    at_label = pos + shift
    labelled = real_q & (offsets + shift > 0) & (at_label < lengths[:, None])
    labels = torch.where(labelled, tokens.gather(1, at_label.clamp(0, width - 1)), torch.full_like(pos, IGNORE))
    decay = torch.tensor(
        [0.0] * (1 - shift) + [math.exp(-j / gamma) if gamma else 1.0 for j in range(block_size - 1 + shift)]
    )
    weights = torch.where(labelled, decay[offsets], torch.zeros(()))
    block_of = torch.arange(q) // block_size
    own = block_of[:, None] == block_of[None, :]  # each query sees its own block
    context = torch.arange(width)[None, None, :] < at[:, :, None]  # strictly before its anchor (none: padding)
    mask = torch.cat([context, own.expand(n, q, q)], dim=2)[:, None]
    label_positions = torch.where(real_q, at_label, torch.zeros_like(pos))
    return BlockBatch(
        tokens,
        lengths,
        block_tokens,
        block_positions,
        labels,
        weights,
        mask,
        offsets,
        label_positions,
        torch.tensor(answer_starts),
    )
