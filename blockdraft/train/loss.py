"""The training loss (a chunked LM head and weighted cross-entropy over block positions, hard
labels and / or the target's distribution, a Markov head's correction), the accepted lengths
the per-position hits stand for, and the draft vocabulary it is scored over."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .blocks import IGNORE


REMAT_LOGITS_ABOVE = 1 << 26  # logits elements of a step (256 MB in fp32)


def previous_tokens(batch) -> torch.Tensor:
    """[N, A*B]: the sequence's token just before each block position (teacher forcing: what a
    Markov head conditions on when every earlier draft of the block was right)."""
    return batch.tokens.gather(1, (batch.label_positions - 1).clamp(min=0, max=batch.tokens.shape[1] - 1))


def dpace_weights(
    confidence: torch.Tensor, labelled: torch.Tensor, offsets: torch.Tensor, block_size: int, alpha: float
) -> torch.Tensor:
    """D-PACE position weights (dynamic position-aware cross-entropy), detached.

    `confidence` [N, A*B]: the drafter's probability of each labelled position's label (its chance
    of drafting it); `labelled` the positions with a label. Per block, each confidence is
    smoothed to (1 - alpha) q + alpha; the product up to position m is the chance that a verify
    accepts every draft up to m; a position's weight is the sum of those products from it to the
    block's end: how much expected acceptance rides on it. An unlabelled anchor slot passes
    acceptance through (factor 1, weight 0); an unlabelled slot after it (past the sequence's end)
    ends the block."""
    n = confidence.shape[0]
    q = (1 - alpha) * confidence.detach().float() + alpha
    factor = torch.where(labelled, q, (offsets == 0).float()).view(n, -1, block_size)
    reach = torch.cumprod(factor, -1) * labelled.view(n, -1, block_size)
    weight = reach.flip(-1).cumsum(-1).flip(-1)
    return (weight * labelled.view(n, -1, block_size)).view_as(confidence)


class _BlockCrossEntropy(torch.autograd.Function):
    """Per row of fp32 logits [n, V]: the cross-entropy against a hard label, and against a
    distribution over a few tokens, from one log-softmax. Its backward writes the logits' gradient
    in one tensor, p * (g_hard + g_soft * sum(q)) - g_hard * onehot(y) - g_soft * q at q's ids
    (autograd through `F.cross_entropy` and a second log-softmax builds five [n, V] tensors for
    it: on a CPU each costs more in fresh pages than in arithmetic)."""

    @staticmethod
    def forward(ctx, logits, y, t_ids, t_probs):
        logp = torch.log_softmax(logits, -1)
        hard = -logp.gather(1, y[:, None]).squeeze(1)
        soft = None if t_ids is None else -(t_probs * logp.gather(1, t_ids)).sum(-1)
        ctx.save_for_backward(logp, y, t_ids, t_probs)
        return hard, soft

    @staticmethod
    def backward(ctx, g_hard, g_soft):
        logp, y, t_ids, t_probs = ctx.saved_tensors
        scale = g_hard if t_ids is None else g_hard + g_soft * t_probs.sum(-1)
        grad = logp.exp().mul_(scale[:, None])
        grad.scatter_add_(1, y[:, None], -g_hard[:, None])
        if t_ids is not None:
            grad.scatter_add_(1, t_ids, -(g_soft[:, None] * t_probs))
        return grad, None, None, None


def block_cross_entropy(logits, y, t_ids=None, t_probs=None):
    """(the cross-entropy of each row of `logits` [n, V] against its label y [n]; with `t_ids`,
    `t_probs` [n, k] the cross-entropy against that distribution, else None): what
    `F.cross_entropy(logits, y, reduction="none")` and `-(t_probs * log_softmax(logits).gather(1,
    t_ids)).sum(-1)` give, with a cheaper backward (`_BlockCrossEntropy`)."""
    return _BlockCrossEntropy.apply(logits, y, t_ids, t_probs)


def weighted_loss(
    hidden,
    lm_head_weight,
    labels,
    weights,
    offsets,
    block_size,
    chunk,
    to_draft=None,
    teacher=None,
    distill: float = 0.0,
    markov=None,
    dpace_alpha: float | None = None,
):
    """Chunked LM head + weighted cross-entropy over labelled block positions.

    `to_draft` [vocab] maps target ids to draft-vocabulary rows of `lm_head_weight` (-1:
    not in it; such labels count as misses and carry no hard-label loss). `teacher`: (ids,
    log-probabilities) [labels' shape + (k,)] of the target's likeliest tokens where it predicts
    each label (ids -1: none); with `distill` > 0 the loss mixes in the cross-entropy against
    that distribution, renormalized over those of its tokens the drafter scores: (1 - distill) *
    hard + distill * soft. `markov`: (a Markov head, the token before each position [same shape
    as labels]): its correction is added to the logits. `dpace_alpha`: weigh positions by
    `dpace_weights` from this step's own confidences instead of `weights` (which then only mark the
    labelled positions), the sum normalized by the number of blocks. Returns (loss, per-offset correct
    counts, per-offset totals), all on the hidden states' device."""
    keep = labels != IGNORE
    h, y, w, k = hidden[keep], labels[keep], weights[keep], offsets[keep]
    head_bias, prev = (markov[0], markov[1][keep]) if markov is not None else (None, None)
    t = None
    if teacher is not None and distill > 0:
        t_ids, t_logp = teacher[0][keep], teacher[1][keep]
        if to_draft is not None:
            t_ids = torch.where(t_ids >= 0, to_draft[t_ids.clamp(min=0)], t_ids)
        probs = torch.softmax(t_logp.float().masked_fill(t_ids < 0, float("-inf")), -1).nan_to_num(0.0)
        t = (t_ids.clamp(min=0), probs)
    w_hard = w
    if to_draft is not None:
        y = to_draft[y]
        w_hard = torch.where(y >= 0, w, torch.zeros_like(w))
        y = y.clamp(min=0)
    total = h.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(block_size, dtype=torch.long, device=h.device)
    count = torch.bincount(k, minlength=block_size)
    # Recompute each chunk's logits in backward only when keeping them all would be large (a full
    # vocabulary): with a draft vocabulary they are kept, saving a third of the head's cost.
    remat = h.shape[0] * lm_head_weight.shape[0] > REMAT_LOGITS_ABOVE
    ces, soft_ces = [], []
    # the Markov head's input embedding once for every chunk (each lookup's backward is a dense gradient of
    # the table's size, [vocab, rank]: one a step, not one a chunk)
    embedded = None if prev is None else head_bias.embed(prev)
    for s in range(0, h.shape[0], chunk):
        part_slice = slice(s, s + chunk)

        def part(hc, ec=None, t_ids=None, t_probs=None, yc=y[part_slice]):
            logits = F.linear(hc, lm_head_weight).float()
            if ec is not None:
                logits += head_bias.project(ec)  # (in place: the fp32 logits are no copy autograd keeps)
            return (*block_cross_entropy(logits, yc, t_ids, t_probs), logits.argmax(-1))  # (soft_ce: None without)

        args = (h[part_slice], None if embedded is None else embedded[part_slice])
        if t is not None:
            args += (t[0][part_slice], t[1][part_slice])
        if remat:
            out = torch.utils.checkpoint.checkpoint(part, *args, use_reentrant=False)
        else:
            out = part(*args)
        ce, soft_ce, pred = out
        if dpace_alpha is not None:  # weighed once every position's confidence is known
            ces.append(ce)
            soft_ces.append(soft_ce)
        else:
            chunk_loss = (ce * w_hard[part_slice]).sum()
            if t is not None:
                chunk_loss = (1 - distill) * chunk_loss + distill * (soft_ce * w[part_slice]).sum()
            total = total + chunk_loss
        hit = (pred == y[part_slice]) & (w_hard[part_slice] > 0) if to_draft is not None else pred == y[part_slice]
        correct += torch.bincount(k[part_slice][hit], minlength=block_size)
    if dpace_alpha is not None:
        if not ces:
            return total, correct, count
        ce = torch.cat(ces)
        confidence = torch.zeros(labels.shape, device=h.device)
        confidence[keep] = torch.exp(-ce.detach()) * (w_hard > 0)  # a label outside the draft vocabulary: a miss
        dw = dpace_weights(confidence, keep, offsets, block_size, dpace_alpha)[keep]
        total = (ce * dw * (w_hard > 0)).sum()
        if t is not None:
            total = (1 - distill) * total + distill * (torch.cat(soft_ces) * dw).sum()
        blocks = keep.view(keep.shape[0], -1, block_size).any(-1).sum()
        return total / blocks.clamp(min=1), correct, count
    norm = w.sum() if t is not None else w_hard.sum()
    return total / norm.clamp(min=1e-6), correct, count


def accepted_lengths(right: torch.Tensor) -> torch.Tensor:
    """Per block, the tokens one verify step would commit: 1 (the target's own next token) plus
    the draft positions right before the first wrong one. right [blocks, drafts] (bool)."""
    return 1 + right.long().cumprod(-1).sum(-1)


def frequent_tokens(samples, n: int, vocab_size: int, keep=()) -> list[int]:
    """The draft vocabulary of training samples (token ids, answer start, ...): the `n` most
    frequent answer tokens; ties and any shortfall are filled from prompt-token frequency, then by
    id (deterministic). `keep` (a vocabulary being widened): those ids first, the most frequent
    others after them."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    prompt = torch.zeros(vocab_size, dtype=torch.float64)
    for ids, start, *_ in samples:
        seq = torch.as_tensor(ids, dtype=torch.long)
        counts += torch.bincount(seq[start:], minlength=vocab_size)
        prompt += torch.bincount(seq[:start], minlength=vocab_size)
    score = counts * (prompt.sum() + 1) + prompt  # answers first, prompts break ties
    kept = set(int(t) for t in keep)
    order = sorted(range(vocab_size), key=lambda i: (i not in kept, -float(score[i]), i))
    return sorted(order[:n])
