"""The speculative decoding loop: prefill, then draft -> verify -> accept, step by step.

One loop serves every method: `ar` is the proposer that drafts nothing, so a step
verifies a block of one token. Each row of the batch is an independent sequence
with its own length, acceptance and stopping point.
"""

from __future__ import annotations

import time

import torch

from .costs import clock
from .decode_state import DecodeState
from .errors import BlockdraftError
from .models.transformer import KVCache, Transformer
from .policy import SpeculationPolicy
from .proposers import Proposer
from .sampling import SamplingParams, acceptance, sample_tokens
from .sequences import Request, SequenceState, Step, emit, keep_logprobs, token_logprobs
from .grammar import apply_masks, block_masks, chain_masks


def resolve_block(proposer: Proposer, requested: int | None = None, *, clamp: bool = False) -> int:
    """The verified block (the last committed token and its drafts) a proposer runs at: the
    requested one, else the proposer's default, else the drafter's trained size; 1 for a proposer
    that drafts nothing. The one place where a block size is chosen and checked: `clamp` lowers a
    request above the trained size to it (the server's --block-size) instead of refusing it."""
    trained = proposer.max_block_size
    if trained is None:
        return 1
    block = requested or proposer.default_block_size or trained
    if clamp:
        block = min(block, trained)
    if not 2 <= block <= trained:
        raise BlockdraftError(f"block size {block} must be between 2 and the drafter's trained block size {trained}")
    return block


def default_sort_every(proposer: Proposer, slots: int) -> int:
    """How often a loop of `slots` rows sorts them by length (0: never): every 32 steps for
    large batches (> 16 rows), when the proposer can reorder its rows. Measured on regeneration:
    long and short rows then stop paying for each other's cache slots (README)."""
    return 32 if proposer.can_permute and slots > 16 else 0


class DecodeLoop:
    """A batch of `slots` sequence slots sharing the target's (and drafter's) caches.

    Requests join free slots at any time (`admit` prefills them) and leave when they
    finish or are cancelled; `step` runs one draft -> verify -> accept round over the
    occupied slots. Rows are addressed by caller-chosen keys. Both the offline loop
    (`generate_steps`) and the server's scheduler drive this class. The loop owns the
    speculation policy (`policy.SpeculationPolicy`, fixed or `adaptive`): it decides each
    step's draft depth and verified width up to `block_size`.
    """

    def __init__(
        self,
        target: Transformer,
        proposer: Proposer,
        block_size: int,
        slots: int,
        max_len: int,
        sort_every: int = 0,
        group_rows: int | None = None,
        adaptive: bool = False,
    ):
        block_size = resolve_block(proposer, block_size)
        self.target, self.proposer, self.block_size = target, proposer, block_size
        self.policy = SpeculationPolicy(proposer, block_size, adaptive, target.device)
        self.slots, self.max_len = slots, max_len
        # Large batches of rows at mixed lengths: every `sort_every` steps the rows are sorted
        # by length (free slots last) and attention runs per `group_rows` rows, each group
        # reading only the cache slots its longest row needs (0: never sort). Groups pay where
        # attention is memory-bound and a call is cheap (CPU: default 16 rows); on an accelerator
        # each group is a kernel launch and a handful of host ops, per layer and step (2,048 rows:
        # 128 groups x 30 layers, ~1.5 s a step on an H200), so there the default is one call.
        if group_rows is None:
            group_rows = 16 if target.device.type == "cpu" else 0
        if sort_every and not proposer.can_permute:
            raise BlockdraftError(f"the {proposer.name} proposer cannot reorder its rows (sort_every)")
        self.sort_every, self.group_rows, self.steps = sort_every, group_rows, 0
        self.state = DecodeState(target, proposer, slots, max_len)
        self.keys: list = [None] * slots  # the request key each slot serves (None: free)
        self.requests: list[Request | None] = [None] * slots
        self.states: list[SequenceState | None] = [None] * slots
        self.params = [SamplingParams(0.0)] * slots
        self.matchers: list = [None] * slots  # each slot's grammar state (`grammar.Matcher`; None: no grammar)
        # `share_prefix`: its token ids, their keys/values and captured features (None: not shared)
        self.prefix_ids: list[int] | None = None
        self.prefix_cache: KVCache | None = None
        self.prefix_features: torch.Tensor | None = None

    def share_prefix(self, ids: list[int]) -> bool:
        """Prefill `ids` once (e.g. the chat template's default system header, which every prompt
        without a system turn starts with): a prompt that starts with them then gets their
        keys/values (and captured features) copied into its slot and runs only its own tokens
        through the target. Attention caches only (a recurrent layer's state is not kept at the
        prefix's end); False when not used. Outputs are the same up to floating-point rounding
        (the prefix runs in a forward of its own)."""
        self.prefix_ids = self.prefix_cache = self.prefix_features = None
        if not ids or self.target.recurrent or not isinstance(self.state.cache, KVCache):
            return False
        device = self.target.device
        cache = self.target.new_cache(1, len(ids))
        tokens = torch.tensor([ids], device=device)
        positions = torch.arange(len(ids), device=device)[None]
        with torch.no_grad():
            _, features = self.target(tokens, positions, cache, capture=self.proposer.capture_layers)
        self.prefix_ids, self.prefix_cache, self.prefix_features = list(ids), cache, features
        return True

    def _prefix_length(self, reqs) -> int:
        """Tokens of the shared prefix the prompts of one prefill all start with (0: none)."""
        ids = self.prefix_ids
        if ids is None:
            return 0
        n = len(ids)
        return n if all(len(r.prompt_ids) > n and r.prompt_ids[:n] == ids for r in reqs) else 0

    @property
    def free_slots(self) -> list[int]:
        return [b for b in range(self.slots) if self.keys[b] is None]

    @property
    def active(self) -> int:
        return self.slots - len(self.free_slots)

    def release(self, key) -> SequenceState | None:
        """Free the slot of `key` (finished or cancelled); returns its row's state (None if it
        holds no slot)."""
        for b in range(self.slots):
            if self.keys[b] == key:
                self.proposer.release(b, key)
                state = self.states[b]
                self.keys[b] = self.requests[b] = self.states[b] = self.matchers[b] = None
                return state
        return None

    # Largest right-padded prefill forward, in tokens (rows x longest prompt): bounds its memory.
    PREFILL_TOKENS = 4096

    def admit(self, items: list[tuple]) -> dict:
        """Prefill (key, Request, SequenceState) items into free slots, in order; returns each
        key's first token(s). Runs of consecutive free slots are prefilled together, in
        right-padded forwards of at most PREFILL_TOKENS padded tokens (or one prompt). A target
        with recurrent layers takes one prompt per forward: padding would run through its state."""
        free = self.free_slots
        if len(items) > len(free):
            raise BlockdraftError(f"{len(items)} requests for {len(free)} free slots")
        for _, req, _ in items:
            if len(req.prompt_ids) + req.max_new_tokens + self.block_size > self.max_len:
                raise BlockdraftError(
                    f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens "
                    f"({req.max_new_tokens}) does not fit the {self.max_len}-position cache"
                )
        out = {}
        run: list = []
        for slot, item in list(zip(free, items, strict=False)) + [(None, None)]:
            if run:
                width = max(len(r[1][1].prompt_ids) for r in run)
                if (
                    slot is None
                    or slot != run[-1][0] + 1
                    or self.target.recurrent
                    or (len(run) + 1) * max(width, len(item[1].prompt_ids)) > self.PREFILL_TOKENS
                ):
                    out.update(self._prefill(run))
                    run = []
            if slot is not None:
                run.append((slot, item))
        return out

    def _prefill(self, run) -> dict:
        device = self.target.device
        first_slot, count = run[0][0], len(run)
        rows = slice(first_slot, first_slot + count)
        for slot, (key, req, state) in run:
            self.keys[slot], self.requests[slot], self.states[slot], self.params[slot] = key, req, state, req.sampling
            self.matchers[slot] = None if req.grammar is None else req.grammar.matcher()
        reqs = [item[1] for _, item in run]
        lengths = torch.tensor([len(r.prompt_ids) for r in reqs], device=device)
        width = int(lengths.max())
        tokens = torch.zeros(count, width, dtype=torch.long, device=device)
        for b, r in enumerate(reqs):
            tokens[b, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids)
        positions = torch.arange(width, device=device).expand(count, -1)
        shared = self._prefix_length(reqs)
        if shared:  # the shared prefix's keys/values are copied in; only the rest runs
            cache, prefix = self.state.cache, self.prefix_cache
            cache.k[:, rows, :, :shared] = prefix.k[:, :, :, :shared]
            cache.v[:, rows, :, :shared] = prefix.v[:, :, :, :shared]
        hidden, features = self.target(
            tokens[:, shared:], positions[:, shared:], self.state.cache, rows=rows, capture=self.proposer.capture_layers
        )
        if shared and features is not None:
            features = torch.cat([self.prefix_features.expand(count, -1, -1), features], dim=1)
        last = hidden[torch.arange(count, device=device), lengths - 1 - shared]
        logits = self.target.logits(last)[:, None]
        self.proposer.observe_logits(logits, (lengths - 1)[:, None], rows)
        for i in range(count):
            if self.matchers[first_slot + i] is not None:
                apply_masks(logits[i], [self.matchers[first_slot + i].allowed()])
        first = self._sample(logits, lengths[:, None], rows)[0][:, 0]
        want = [i for i, r in enumerate(reqs) if r.logprobs is not None and not self.states[first_slot + i].error]
        scored = {}
        if want:  # only rows that asked pay for log-probabilities
            at = torch.tensor(want, device=device)
            scored = dict(
                zip(
                    want, token_logprobs(logits[at], first[at][:, None], [reqs[i].logprobs for i in want]), strict=False
                )
            )
        self.proposer.observe(tokens, features, positions, rows=rows, valid=lengths)
        self.state.start(rows, lengths, first)
        out = {}
        for i, ((slot, (key, req, state)), t) in enumerate(zip(run, first.tolist(), strict=False)):
            out[key] = [] if state.error else emit(req, state, [int(t)])
            self._advance(slot, out[key])
            if i in scored and not state.error:
                keep_logprobs(state, scored[i], 0)
        return out

    def _advance(self, slot: int, tokens: list[int]):
        """Move a slot's grammar state over the tokens it emitted (they are the masked target's
        own, so the grammar allows them; a stop token ends the row)."""
        matcher = self.matchers[slot]
        if matcher is None or self.states[slot].finished:
            return
        for t in tokens:
            if t in matcher.grammar.eos:
                break
            if not matcher.advance(t):
                raise RuntimeError(f"grammar refused emitted token {t}: the masks and the sampler disagree")

    def _grammar_rows(self, rows: int) -> list[int]:
        return [
            b
            for b in range(rows)
            if self.matchers[b] is not None and self.states[b] is not None and not self.states[b].finished
        ]

    def _constrain(self, drafts: torch.Tensor, pending: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """A chain's drafts of grammar rows made to follow their grammars (`chain_masks`, with the
        drafter's best allowed token where the proposer offers one), and those rows' masks of the
        verified positions: {row: masks}."""
        masks = {}
        if drafts.shape[1] == 0:
            return drafts, {b: [self.matchers[b].allowed()] for b in self._grammar_rows(drafts.shape[0])}
        rows = self._grammar_rows(drafts.shape[0])
        if not rows:
            return drafts, masks
        lists, last = drafts.tolist(), pending.tolist()
        best = getattr(self.proposer, "best_allowed", None)
        for b in rows:
            rescore = None if best is None else (lambda i, prev, mask, b=b: best(b, i, prev, mask))
            lists[b], masks[b] = chain_masks(self.matchers[b], lists[b], last[b], rescore)
        return torch.tensor(lists, dtype=drafts.dtype, device=drafts.device), masks

    def _mask_tree(self, tree) -> dict:
        """Tree rows' masks of every node, along each node's path (`block_masks`): {row: masks}."""
        rows = self._grammar_rows(tree.tokens.shape[0])
        if not rows:
            return {}
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        return {b: block_masks(self.matchers[b], tokens[b], parents[b]) for b in rows}

    def _sample(self, logits: torch.Tensor, positions: torch.Tensor, rows: slice) -> tuple[torch.Tensor, dict]:
        """The target's tokens for rows `rows`, and {request key: error} for the rows stopped here.
        A row whose own sampling fails (its parameters, say) is stopped alone with the error
        (`SequenceState.error`) and sampled greedily in this batch; the other rows go on unchanged."""
        try:
            return sample_tokens(logits, positions, self.params[rows]), {}
        except Exception:
            bad = []
            for i, b in enumerate(range(rows.start, rows.stop)):
                try:
                    sample_tokens(logits[i : i + 1], positions[i : i + 1], self.params[b : b + 1])
                except Exception as exc:  # noqa: BLE001 - any failure of this row's own sampling
                    bad.append((b, f"{type(exc).__name__}: {exc}"))
            if not bad:
                raise
            for b, why in bad:
                self.states[b].error, self.states[b].finish_reason = why, "error"
                self.params[b] = SamplingParams(0.0)
            return sample_tokens(logits, positions, self.params[rows]), {self.keys[b]: why for b, why in bad}

    def _logprobs(
        self,
        logits: torch.Tensor,
        target_ids: torch.Tensor,
        path: torch.Tensor | None,
        accepted: list[int],
        scoring: list[int],
    ) -> dict[int, list[tuple]]:
        """The scores (`token_logprobs`) of the tokens rows `scoring` emit this step: row b's
        accepted drafts and bonus token are the target's own tokens at its first accepted[b] + 1
        verified positions (chain) or at the nodes of its accepted path (tree)."""
        at = torch.tensor(scoring, device=logits.device)
        width = max(accepted[b] for b in scoring) + 1
        if path is None:
            rows_logits, tokens = logits[at, :width], target_ids[at, :width]
        else:
            nodes = path[at, :width]
            rows_logits = logits[at].gather(1, nodes[:, :, None].expand(-1, -1, logits.shape[-1]))
            tokens = target_ids[at].gather(1, nodes)
        scores = token_logprobs(rows_logits, tokens, [self.requests[b].logprobs for b in scoring])
        return {b: s[: accepted[b] + 1] for b, s in zip(scoring, scores, strict=False)}

    def sort_rows(self):
        """Put occupied rows first, longest first, free slots last (keys move with their rows)."""
        committed = self.state.committed.tolist()
        order = sorted(range(self.slots), key=lambda b: (self.keys[b] is None, -committed[b]))
        if order == list(range(self.slots)):
            return
        self.keys = [self.keys[b] for b in order]
        self.requests = [self.requests[b] for b in order]
        self.states = [self.states[b] for b in order]
        self.params = [self.params[b] for b in order]
        self.matchers = [self.matchers[b] for b in order]
        self.state.permute(torch.tensor(order, device=self.state.committed.device))

    def step(self) -> Step:
        """One draft -> verify -> accept round over slots 0..last occupied (free slots in
        between are recomputed harmlessly at their old positions); the policy decides how
        much is drafted and verified."""
        self.steps += 1
        if self.sort_every and self.steps % self.sort_every == 0:
            self.sort_rows()
        occupied = [b for b in range(self.slots) if self.keys[b] is not None]
        if not occupied:
            return Step({}, {})
        rows = slice(0, occupied[-1] + 1)
        batch, policy = len(occupied), self.policy
        device = self.target.device
        committed, pending = self.state.committed[rows], self.state.pending[rows]
        group_rows = self.group_rows if self.sort_every else 0
        live = [self.keys[b] is not None and not self.states[b].finished for b in range(rows.stop)]
        t0 = clock(device)
        depth = policy.plan(batch)
        chosen = policy.select(
            self.proposer.propose(pending, committed, depth, rows=rows, probs=policy.wants_probs), pending, batch
        )
        t1 = clock(device)
        policy.drafted(batch, t1 - t0)
        tree = chosen if self.proposer.drafts_trees else None
        tg = time.perf_counter()
        if tree is not None:
            block = tree.tokens
            masks = self._mask_tree(tree)
            positions, slots, mask, groups = self.state.tree_layout(tree, committed, group_rows)
        else:
            drafts, masks = self._constrain(chosen, pending)
            block = torch.cat([pending[:, None], drafts], dim=1)
            positions = committed[:, None] + torch.arange(block.shape[1], device=device)
            slots, mask, groups = self.state.chain_layout(positions, group_rows)
        grammar_seconds = time.perf_counter() - tg
        width = block.shape[1]  # the verified tokens: the pending one and the drafts
        hidden, features = self.target(
            block,
            positions,
            self.state.cache,
            slots=slots,
            mask=mask,
            rows=rows,
            groups=groups,
            capture=self.proposer.capture_layers,
        )
        logits = self.target.logits(hidden)
        self.proposer.observe_logits(logits, positions, rows)
        tg = time.perf_counter()
        for b, row_masks in masks.items():  # each grammar row's distributions, masked along its paths
            apply_masks(logits[b], row_masks)
        grammar_seconds += time.perf_counter() - tg
        target_ids, failed = self._sample(logits, positions + 1, rows)
        scoring = [b for b in occupied if self.requests[b].logprobs is not None and not self.states[b].finished]
        if not scoring:
            logits = None  # (kept only for the rows that asked for log-probabilities)
        path = None
        if tree is None:
            accepted, on_path = acceptance(drafts, target_ids), None
            bonus = target_ids.gather(1, accepted[:, None])[:, 0]
        else:  # the accepted path, moved into the layout a chain leaves
            path, accepted, on_path = tree.accept(target_ids)
            bonus = target_ids.gather(1, path.gather(1, accepted[:, None]))[:, 0]
            self.state.compact(rows, path)
            block, drafts = block.gather(1, path), block.gather(1, path)[:, 1:]
            if features is not None:
                features = features.gather(1, path[:, :, None].expand(-1, -1, features.shape[-1]))
            positions = committed[:, None] + torch.arange(path.shape[1], device=device)
        t2 = clock(device)
        accepted_list, bonus_list, drafts_list = accepted.tolist(), bonus.tolist(), drafts.tolist()
        policy.verified(batch, width, t2 - t1, accepted, on_path, live, accepted_list)
        scored = self._logprobs(logits, target_ids, path, accepted_list, scoring) if scoring else {}
        drafted = width - 1
        new_ids, finished = {}, {}
        for b in occupied:
            state, req = self.states[b], self.requests[b]
            if state.finished:
                continue
            a = accepted_list[b]
            state.acceptance_lengths.append(a + 1)
            state.accepted_per_step.append((a, drafted))
            before = len(state.output_ids)
            new_ids[self.keys[b]] = emit(req, state, drafts_list[b][:a] + [bonus_list[b]])
            tg = time.perf_counter()
            self._advance(b, new_ids[self.keys[b]])
            grammar_seconds += time.perf_counter() - tg
            if b in scored:
                keep_logprobs(state, scored[b], before)
            finished[self.keys[b]] = state.finished
        # Finished and free rows stay frozen: recomputed at the same positions, harmlessly.
        active = torch.tensor(
            [self.keys[b] is not None and not self.states[b].finished for b in range(rows.stop)], device=device
        )
        self.state.commit(rows, accepted, bonus, active)
        self.proposer.observe(block, features, positions, rows=rows, valid=self.state.committed[rows].clone())
        t3 = time.perf_counter()
        finished.update({k: True for k in failed})
        return Step(
            new_ids,
            finished,
            draft_seconds=t1 - t0,
            verify_seconds=t2 - t1,
            total_seconds=t3 - t0,
            grammar_seconds=grammar_seconds,
            batch=batch,
            block_size=width,
            drafted=policy.depth,
            failed=failed,
        )
