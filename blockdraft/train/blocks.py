"""Training examples for the drafter: anchors, blocks, the block attention mask, labels, weights.

For a sequence x_0..x_{L-1} whose answer starts at position s, each anchor a
(s <= a <= L-2) opens a block `[x_a, MASK x (B-1)]` at positions a..a+B-1.
Block position k (1 <= k <= B-1) is labelled with x_{a+k} (the same position: no
shift), weighted by exp(-(k-1)/gamma); position 0 has no loss. A block's queries
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


def sample_anchors(answer_start: int, length: int, count: int, block_size: int, mode: str,
                   generator: torch.Generator) -> list[int]:
    """Anchor positions inside the answer: `random` (the recipe) or `fixed` block boundaries."""
    first, last = answer_start, length - 2
    if last < first:
        return []
    if mode == "fixed":
        return list(range(first, last + 1, block_size))[:count]
    span = last - first + 1
    pick = torch.randperm(span, generator=generator)[: min(count, span)]
    return sorted((pick + first).tolist())


def build_blocks(seqs: list[list[int]], answer_starts: list[int], *, block_size: int, num_anchors: int,
                 mask_token_id: int, gamma: float | None, generator: torch.Generator,
                 anchor_mode: str = "random") -> BlockBatch:
    n = len(seqs)
    width = max(len(s) for s in seqs)
    anchors = [sample_anchors(st, len(s), num_anchors, block_size, anchor_mode, generator)
               for s, st in zip(seqs, answer_starts)]
    a_max = max(1, max(len(a) for a in anchors))
    q = a_max * block_size
    tokens = torch.zeros(n, width, dtype=torch.long)
    block_tokens = torch.full((n, q), mask_token_id, dtype=torch.long)
    block_positions = torch.zeros(n, q, dtype=torch.long)
    labels = torch.full((n, q), IGNORE, dtype=torch.long)
    weights = torch.zeros(n, q)
    offsets = torch.arange(block_size).repeat(a_max).expand(n, -1).clone()
    mask = torch.zeros(n, 1, q, width + q, dtype=torch.bool)
    decay = [0.0] + [math.exp(-(k - 1) / gamma) if gamma else 1.0 for k in range(1, block_size)]
    keys = torch.arange(width)
    for i, (seq, anc) in enumerate(zip(seqs, anchors)):
        seq_t = torch.tensor(seq)
        tokens[i, : len(seq)] = seq_t
        for j in range(a_max):
            rows = slice(j * block_size, (j + 1) * block_size)
            mask[i, 0, rows, width + j * block_size: width + (j + 1) * block_size] = True  # its own block
            if j >= len(anc):
                continue  # padding block: sees only itself, no loss
            a = anc[j]
            block_tokens[i, j * block_size] = seq[a]
            block_positions[i, rows] = torch.arange(a, a + block_size)
            mask[i, 0, rows, :width] = keys < a  # context strictly before the anchor
            for k in range(1, block_size):
                if a + k < len(seq):
                    labels[i, j * block_size + k] = seq[a + k]
                    weights[i, j * block_size + k] = decay[k]
    return BlockBatch(tokens, torch.tensor([len(s) for s in seqs]), block_tokens, block_positions, labels,
                      weights, mask, offsets)
