"""A DFlash drafter's decode pass in bf16 on a CPU in three native calls (`models/native_draft.cpp`).

Why: with the target's step fused (`models.native_step`) the eager draft pass was the largest
cost left in a round: about 5 ms on a 2-core AVX512-BF16 CPU against a 10 ms plain step, for
some 30 MB of weights (the KV injection 1.0 ms, the three layers 2.7, the head and the Markov
chain 1.2). Here:

- the KV injection of new context features is `dflash_context` (fc, hidden norm, every layer's
  k/v projection, k norm and rotary, written into the cache);
- the block pass is the target's own `llama_forward`: a drafter layer is a Qwen3 decoder layer
  whose block sees the cached context before its anchor and the whole block. The block's keys
  and values go to slots kept for them past the context's (`DraftCache(extra=...)`), the
  visibility comes as an explicit mask;
- a DSpark drafter's greedy chain (head rows, Markov correction, argmax, position by position)
  is `markov_greedy`.

A drafter only proposes, so its numbers need not equal the eager drafter's bit for bit (they
differ by roundings: attention in fp32 over an fp32 cache, one rounding per operation); what
the target emits never changes. `use_native_draft` turns it on where `unsupported` finds
nothing against it; `BLOCKDRAFT_NATIVE_STEP=0` keeps the eager pass, as it keeps the eager step.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .models import native
from .models.layers import Rotary
from .models.native_step import ENV


def unsupported(drafter) -> str | None:
    """Why `drafter` cannot run the native pass here (None: it can)."""
    from .draft import DFlashDrafter, DraftLayer

    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if type(drafter) is not DFlashDrafter:
        return "not a DFlash drafter"
    cfg = drafter.config
    if drafter.context_layers != cfg.num_hidden_layers:
        return "context fed to the first layer only"
    if any(cfg.window(i) is not None for i in range(cfg.num_hidden_layers)):
        return "sliding-window layers"
    if cfg.head_dim not in (16, 32, 64, 128) or cfg.num_attention_heads % cfg.num_key_value_heads:
        return f"head shape {cfg.head_dim}"
    for layer in drafter.layers:
        if type(layer) is not DraftLayer:
            return "a layer of another kind"
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            if not isinstance(lin, nn.Linear) or lin.weight.dtype != torch.bfloat16 or lin.weight.device.type != "cpu":
                return "bf16 weights on a CPU only"
    if drafter.fc.weight.dtype != torch.bfloat16 or drafter.norm.weight.dtype != torch.bfloat16:
        return "bf16 weights on a CPU only"
    if not native.available():
        return "the native kernels are not available here"
    return None


def _cat(*tensors) -> torch.Tensor:
    """The tensors (biases) concatenated, or an empty bf16 tensor where they are absent."""
    if any(t is None for t in tensors):
        return torch.empty(0, dtype=torch.bfloat16)
    return torch.cat([t.detach() for t in tensors]).contiguous()


class NativeDraft:
    """The native decode pass of one DFlash drafter (see the module). Its weights are packed
    copies made on first use; they are not expected to change after load."""

    def __init__(self, drafter):
        self.drafter = drafter
        cfg = drafter.config
        self.extra_slots = cfg.block_size + 1  # where a block's own keys and values go
        self._layers: list[torch.Tensor] | None = None
        self._context: tuple | None = None
        rotary = drafter.rotary  # fp32 tables (a drafter cast to bf16 whole has bf16 ones: made anew)
        if rotary.cos.dtype != torch.float32:
            rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.cos, self.sin = rotary.cos, rotary.sin

    def layer_weights(self) -> list[torch.Tensor]:
        """Each layer's 12 tensors in the order `llama_forward` reads them."""
        if self._layers is None:
            out = []
            for layer in self.drafter.layers:
                a, m = layer.self_attn, layer.mlp
                out += [
                    layer.input_layernorm.weight.detach(),
                    native.pack(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                    _cat(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias),
                    a.q_norm.weight.detach(),
                    a.k_norm.weight.detach(),
                    native.pack(a.o_proj.weight),
                    _cat(a.o_proj.bias),
                    layer.post_attention_layernorm.weight.detach(),
                    native.pack(torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                    _cat(m.gate_proj.bias, m.up_proj.bias),
                    native.pack(m.down_proj.weight),
                    _cat(m.down_proj.bias),
                ]
            self._layers = out
        return self._layers

    def context_weights(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """fc packed, and each layer's (k/v weight packed, k/v bias, k norm)."""
        if self._context is None:
            kv = []
            for layer in self.drafter.layers:
                a = layer.self_attn
                kv += [
                    native.pack(torch.cat([a.k_proj.weight, a.v_proj.weight])),
                    _cat(a.k_proj.bias, a.v_proj.bias),
                    a.k_norm.weight.detach(),
                ]
            self._context = (native.pack(self.drafter.fc.weight), kv)
        return self._context

    def write_context(self, cache, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, rows: slice):
        """The KV injection of features [B, C, k*H] at `positions` into cache `slots` [B, C]."""
        fc, kv = self.context_weights()
        d = self.drafter
        native.module().dflash_context(
            features.to(torch.bfloat16),
            positions,
            slots,
            cache.k,
            cache.v,
            rows.start or 0,
            self.cos,
            self.sin,
            fc,
            d.hidden_norm.weight.detach(),
            kv,
            d.config.rms_norm_eps,
            d.config.hidden_size,
        )

    def fits(self, cache, rows, width: int) -> bool:
        """Whether a block of `width` runs natively on `cache` (else the eager pass runs)."""
        return cache.extra >= width and rows.step in (None, 1)

    def block(self, x: torch.Tensor, positions: torch.Tensor, cache, rows: slice) -> torch.Tensor:
        """Final-norm hidden states [B, T, H] of blocks x [B, T, H] at `positions` [B, T]: each
        query sees the cached context strictly before its block's anchor (`positions[:, 0]`) and
        the whole block."""
        cfg, d = self.drafter.config, self.drafter
        b, t = positions.shape
        used, _, ctx_mask = cache.context(rows, positions[:, 0])
        first = cache.block_slot
        visible = torch.zeros(b, t, first + t, dtype=torch.bool)
        visible[:, :, :used] = ctx_mask[:, None, :]
        visible[:, :, first:] = True
        slots = (first + torch.arange(t)).expand(b, t)
        hidden, _ = native.module().llama_forward(
            x.to(torch.bfloat16).contiguous(),
            positions,
            slots,
            visible,
            0,
            cache.k,
            cache.v,
            rows.start or 0,
            self.cos,
            self.sin,
            self.layer_weights(),
            d.norm.weight.detach(),
            [],
            cfg.num_hidden_layers - 1,
            True,
            cfg.rms_norm_eps,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        )
        return hidden

    def greedy(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, previous: torch.Tensor, probs: bool = False):
        """A Markov-head drafter's greedy chain over blocks' hidden states [B, n, H] after tokens
        `previous` [B]: target ids [B, n], and with `probs` (tokens, each one's probability
        [B, n] fp32); None where it cannot run natively (the caller's eager chain then runs)."""
        d = self.drafter
        if hidden.dtype != torch.bfloat16 or d.head_weight(lm_head_weight).dtype != torch.bfloat16:
            return None
        vocab = getattr(d, "draft_vocab", None)
        head = d.head.keep("native-packed", lm_head_weight, vocab, lambda: native.pack(d.head_weight(lm_head_weight)))
        # (the key `NativeHead` keeps its packed rows under: one copy for both)
        markov = d.markov_head
        w2 = d.head.keep("markov-w2", markov.markov_w2.weight, None, lambda: native.pack(markov.markov_w2.weight))
        rows = vocab.numel() if vocab is not None else lm_head_weight.shape[0]
        tokens, p = native.module().markov_greedy(
            hidden,
            head,
            rows,
            markov.markov_w1.weight.detach(),
            w2,
            vocab if vocab is not None else torch.empty(0, dtype=torch.long),
            previous.to(torch.long),
            probs,
        )
        if bool((tokens < 0).any()):
            return None
        return (tokens, p) if probs else tokens


def use_native_draft(drafter) -> str:
    """Give `drafter` the native pass where it runs; returns "native" or "eager: <why>"."""
    why = unsupported(drafter)
    drafter.native = None if why else NativeDraft(drafter)
    if drafter.native is not None:  # packed now: a first draft pass that packs is measured as a slow one
        drafter.native.layer_weights()
        drafter.native.context_weights()
    drafter.draft_pass = "native" if why is None else f"eager: {why}"
    return drafter.draft_pass
