"""The fused bf16 step: a whole cached forward of a Llama-family target (`native_step.cpp`) or a
Qwen3.5 target (`native_hybrid.cpp`) in one native call, built with blockdraft's bf16 product by
`models.native`.

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
    from .qwen3_5 import GatedAttention, GatedDeltaNet, HybridLayer, Qwen3_5
    from .transformer import DecoderLayer, Transformer

    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    hybrid = type(model) is Qwen3_5
    if type(model).forward is not Transformer.forward or (model.recurrent and not hybrid):
        return "not a Llama-family or Qwen3.5 target"
    if model.device.type != "cpu" or model.dtype != torch.bfloat16:
        return "bf16 on a CPU only"
    cfg = model.config
    if hybrid:
        if cfg.head_dim not in (16, 32, 64, 128, 256) or cfg.rotary_dim % 2 or cfg.linear_value_head_dim > 512:
            return f"head shape {cfg.head_dim} (rotary {cfg.rotary_dim}, linear value {cfg.linear_value_head_dim})"
    elif cfg.rotary_dim != cfg.head_dim or cfg.head_dim not in (16, 32, 64, 128):
        return f"head shape {cfg.head_dim} (rotary {cfg.rotary_dim})"
    for layer in model.model.layers:
        if type(layer) is not (HybridLayer if hybrid else DecoderLayer):
            return "a decoder layer of another kind"
        mixer = (layer.linear_attn if layer.linear else layer.self_attn) if hybrid else layer.self_attn
        if type(mixer) not in (GatedDeltaNet, GatedAttention) and hybrid:
            return "a token mixer of another kind"
        linear = type(mixer) is GatedDeltaNet
        projections = (mixer.in_proj, mixer.out_proj) if linear else (mixer.qkv_proj, mixer.o_proj)
        for lin in (*projections, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if not isinstance(lin, nn.Linear) or lin.weight.dtype != torch.bfloat16:
                return "quantized weights"
        if hybrid and any(lin.bias is not None for lin in (layer.mlp.gate_up_proj, layer.mlp.down_proj)):
            return "MLP biases"
        if linear and any(lin.bias is not None for lin in projections):
            return "linear-attention biases"
    if not native.available():
        return "the native kernels are not available here"
    return None


def step_for(model):
    """The fused step of `model`'s kind (`unsupported(model)` must be None)."""
    from .qwen3_5 import Qwen3_5

    return NativeHybridStep(model) if type(model) is Qwen3_5 else NativeStep(model)


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

    def embed(self, tokens, rows: slice) -> torch.Tensor:
        """The tokens' embeddings, contiguous, for a call on cache rows `rows`."""
        if rows.step not in (None, 1):
            raise ValueError("rows must be a contiguous range")
        return self.model.embed(tokens).contiguous()

    def __call__(
        self, tokens, positions, cache, slots=None, mask=None, rows=slice(None), capture=(), features_only=False
    ):
        model, cfg, x = self.model, self.model.config, self.embed(tokens, rows)
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
    """Whether `step` gives random tokens verified as one block, and (without recurrent layers) as
    a 3-node tree, bit for bit the hidden states and features they get decoded one at a time (a
    check at load)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen)
    capture = (0, model.config.num_hidden_layers - 1)

    def run(cache, start, end, **kw):  # tokens start..end-1, all kept
        out = step(ids[:, start:end], torch.arange(start, end)[None], cache, **kw)
        model.commit(cache, slice(None), torch.tensor([end]))
        return out

    alone = model.new_cache(1, tokens + 2)
    one = [run(alone, i, i + 1, capture=capture) for i in range(tokens)]
    hidden_alone = torch.cat([h for h, _ in one], 1)
    features_alone = torch.cat([f for _, f in one], 1)
    block = model.new_cache(1, tokens + 2)
    run(block, 0, 3)
    hidden, features = run(block, 3, tokens, capture=capture)
    same = torch.equal(hidden, hidden_alone[:, 3:]) and torch.equal(features, features_alone[:, 3:])
    if model.recurrent:  # no trees: linear attention keeps one state per row
        return same
    # a tree after 3 tokens: node 0 = token 3, two children at position 4 (token 4 and another), slots 3, 4, 5
    tree = torch.tensor([[ids[0, 3], (ids[0, 4] + 1) % model.config.vocab_size, ids[0, 4]]])
    mask = torch.zeros(1, 1, 3, 6, dtype=torch.bool)
    mask[..., :3] = True
    mask[0, 0, 0, 3] = mask[0, 0, 1, [3, 4]] = mask[0, 0, 2, [3, 5]] = True
    hidden, _ = step(tree, torch.tensor([[3, 4, 4]]), block, slots=torch.tensor([[3, 4, 5]]), mask=mask)
    return same and torch.equal(hidden[:, [0, 2]], hidden_alone[:, 3:5])


class NativeHybridStep(NativeStep):
    """`Qwen3_5.forward` with a `HybridCache`, in one native call (`native_hybrid.cpp`): chains
    only (slot = position; a mask may hide slots), as the hybrid target's speculation is. It leaves
    the linear layers' conv inputs in `cache.pending` as the eager forward does, with the final
    states of a prefill (every row from position 0), else a `Replay` of the tokens, for
    `Qwen3_5.commit`."""

    def weights(self) -> list[torch.Tensor]:
        """Each layer's 12 tensors in the order `qwen3_5_forward` reads them (empty: absent)."""
        if self._weights is None:
            none = torch.empty(0, dtype=torch.bfloat16)

            def t(p):
                return none if p is None else p.detach().to(torch.bfloat16).contiguous()

            out = []
            for layer in self.model.model.layers:
                if layer.linear:
                    a = layer.linear_attn
                    mixer = [native.pack(a.in_proj.weight), none, t(a.conv_weight.t()), t(a.dt_bias), t(a.A_log)]
                    mixer += [t(a.norm.weight), native.pack(a.out_proj.weight), none]
                else:
                    a = layer.self_attn
                    mixer = [native.pack(a.qkv_proj.weight), t(a.qkv_proj.bias), t(a.q_norm.weight)]
                    mixer += [t(a.k_norm.weight), none, none, native.pack(a.o_proj.weight), t(a.o_proj.bias)]
                m = layer.mlp
                out += [t(layer.input_layernorm.weight), *mixer, t(layer.post_attention_layernorm.weight)]
                out += [native.pack(m.gate_up_proj.weight), native.pack(m.down_proj.weight)]
            self._weights = out
        return self._weights

    def __call__(
        self, tokens, positions, cache, slots=None, mask=None, rows=slice(None), capture=(), features_only=False
    ):
        model, cfg, x = self.model, self.model.config, self.embed(tokens, rows)
        if slots is not None and not torch.equal(slots, positions):
            raise ValueError("a Qwen3.5 target verifies chains only (slot = position)")
        # the slots each token sees: `mask` [B, 1, T, S] as the eager forward takes it, or (empty) every slot
        # up to its own position
        visible = torch.empty(0, dtype=torch.bool) if mask is None else mask[:, 0]
        b, t = tokens.shape
        cache.begin(rows, positions[:, 0])
        layers, k1, conv = cache.conv.shape[0], cache.conv.shape[2], cache.conv.shape[3]
        inputs = torch.empty(layers, b, k1 + t, conv, dtype=cache.conv.dtype)
        none = torch.empty(0)
        if cache.prefill:  # the final states
            states, trace = torch.empty(layers, b, *cache.state.shape[2:]), none
        else:  # each token's k, v, g and beta, replayed up to the kept ones by `commit`
            keys = cfg.linear_num_key_heads * cfg.linear_key_head_dim
            values = cfg.linear_num_value_heads * (cfg.linear_value_head_dim + 2)
            states, trace = none, torch.empty(layers, b, t, keys + values)
        last = max(capture) if features_only and capture else cfg.num_hidden_layers - 1
        hidden, features = native.module().qwen3_5_forward(
            x,
            positions.contiguous(),
            visible,
            cache.kv.k,
            cache.kv.v,
            rows.start or 0,
            model.rotary.cos,
            model.rotary.sin,
            cache.conv,
            cache.state,
            inputs,
            states,
            trace,
            self.weights(),
            [int(layer.linear) for layer in model.model.layers],
            model.model.norm.weight.detach(),
            list(capture),
            last,
            not features_only,
            cfg.rms_norm_eps,
            [
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.rotary_dim,
                cfg.intermediate_size,
                cfg.linear_num_key_heads,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim,
                cfg.sliding_window or 0,
            ],
        )
        if cache.prefill:
            cache.pending = [(inputs[i], states[i][:, None]) for i in range(layers)]
        else:
            cache.pending = [(inputs[i], Replay(trace[i], cfg)) for i in range(layers)]
        return (None if features_only else hidden), (features if capture else None)


class Replay:
    """A linear-attention layer's pending states as the fused step leaves them after a forward that
    is not a prefill: each token's recurrence inputs (k, v, g, beta: 16 KB a token at Qwen3.5-0.8B's
    sizes, against 1 MB for its state). `HybridCache.commit` calls it with the committed states of
    the forward's rows, which it advances in place over each row's kept tokens with the forward's own
    arithmetic (`delta_rule_replay`): the states the forward went through, bit for bit."""

    def __init__(self, trace: torch.Tensor, cfg):
        self.trace, self.cfg = trace, cfg

    def __call__(self, state: torch.Tensor, kept: torch.Tensor, fresh: torch.Tensor):
        cfg = self.cfg
        native.module().delta_rule_replay(
            state, self.trace, kept, fresh, cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        )
