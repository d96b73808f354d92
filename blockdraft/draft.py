"""The DFlash drafter: a few Qwen3-style layers conditioned on the target's hidden features.

A block `[last committed token, MASK x (B-1)]` is embedded with the target's own
(frozen) embedding and run through the drafter's layers in ONE forward with
bidirectional attention inside the block. In every layer the fused context
feature of each committed token is projected by that layer's k_proj / v_proj
(then k_norm and RoPE at the token's absolute position) and placed in front of
the block's own keys and values ("KV injection"). The final hidden states go
through the target's LM head; positions 1..B-1 are the drafted tokens.

`DFlashDrafter.forward` is the one forward used by both training (many blocks
per sequence under an explicit mask, no cache) and decoding (context K/V kept in
a `DraftCache`, one block per sequence).

Checkpoints are folders in the published z-lab / vLLM / SGLang format:
`config.json` + `model.safetensors`, no embedding and no LM head.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .checkpoint import load_weights, write_model_folder
from .errors import BlockdraftError
from .models.config import TargetConfig
from .models import native
from .models.layers import RMSNorm, Rotary, SwiGLU, apply_rotary, attend

# (DraftConfig is also imported from here, with the drafter it configures)
from .draft_config import DraftConfig, read_draft_config
from .draft_head import FloatHead, Int8Head


class BlockMask:
    """What the queries of a training forward see, in a form attention can use without the dense
    mask's zeros (`attend_blocks`): each query the context keys `context` [N, Tq, C] marks, and
    every query of its own block (queries jB .. jB + B - 1 form block j). The dense mask [N, 1, Tq,
    C + Tq] `build_blocks` makes is the same thing with a Tq x Tq block-diagonal part."""

    def __init__(self, context: torch.Tensor, block_size: int):
        self.context, self.block_size = context, block_size

    @classmethod
    def of(cls, mask: torch.Tensor) -> BlockMask:
        """The dense training mask [N, 1, Tq, C + Tq] of `build_blocks` in this form."""
        t = mask.shape[-2]
        own = mask[0, 0, 0, mask.shape[-1] - t :]
        b = int(own.sum())
        if b == 0 or t % b or not torch.equal(own, torch.arange(t, device=own.device) < b):
            raise ValueError("not a block-diagonal training mask")
        return cls(mask[:, 0, :, : mask.shape[-1] - t], b)

    def own_only(self) -> BlockMask:
        """The same queries, seeing their own blocks only (no context)."""
        return BlockMask(self.context[..., :0], self.block_size)


def attend_blocks(q, ctx_k, ctx_v, k, v, mask: BlockMask) -> torch.Tensor:
    """`attend` under a `BlockMask`: q [N, H, Tq, D] against the context keys ctx_k [N, KV, C, D]
    it may see and its own block's B keys of k [N, KV, Tq, D], one softmax (fp32) over both; what
    the dense mask gives, without scoring the Tq - B block keys every query may not see (a training
    forward of 32 blocks of 16 attends to 1/32 of them)."""
    n, h, t, d = q.shape
    kv, b, c = k.shape[1], mask.block_size, ctx_k.shape[2]
    g, a = h // kv, t // b
    qg = q.reshape(n, kv, g, t, d)  # query head i uses KV head i // g
    ctx = (qg.reshape(n, kv, g * t, d) @ ctx_k.transpose(-1, -2)).view(n, kv, g, t, c)
    ctx = ctx.masked_fill(~mask.context[:, None, None], float("-inf"))
    own = (qg.view(n, kv, g, a, b, d) @ k.view(n, kv, 1, a, b, d).transpose(-1, -2)).view(n, kv, g, t, b)
    p = (torch.cat([ctx, own], -1).float() * d**-0.5).softmax(-1).to(q.dtype)
    out = (p[..., :c].reshape(n, kv, g * t, c) @ ctx_v).view(n, kv, g, t, d)
    out = out + (p[..., c:].reshape(n, kv, g, a, b, b) @ v.view(n, kv, 1, a, b, d)).view(n, kv, g, t, d)
    return out.view(n, h, t, d)


def sliding_mask(
    mask: torch.Tensor, positions: torch.Tensor, context_positions: torch.Tensor, window: int
) -> torch.Tensor:
    """A drafter mask [B, 1, Tq, C + Tq] for a sliding-window layer: a query at position q keeps
    only the context keys at positions > q - window (its own block stays visible); a `BlockMask`
    gives a `BlockMask`."""
    near = context_positions[:, None, :] > positions[:, :, None] - window  # [B, Tq, C]
    if isinstance(mask, BlockMask):
        return BlockMask(mask.context & near, mask.block_size)
    block = near.new_ones(near.shape[0], 1, near.shape[1], mask.shape[-1] - near.shape[-1])
    return mask & torch.cat([near[:, None], block], dim=-1)


class DraftCache(nn.Module):
    """Per-layer keys/values of the context (committed tokens).

    Unbounded (`window` None): slot = position, `max_len` slots. Bounded draft context
    (`window` W): a ring of W slots holding the last W committed positions (slot = position
    mod W, `pos` says which position each slot holds, -1 for none) plus one scratch slot
    where writes of uncommitted positions land; memory and attention cost stay flat however
    long the sequence grows."""

    def __init__(
        self, cfg: DraftConfig, batch: int, max_len: int, dtype, device, window: int | None = None, extra: int = 0
    ):
        super().__init__()
        slots = max_len if window is None else window + 1
        # `extra` slots past those: where the native pass puts a block's own keys and values
        self.block_slot, self.extra = slots, extra
        slots += extra
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, slots, cfg.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # the position each ring slot holds (-1: none); an unbounded cache's slot is its position
        self.pos = None if window is None else torch.full((batch, slots), -1, dtype=torch.long, device=device)
        self.batch, self.max_len, self.window = batch, max_len, window

    def clear(self):
        if self.pos is not None:
            self.pos.fill_(-1)

    def slots(self, positions: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Where context at `positions` [B, C] is written. With a window, a position outside
        [valid - W, valid) (`valid` [B]: each row's committed length after this write) goes
        to the scratch slot: it is junk or has already left the window (`valid` None: every
        entry is committed)."""
        if self.window is None:
            return positions
        if valid is None:  # every entry is committed
            valid = positions.amax(1) + 1
        keep = (positions < valid[:, None]) & (positions >= valid[:, None] - self.window)
        return torch.where(keep, positions % self.window, self.window)

    def context(self, rows, anchors: torch.Tensor):
        """(slot count n, key positions [B, n], mask [B, n]) of the context blocks anchored at
        `anchors` [B] see: the cached positions strictly before the anchor (the last W of them
        with a window)."""
        used = int(anchors.max())
        if self.window is None:
            keys = torch.arange(used, device=anchors.device).expand(anchors.shape[0], -1)
            return used, keys, keys < anchors[:, None]
        n = min(used, self.window)
        keys = self.pos[rows, :n]
        return n, keys, (keys >= 0) & (keys < anchors[:, None]) & (keys >= anchors[:, None] - self.window)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def keys_values(self, x, cos, sin):
        """k (normed, rotated) and v of x [B, T, H] as [B, KV, T, D]: the KV injection."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        if isinstance(mask, BlockMask):
            out = attend_blocks(q, ctx_k, ctx_v, k, v, mask)
        else:
            out = attend(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """DSpark's vanilla Markov head: a rank-r first-order correction of a draft position's
    logits by the token before it, bias = W2 W1[previous token] (W1: every target token id ->
    r numbers; W2: r -> the drafter's vocabulary, the draft vocabulary where it has one)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        """Logit corrections [..., V'] for previous target token ids [...]."""
        return self.project(self.embed(previous))

    def embed(self, previous: torch.Tensor) -> torch.Tensor:
        """W1[previous]: [..., r] (training looks these up once for all its chunks of positions)."""
        return self.markov_w1(previous)

    def project(self, embedded: torch.Tensor) -> torch.Tensor:
        """W2 applied to `embed`'s rows: the logit corrections [..., V']."""
        return self.markov_w2(embedded)


class DrafterBase(nn.Module):
    """What every drafter kind shares: initialisation and the optional draft vocabulary."""

    native = None  # a `draft_native.NativeDraft` runs the decode pass when set (`use_native_draft`)
    # the target's, which a drafter reads from the target; a folder holding copies (DSpark's layout) loads
    borrowed_weights = ("embed_tokens.weight", "lm_head.weight")
    draft_pass = "eager"  # which pass decodes, as `Engine.precision` reports it
    vocab_rows = ("markov_head.markov_w2.weight",)  # weights with a row per draft-vocabulary token

    def __init__(self):
        super().__init__()
        self.head = FloatHead()  # how it scores its LM-head rows: a back-end it is given (`draft_head`)

    def reset_parameters(self, std: float = 0.02):
        """The initialisation used for training: N(0, std) projections, unit norms."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                torch.nn.init.ones_(p)
            elif p.dim() == 2:
                torch.nn.init.normal_(p, std=std)
            else:
                torch.nn.init.zeros_(p)

    def set_draft_vocab(self, token_ids):
        """Fix the draft vocabulary (sorted, unique target ids; its size is the config's)."""
        ids = torch.as_tensor(sorted(set(int(t) for t in token_ids)), dtype=torch.long)
        if not hasattr(self, "draft_vocab") or ids.numel() != self.draft_vocab.numel():
            raise ValueError("draft vocabulary size differs from the config's draft_vocab_size")
        if ids.numel() and not 0 <= int(ids[0]) <= int(ids[-1]) < self.config.vocab_size:
            raise ValueError("draft vocabulary ids outside the target vocabulary")
        self.draft_vocab.copy_(ids.to(self.draft_vocab.device))

    def head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Rows of the target's LM head the drafter scores (all, or the draft vocabulary's)."""
        return self.head.rows(lm_head_weight, getattr(self, "draft_vocab", None))

    def draft_logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Logits [..., V'] over the draft vocabulary (V' = the target's unless a draft
        vocabulary is set) from final hidden states [..., H], through the drafter's head
        back-end (`draft_head`)."""
        flat = hidden.reshape(-1, hidden.shape[-1])  # one matrix product, also for strided slices
        return self.head.logits(flat, lm_head_weight, getattr(self, "draft_vocab", None)).view(*hidden.shape[:-1], -1)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> target token ids."""
        vocab = getattr(self, "draft_vocab", None)
        return ids if vocab is None else vocab[ids]

    def markov_chain(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, previous: torch.Tensor):
        """The Markov head's greedy chain over a block's positions, left to right: position k's
        logits get the correction for the token drafted at k - 1 (`previous` [B], the last
        committed token, before the first). Returns (tokens [B, n] target ids, the logits [B, n, V'])."""
        return self._chain(self.draft_logits(hidden, lm_head_weight), previous)

    def _chain(self, base: torch.Tensor, previous: torch.Tensor):
        """`markov_chain` from the backbone's logits [B, n, V']."""
        out, tokens = [], []
        for k in range(base.shape[1]):
            logits = self._corrected(base[:, k], previous)
            previous = self.to_target_ids(native.argmax(logits))
            out.append(logits)
            tokens.append(previous)
        if not tokens:
            return previous.new_zeros(previous.shape[0], 0), base
        return torch.stack(tokens, 1), torch.stack(out, 1)

    def _corrected(self, logits: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """One position's backbone logits [B, V'] with the Markov head's correction for the
        token before it, `previous` [B] (target ids)."""
        return logits + self.markov_head(previous).to(logits.dtype)

    def draft_tokens(
        self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, previous: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Greedy draft token ids (target ids) from final hidden states [..., H] (a block's
        [B, n, H] with `previous` [B], the token before it, where the drafter has a Markov head)."""
        if getattr(self, "markov_head", None) is not None and previous is not None:
            fused = None if self.native is None else self.native.greedy(hidden, lm_head_weight, previous)
            return self.markov_chain(hidden, lm_head_weight, previous)[0] if fused is None else fused
        return self.to_target_ids(native.argmax(self.draft_logits(hidden, lm_head_weight)))

    def best_allowed(
        self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, previous: int, mask: torch.Tensor
    ) -> int | None:
        """The most probable token (target id) among those `mask` [vocab] allows at one draft
        position (final hidden state [H]; `previous` the token before it, for a Markov head), or
        None if the drafter's vocabulary holds none of them."""
        logits = self.draft_logits(hidden[None], lm_head_weight)[0]
        if getattr(self, "markov_head", None) is not None:
            logits = self._corrected(logits[None], torch.tensor([previous], device=logits.device))[0]
        vocab = getattr(self, "draft_vocab", None)
        allowed = (mask[vocab.cpu()] if vocab is not None else mask[: logits.shape[0]]).to(logits.device)
        if not bool(allowed.any()):
            return None
        return int(self.to_target_ids(logits.masked_fill(~allowed, float("-inf")).argmax()[None])[0])

    def markov_candidates(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, k: int, previous: torch.Tensor):
        """A Markov-head drafter's candidates for a tree, where each position's distribution
        depends on the token before it. Returns (tokens [B, n, k], probs [B, n, k], children):
        the k most probable tokens (target ids) of each position along the greedy chain
        (position 1's given `previous` [B], the token before the block, hold for every tree),
        and `children(row, d, token)`, the k most probable tokens of block position d + 1
        (0-based d >= 1) given `token` at position d, with their probabilities (lists)."""
        base = self.draft_logits(hidden, lm_head_weight)
        _, logits = self._chain(base, previous)
        top = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)

        def children(row: int, d: int, token: int) -> tuple[list[int], list[float]]:
            prev = torch.tensor([token], device=base.device)
            dist = torch.softmax(self._corrected(base[row, d][None], prev)[0].float(), dim=-1)
            best = dist.topk(k)
            return self.to_target_ids(best.indices).tolist(), best.values.tolist()

        return self.to_target_ids(top.indices), top.values, children

    def draft_candidates(
        self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, k: int, previous: torch.Tensor | None = None
    ):
        """The k most probable draft tokens (target ids) at each position and their
        probabilities, most probable first: ([..., k], [..., k]). With a Markov head (and the
        token before the block, `previous`) only the chain: k = 1, each position's probabilities
        given the token drafted before it."""
        if getattr(self, "markov_head", None) is not None and previous is not None:
            if k != 1:
                raise BlockdraftError(
                    "a drafter with a Markov head has per-branch candidates (each position "
                    "depends on the token before it): use markov_candidates for a tree"
                )
            fused = None if self.native is None else self.native.greedy(hidden, lm_head_weight, previous, probs=True)
            if fused is not None:
                return fused[0][..., None], fused[1][..., None]
            tokens, logits = self.markov_chain(hidden, lm_head_weight, previous)
            probs = torch.softmax(logits.float(), dim=-1).max(-1).values
            return tokens[..., None], probs[..., None]
        probs = torch.softmax(self.draft_logits(hidden, lm_head_weight).float(), dim=-1)
        top = probs.topk(k, dim=-1)
        return self.to_target_ids(top.indices), top.values

    def save(self, folder: str | Path, dtype: torch.dtype | None = None):
        """Write `config.json` + `model.safetensors` atomically (a temp folder, then rename)."""
        if isinstance(self.head, Int8Head):
            raise BlockdraftError(
                "this drafter runs from int8 copies of its weights (inference only): "
                "save the fp32 drafter it was made from"
            )
        write_model_folder(folder, self.config.to_dict(), self.state_dict(), dtype)

    def register_draft_vocab(self, size: int | None):
        if size:
            self.register_buffer("draft_vocab", torch.arange(int(size)))


class DFlashDrafter(DrafterBase):
    kind = "dflash"

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        # DFlash injects the context into every layer. "input" (an ablation, blockdraft-only
        # checkpoints) gives it to the first layer alone, like feeding it at the input.
        mode = cfg.extra.get("blockdraft", {}).get("context_mode", "kv")
        self.context_layers = cfg.num_hidden_layers if mode == "kv" else 1
        # Optional draft vocabulary (blockdraft extension, as in EAGLE-3): the drafter scores
        # only these target token ids, which makes its LM head (the bulk of its cost) smaller.
        draft_vocab = cfg.extra.get("blockdraft", {}).get("draft_vocab_size")
        self.register_draft_vocab(draft_vocab)
        self.markov_head = (
            MarkovHead(cfg.vocab_size, draft_vocab or cfg.vocab_size, cfg.markov_rank) if cfg.markov_rank else None
        )

    def forward(
        self,
        noise_embedding: torch.Tensor,
        positions: torch.Tensor,
        context: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: DraftCache | None = None,
        rows: slice = slice(None),
    ) -> torch.Tensor:
        """Denoise blocks in one pass; returns final-norm hidden states [B, Tq, H].

        noise_embedding [B, Tq, H]: target embeddings of the block tokens at `positions` [B, Tq].
        context [B, C, k*H]: raw target features (captured layers, concatenated) at
        `context_positions` [B, C].

        Training (cache None): keys are [context, blocks]; `mask` [B, 1, Tq, C+Tq] says
        which each query sees (a block: context strictly before its anchor, and itself), or a
        `BlockMask` says the same without scoring other blocks' keys.
        Decoding (cache given): new context (if any) is first written into the cache, then
        every block query sees cached context at positions strictly before its anchor
        (`positions[:, 0]`) plus its whole block; `rows` picks the cache's batch rows.
        """
        if cache is not None and self.native is not None and self.native.fits(cache, rows, positions.shape[1]):
            if context is not None:
                self.write_context(cache, context, context_positions, rows)
            return self.native.block(noise_embedding, positions, cache, rows)
        cos, sin = self.rotary(positions, noise_embedding.dtype)
        if cache is None:
            fused = self.hidden_norm(self.fc(context))
            ctx_cos, ctx_sin = self.rotary(context_positions, noise_embedding.dtype)
        else:
            if context is not None:
                self.write_context(cache, context, context_positions, rows)
            b, t = positions.shape
            used, keys, ctx_mask = cache.context(rows, positions[:, 0])
            ctx_mask = ctx_mask.view(b, 1, 1, used).expand(-1, 1, t, -1)
            mask = torch.cat([ctx_mask, ctx_mask.new_ones(b, 1, t, t)], dim=-1)
        x = noise_embedding
        windowed = {}  # sliding window -> that layer kind's mask (made once per forward)
        for i, layer in enumerate(self.layers):
            if i >= self.context_layers:  # this layer sees its block only
                empty = x.new_zeros(x.shape[0], layer.self_attn.kv_heads, 0, layer.self_attn.head_dim)
                own = mask.own_only() if isinstance(mask, BlockMask) else mask[..., mask.shape[-1] - x.shape[1] :]
                x = layer(x, cos, sin, empty, empty, own)
                continue
            if cache is None:
                ctx_k, ctx_v = layer.self_attn.keys_values(fused, ctx_cos, ctx_sin)
            else:
                ctx_k, ctx_v = cache.k[i, rows, :, :used].to(x.dtype), cache.v[i, rows, :, :used].to(x.dtype)
            window = self.config.window(i)
            if window is not None and window not in windowed:
                key_pos = context_positions if cache is None else keys
                windowed[window] = sliding_mask(mask, positions, key_pos, window)
            x = layer(x, cos, sin, ctx_k, ctx_v, mask if window is None else windowed[window])
        return self.norm(x)

    def write_context(
        self,
        cache: DraftCache,
        context: torch.Tensor,
        positions: torch.Tensor,
        rows: slice = slice(None),
        valid: torch.Tensor | None = None,
    ):
        """Project context features [B, C, k*H] into every layer's cached K/V at their
        positions [B, C], for batch rows `rows` (the KV injection, done once per token).
        `valid` [B]: each row's committed length after this write (needed with a window)."""
        index = torch.arange(positions.shape[0], device=positions.device)[:, None]
        slots = cache.slots(positions, valid)
        if cache.window is not None:
            cache.pos[rows][index, slots] = positions
            cache.pos[rows, cache.window] = -1  # the scratch slot holds nothing
        if self.native is not None and cache.k.dtype == torch.float32 and rows.step in (None, 1):
            return self.native.write_context(cache, context, positions, slots, rows)
        fused = self.hidden_norm(self.fc(context))
        cos, sin = self.rotary(positions, fused.dtype)
        for i, layer in enumerate(self.layers[: self.context_layers]):
            k, v = layer.self_attn.keys_values(fused, cos, sin)
            cache.k[i, rows].transpose(1, 2)[index, slots] = k.transpose(1, 2)
            cache.v[i, rows].transpose(1, 2)[index, slots] = v.transpose(1, 2)

    def new_cache(self, batch: int, max_len: int, window: int | None = None) -> DraftCache:
        w = self.norm.weight  # (fp32 whatever the linears hold: int8 drafters keep fp32 norms)
        if self.native is not None:  # fp32, as `llama_forward` reads a cache, and slots for a block
            return DraftCache(self.config, batch, max_len, torch.float32, w.device, window, self.native.extra_slots)
        return DraftCache(self.config, batch, max_len, w.dtype, w.device, window)

    def check_target(self, target: TargetConfig):
        """Raise a clear error if this drafter was not made for a target shaped like `target`."""
        cfg = self.config
        problems = []
        if cfg.hidden_size != target.hidden_size:
            problems.append(f"hidden size {cfg.hidden_size} != target's {target.hidden_size}")
        if cfg.vocab_size != target.vocab_size:
            problems.append(f"vocab size {cfg.vocab_size} != target's {target.vocab_size}")
        if cfg.num_target_layers != target.num_hidden_layers:
            problems.append(f"made for a {cfg.num_target_layers}-layer target, this one has {target.num_hidden_layers}")
        if any(not 0 <= i < target.num_hidden_layers for i in cfg.target_layer_ids):
            problems.append(f"target_layer_ids {cfg.target_layer_ids} out of range")
        if not 0 <= cfg.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {cfg.mask_token_id} outside the vocabulary")
        if problems:
            raise BlockdraftError("drafter does not match the target: " + "; ".join(problems))

    @classmethod
    def load(cls, folder: str | Path, device=None, dtype: torch.dtype | None = None) -> DFlashDrafter:
        cfg = DraftConfig.from_dict(read_draft_config(folder))
        drafter = load_weights(cls, cfg, folder, device, dtype)
        drafter.folder = Path(folder)  # where it came from (exports to other engines read the files)
        return drafter
