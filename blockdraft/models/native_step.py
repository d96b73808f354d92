"""The fused bf16 step: a whole cached forward of a Llama-family target in one native call
(`native_step.cpp`, built with blockdraft's bf16 product by `models.native`).

Why: in bf16 on a CPU with AVX512-BF16 the eager step of the default target was 25 ms for 4.3 ms
of weights to read: about 2,000 operator calls and 400 dtype conversions a step. The fused step
runs each layer as eight loops over plain buffers.

Exact by construction: each token's arithmetic depends only on its own row and on the cache
slots it sees, visited in slot order (see the source), so a token verified in a block, a batch
or a tree gets bit for bit what it gets decoded alone. `make_exact` turns it on where
`unsupported` finds nothing against it and `row_independent` confirms it on random tokens;
`BLOCKDRAFT_NATIVE_STEP=0` keeps the eager step. It gives other roundings than the eager bf16
forward (each operation rounds once to bf16, rotary included), so it is the step of every cached
forward of the model once on, the plain step and the verify pass alike; forwards without a cache
(training, scoring) stay eager.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from . import native

ENV = "BLOCKDRAFT_NATIVE_STEP"


def unsupported(model) -> str | None:
    """Why `model` cannot run the fused step here (None: it can)."""
    from .transformer import DecoderLayer, Transformer

    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if type(model).forward is not Transformer.forward or getattr(model, "recurrent", True):
        return "not a Llama-family target"
    if model.device.type != "cpu" or model.dtype != torch.bfloat16:
        return "bf16 on a CPU only"
    cfg = model.config
    if cfg.rotary_dim != cfg.head_dim or cfg.head_dim not in (16, 32, 64, 128):
        return f"head shape {cfg.head_dim} (rotary {cfg.rotary_dim})"
    for layer in model.model.layers:
        if type(layer) is not DecoderLayer:
            return "a decoder layer of another kind"
        a, m = layer.self_attn, layer.mlp
        for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj):
            if not isinstance(lin, nn.Linear) or lin.weight.dtype != torch.bfloat16:
                return "quantized weights"
    if not native.available():
        return "the native kernels are not available here"
    return None


class NativeStep:
    """`Transformer.forward` with a cache, in one native call (see the module)."""

    def __init__(self, model):
        self.model = model
        self._weights: list[torch.Tensor] | None = None

    def weights(self) -> list[torch.Tensor]:
        """Each layer's 12 tensors in the order `llama_forward` reads them (empty: absent), the
        products' weights packed once (`native.pack`: a copy, so a target in this step holds its
        layers' weights twice; they are not expected to change after load)."""
        if self._weights is None:
            none = torch.empty(0, dtype=torch.bfloat16)

            def t(p):
                return none if p is None else p.detach().contiguous()

            out = []
            for layer in self.model.model.layers:
                a, m = layer.self_attn, layer.mlp
                out += [
                    t(layer.input_layernorm.weight),
                    native.pack(a.qkv_proj.weight),
                    t(a.qkv_proj.bias),
                    t(a.q_norm.weight if a.q_norm is not None else None),
                    t(a.k_norm.weight if a.k_norm is not None else None),
                    native.pack(a.o_proj.weight),
                    t(a.o_proj.bias),
                    t(layer.post_attention_layernorm.weight),
                    native.pack(m.gate_up_proj.weight),
                    t(m.gate_up_proj.bias),
                    native.pack(m.down_proj.weight),
                    t(m.down_proj.bias),
                ]
            self._weights = out
        return self._weights

    def __call__(
        self, tokens, positions, cache, slots=None, mask=None, rows=slice(None), capture=(), features_only=False
    ):
        model, cfg = self.model, self.model.config
        if rows.step not in (None, 1):
            raise ValueError("rows must be a contiguous range")
        x = model.embed(tokens).contiguous()
        slots = positions if slots is None else slots
        if mask is None:  # every slot up to the token's own position, within the window
            visible, window = torch.empty(0, dtype=torch.bool), cfg.sliding_window or 0
        else:  # [B, 1, T, S] as the eager forward takes it (a window is already in it)
            visible, window = mask[:, 0], 0
        last = max(capture) if features_only and capture else cfg.num_hidden_layers - 1
        hidden, features = native.module().llama_forward(
            x,
            positions,
            slots,
            visible,
            window,
            cache.k,
            cache.v,
            rows.start or 0,
            model.rotary.cos,
            model.rotary.sin,
            self.weights(),
            model.model.norm.weight.detach(),
            list(capture),
            last,
            not features_only,
            cfg.rms_norm_eps,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        )
        return (None if features_only else hidden), (features if capture else None)


def row_independent(model, step: NativeStep, tokens: int = 7) -> bool:
    """Whether `step` gives random tokens verified as one block, and as a 3-node tree, bit for
    bit the hidden states and features they get decoded one at a time (a check at load)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen)
    capture = (0, model.config.num_hidden_layers - 1)
    alone = model.new_cache(1, tokens + 2)
    one = [step(ids[:, i : i + 1], torch.tensor([[i]]), alone, capture=capture) for i in range(tokens)]
    hidden_alone = torch.cat([h for h, _ in one], 1)
    features_alone = torch.cat([f for _, f in one], 1)
    block = model.new_cache(1, tokens + 2)
    step(ids[:, :3], torch.arange(3)[None], block)
    hidden, features = step(ids[:, 3:], torch.arange(3, tokens)[None], block, capture=capture)
    same = torch.equal(hidden, hidden_alone[:, 3:]) and torch.equal(features, features_alone[:, 3:])
    # a tree after 3 tokens: node 0 = token 3, two children at position 4 (token 4 and another), slots 3, 4, 5
    tree = torch.tensor([[ids[0, 3], (ids[0, 4] + 1) % model.config.vocab_size, ids[0, 4]]])
    mask = torch.zeros(1, 1, 3, 6, dtype=torch.bool)
    mask[..., :3] = True
    mask[0, 0, 0, 3] = mask[0, 0, 1, [3, 4]] = mask[0, 0, 2, [3, 5]] = True
    hidden, _ = step(tree, torch.tensor([[3, 4, 4]]), block, slots=torch.tensor([[3, 4, 5]]), mask=mask)
    return same and torch.equal(hidden[:, [0, 2]], hidden_alone[:, 3:5])
