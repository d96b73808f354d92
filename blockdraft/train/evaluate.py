"""A training run's held-out measures (`self`: the `Trainer`): τ in the real decode loop, and
teacher-forced block acceptance with per-position cross-entropy and accuracy."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ..batcher import generate_steps
from ..sequences import Request
from .blocks import IGNORE, build_blocks
from .loss import accepted_lengths


@torch.no_grad()
def decode_tau(self, block_size: int | None = None) -> float:
    """τ of the current drafter in the real decode loop, greedy, on held-out prompts, at
    `block_size`, the verified block (default: the trained one's, one more than the trained block
    in DSpark's layout, where every slot drafts; a drafter runs at any block up to it)."""
    pool = self.valid or self.samples
    prompts = [s[2]["prompt_ids"] for s in pool[: self.cfg.eval_prompts]]
    self.drafter.eval()
    reqs = [Request(p, self.cfg.eval_max_new_tokens, stop_token_ids=self.stop_token_ids) for p in prompts]
    states = []
    # Decoding runs the drafter in the target's dtype, as `Engine.load` does.
    drafter = self.drafter if self.dtype == torch.float32 else copy.deepcopy(self.drafter).to(self.dtype)
    proposer = self.kind.proposer(drafter, self.target)
    for _ in generate_steps(self.target, proposer, reqs, block_size or proposer.max_block_size, states):
        pass
    self.drafter.train()
    lengths = [a for s in states for a in s.acceptance_lengths]
    return sum(lengths) / max(1, len(lengths))


@torch.no_grad()
def teacher_forced(
    self, num_samples: int = 128, seed: int = 12345, block_size: int | None = None, num_anchors: int | None = None
) -> dict:
    """Teacher-forced acceptance on held-out answers. The answers are the target's own greedy
    continuations (regenerated data), so at an anchor the drafter's block (one pass, greedy)
    is accepted up to its first wrong position, exactly as in the decode loop given the same
    committed context: τ_blocks = 1 + the mean correct prefix, over thousands of blocks at
    random anchors in `num_samples` held-out answers (the same blocks for every run with the
    same block size and anchors); plus per draft position the hard-label cross-entropy and
    accuracy. Cheaper and steadier than `decode_tau`'s decode run. `block_size` and
    `num_anchors` (default: the trained ones) evaluate blocks as served at a smaller block:
    runs trained at different blocks compare on the same blocks."""
    cfg, dev = self.cfg, self.device
    pool = (self.valid or self.samples)[:num_samples]
    gen = torch.Generator().manual_seed(seed)
    head = self.drafter.head_weight(self.target.lm_head.weight)
    b = block_size or cfg.block_size
    if b > cfg.block_size:
        raise ValueError(f"a drafter trained at block {cfg.block_size} cannot run at block {b}")
    ce, ce_count, hit, count = (torch.zeros(b, device=dev) for _ in range(4))
    accepted, blocks = torch.zeros((), device=dev), torch.zeros((), device=dev)
    self.drafter.eval()
    for s in range(0, len(pool), cfg.batch_size):
        items = pool[s : s + cfg.batch_size]
        batch = build_blocks(
            [it[0] for it in items],
            [it[1] for it in items],
            block_size=b,
            num_anchors=num_anchors or cfg.num_anchors,
            mask_token_id=cfg.mask_token_id,
            gamma=self.gamma,
            generator=gen,
            shift=self.shift,
        )
        with self.autocast:
            hidden, _ = self.block_hidden(batch, labels=False)
        labels = batch.labels.to(dev)
        if self.to_draft is not None:
            labels = torch.where(labels >= 0, self.to_draft[labels.clamp(min=0)], labels)
        markov = self.markov_inputs(batch)
        for row in range(hidden.shape[0]):  # one row's logits at a time (full vocabularies are large)
            logits = F.linear(hidden[row].to(head.dtype), head).float()  # bf16 head: hidden is fp32
            if markov is not None:  # teacher-forced: exact up to a block's first wrong draft
                logits = logits + markov[0](markov[1][row]).float()
            y = labels[row]
            scored = y >= 0  # labelled and (with a draft vocabulary) in it
            right = (logits.argmax(-1) == y) & scored
            k = batch.offsets[row].to(dev)
            ce += torch.bincount(k[scored], F.cross_entropy(logits[scored], y[scored], reduction="none"), minlength=b)
            ce_count += torch.bincount(k[scored], minlength=b).float()
            hit += torch.bincount(k[right], minlength=b).float()
            count += torch.bincount(k[y != IGNORE], minlength=b).float()
            first = 1 - self.shift  # the first block slot that drafts
            real = (batch.labels[row].view(-1, b)[:, first] != IGNORE).to(dev)  # not a padding block
            accepted += accepted_lengths(right.view(-1, b)[:, first:])[real].sum()
            blocks += real.sum()
    self.drafter.train()
    return {
        "tau_blocks": round(float(accepted / blocks.clamp(min=1)), 4),
        "blocks": int(blocks),
        "val_ce": [round(x, 4) for x in (ce / ce_count.clamp(min=1)).tolist()[1 - self.shift :]],
        "val_acc": [round(x, 4) for x in (hit / count.clamp(min=1)).tolist()[1 - self.shift :]],
    }
