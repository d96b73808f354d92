"""Target model code for Qwen3.5: a hybrid of linear attention and gated full attention.

Most layers mix tokens with linear attention (Gated DeltaNet): a causal depthwise
convolution over the q/k/v projection, then per head a recurrent state S [dk, dv] that
each token decays by exp(g) and corrects towards its value by the delta rule,

    S <- exp(g) S;  S <- S + beta k (v - S^T k)^T;  output = S^T q

(q and k L2-normed, q scaled by dk^-1/2), normed per head and gated by silu(z). Every
few layers (`layer_types`) one is full attention with an output gate (sigmoid(gate) * output,
the gate coming from q_proj), q/k norms and rotary embedding on the first dimensions of each
head only. Text-only positions are equal across the three sections of Qwen3.5's multimodal
rope, which then is plain rope over those dimensions. Norms outside the linear attention
scale by 1 + weight.

Linear attention keeps a state per sequence instead of cache slots, so rolling back rejected
drafts needs a copy (see `HybridCache`), and every row of a forward must start where its
committed state is: the decode loop prefills such targets one prompt at a time (no padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BlockdraftError
from .config import TargetConfig
from .layers import RMSNorm, apply_rotary, permute_rows_
from .transformer import FusedSwiGLU, KVCache, Transformer, attend_groups, fuse_hf_weights


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored zero-centred: it scales by 1 + weight (computed in fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class HybridCache:
    """What a hybrid target keeps for `batch` sequences: the keys/values of its attention layers
    (`kv`, slot = position, rolled back for free) and, per linear-attention layer and row, the
    committed conv state `conv` [L, B, K-1, C] (the convolution's last K-1 inputs) and recurrent
    state `state` [L, B, H, dk, dv] (fp32): the states after the row's committed tokens.

    A forward never writes the committed states. Each linear layer leaves in `pending` its conv
    inputs (the committed ones first) and its recurrent state after each token, and `commit`
    copies those at each row's new committed length: rejected drafts are never copied. (Those
    kept states cost T x H x dk x dv fp32 per linear layer and row for a forward of T tokens; the
    fused native step keeps each token's recurrence inputs instead and replays the kept ones.)"""

    def __init__(
        self,
        kv: KVCache,
        layers: int,
        batch: int,
        conv_dim: int,
        kernel: int,
        state_shape: tuple[int, int, int],
        dtype,
        device,
    ):
        self.kv = kv
        self.conv = torch.zeros(layers, batch, kernel - 1, conv_dim, dtype=dtype, device=device)
        self.state = torch.zeros(layers, batch, *state_shape, dtype=torch.float32, device=device)
        self.rows, self.start, self.fresh = slice(None), None, None  # the last forward's rows, their start, start == 0
        self.prefill = False  # the last forward started every row at position 0
        self.pending: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layers

    def begin(self, rows: slice, start: torch.Tensor):
        """A forward of batch rows `rows` starting at positions `start` [B]. Rows at position 0
        start a sequence (from zero states); if all do, it is a prefill of whole prompts, whose
        linear layers keep only their final states (see `GatedDeltaNet`)."""
        self.rows, self.start, self.fresh = rows, start, start == 0
        self.prefill = bool(self.fresh.all())

    def initial(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv and recurrent states linear layer `layer` starts from in this forward: the
        rows' committed ones, zeros for rows that start a sequence."""
        conv, state = self.conv[layer, self.rows], self.state[layer, self.rows]
        return conv.masked_fill(self.fresh[:, None, None], 0), state.masked_fill(self.fresh[:, None, None, None], 0)

    def commit(self, rows: slice, committed: torch.Tensor):
        """Rows `rows` (those of the last forward) keep their first `committed - start` tokens
        of it: the states after them become the committed ones (none kept: unchanged)."""
        kept = committed - self.start
        b, k1 = kept.shape[0], self.conv.shape[2]
        arange = torch.arange(b, device=kept.device)
        for layer, (inputs, states) in enumerate(self.pending):
            t = inputs.shape[1] - k1
            replay = callable(states)  # the fused step's replay of the kept tokens (`native_step.Replay`)
            if not replay and states.shape[1] < t and not bool(((kept == 0) | (kept == t)).all()):
                raise BlockdraftError(
                    "a prefill keeps only its final state: prefill rows of different lengths "
                    "one at a time, and commit every token of it"
                )
            self.conv[layer, rows] = inputs[arange[:, None], kept[:, None] + torch.arange(k1, device=kept.device)]
            if replay:
                states(self.state[layer, rows], kept, self.fresh)
                continue
            # states[:, i] follows token t - S + i of the forward's t (S = t: every token; S = 1: the last)
            picked = states[arange, (kept - 1 - (t - states.shape[1])).clamp(min=0)]
            state = self.state[layer, rows]
            state.copy_(torch.where((kept > 0)[:, None, None, None], picked, state))
        self.pending = [None] * len(self.pending)

    def permute(self, order: torch.Tensor):
        """Reorder the rows: row i becomes old row order[i]."""
        self.kv.permute(order)
        permute_rows_(self.conv, order)
        permute_rows_(self.state, order)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def causal_conv(inputs: torch.Tensor, weight: torch.Tensor, t: int) -> torch.Tensor:
    """Depthwise causal convolution of the last `t` of `inputs` [B, K-1+t, C] (the K-1 inputs
    before them first), weight [C, K]. Summed tap by tap, so that an output does not depend on
    how many tokens the call has."""
    out = inputs[:, :t] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        out = out + inputs[:, j : j + t] * weight[:, j]
    return out


def delta_rule_steps(q, k, v, g, beta, state):
    """The gated delta rule token by token (decode, verify). q, k [B, T, H, dk], v [B, T, H, dv],
    g, beta [B, T, H], state [B, H, dk, dv] (all fp32) -> outputs [B, T, H, dv] and the state
    after each token [B, T, H, dk, dv]. A token's state and output depend only on the state before
    it: the same bits whether it is decoded alone or verified in a block."""
    outs, states = [], []
    for i in range(q.shape[1]):
        state = state * g[:, i].exp()[..., None, None]
        key = k[:, i, :, :, None]
        delta = (v[:, i] - (state * key).sum(-2)) * beta[:, i, :, None]
        state = state + key * delta[:, :, None, :]
        outs.append((state * q[:, i, :, :, None]).sum(-2))
        states.append(state)
    return torch.stack(outs, 1), torch.stack(states, 1)


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same recurrence a chunk of tokens at a time (prefill, training): the same arguments;
    returns the outputs and the final state [B, 1, H, dk, dv].

    Within a chunk, with c the cumulative log decay from its start and S0 the state before it,
    the corrections d_i = beta_i (v_i - (e^(g_i) S_{i-1})^T k_i) solve the unit lower-triangular system
    d_i + sum_{j<i} beta_i e^(c_i - c_j) (k_i.k_j) d_j = beta_i v_i - beta_i e^(c_i) S0^T k_i;
    then output_i = e^(c_i) S0^T q_i + sum_{j<=i} e^(c_i - c_j) (q_i.k_j) d_j and the state after
    the chunk is e^(c_last) S0 + sum_j e^(c_last - c_j) k_j d_j^T. Padding tokens (beta = g = 0)
    leave the state as it is."""
    t = k.shape[1]
    pad = -t % chunk
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)).unflatten(2, (-1, chunk)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)).unflatten(2, (-1, chunk)) for x in (g, beta))
    c = g.cumsum(-1)  # [B, H, N, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is taken as ones
    corrections = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * c.exp()[..., None], upper=False, unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * c.exp()[..., None]
    k_decayed = k * (c[..., -1:] - c).exp()[..., None]
    outs = []
    for n in range(q.shape[2]):
        d = corrections[:, :, n] - reads[:, :, n] @ state
        outs.append(q_decayed[:, :, n] @ state + within[:, :, n] @ d)
        state = state * c[:, :, n, -1].exp()[..., None, None] + k_decayed[:, :, n].transpose(-1, -2) @ d
    return torch.cat(outs, 2)[:, :, :t].transpose(1, 2), state[:, None]


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention (module docstring). Value heads share key heads in groups."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.k_heads, self.v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        keys, values = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.sizes = [keys, keys, values]  # the convolved q, k, v
        # one matmul: the convolution's input (q, k, v), the output gate z, beta's b and the decay's a
        self.parts = [2 * keys + values, values, self.v_heads, self.v_heads]
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.parts), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(2 * keys + values, cfg.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = RMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(values, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cache: HybridCache | None, layer: int) -> torch.Tensor:
        """Without a cache: from zero states, chunked. With one: from the rows' committed states
        (`HybridCache.initial`); a prefill runs chunked and leaves its final states, any other
        forward runs token by token and leaves the states after each token (`HybridCache.pending`)."""
        b, t, _ = x.shape
        mixed, z, beta, a = self.in_proj(x).split(self.parts, dim=-1)
        if cache is None:
            conv = x.new_zeros(b, self.conv_weight.shape[1] - 1, self.parts[0])
            state = x.new_zeros(b, self.v_heads, self.k_dim, self.v_dim, dtype=torch.float32)
        else:
            conv, state = cache.initial(layer)
        inputs = torch.cat([conv, mixed], dim=1)
        q, k, v = F.silu(causal_conv(inputs, self.conv_weight, t)).split(self.sizes, dim=-1)
        group = self.v_heads // self.k_heads
        q = (l2norm(q.float().view(b, t, self.k_heads, self.k_dim)) * self.k_dim**-0.5).repeat_interleave(group, 2)
        k = l2norm(k.float().view(b, t, self.k_heads, self.k_dim)).repeat_interleave(group, 2)
        v = v.float().view(b, t, self.v_heads, self.v_dim)
        beta = beta.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        stepwise = cache is not None and not cache.prefill
        out, states = (delta_rule_steps if stepwise else delta_rule_chunked)(q, k, v, g, beta, state)
        if cache is not None:
            cache.pending[layer] = (inputs, states)
        out = self.norm(out.to(x.dtype)) * F.silu(z.float().view(b, t, self.v_heads, self.v_dim))
        return self.out_proj(out.to(x.dtype).reshape(b, t, -1))


class GatedAttention(nn.Module):
    """Full attention whose q_proj gives each head's query and an output gate: the attention
    output is multiplied by sigmoid(gate) before o_proj. Zero-centred q/k norms; rotary
    embedding on the first `rotary_dim` dimensions of each head."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        h = cfg.hidden_size
        self.qkv_proj = nn.Linear(h, (2 * self.heads + 2 * self.kv_heads) * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=cfg.attention_bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.chunk = 0  # > 0: cached forwards use `attend_chunked` (exact mode), as `Attention`

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(self, x, cos, sin, mask, write, groups=None):
        """As the Llama family's `Attention.forward`."""
        b, t, _ = x.shape
        d = self.head_dim
        query_gate, k, v = self.qkv_proj(x).split([2 * self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, gate = query_gate.view(b, t, self.heads, 2 * d).split(d, dim=-1)  # per head: query, then gate
        q = self.rotate(self.q_norm(q).transpose(1, 2), cos, sin)
        k = self.rotate(self.k_norm(k.view(b, t, self.kv_heads, d)).transpose(1, 2), cos, sin)
        k, v = write(k, v.view(b, t, self.kv_heads, d).transpose(1, 2))
        chunked = self.chunk and mask is not None and (isinstance(mask, tuple) or mask.dtype != torch.bool)
        out = attend_groups(q, k, v, mask, groups, self.chunk if chunked else 0).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(b, t, -1)))


class HybridLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, linear: bool):
        super().__init__()
        self.linear = linear
        if linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = FusedSwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, *inputs):
        """`inputs`: what the token mixer takes besides x (`Qwen3_5.layer_inputs`)."""
        mixer = self.linear_attn if self.linear else self.self_attn
        x = x + mixer(self.input_layernorm(x), *inputs)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridBackbone(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, kind == "linear_attention") for kind in cfg.layer_types)
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def qwen3_5_hf_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF Qwen3.5 checkpoint names -> our parameters. A vision-language checkpoint gives its
    language model (`model.language_model.`; the vision tower and the multi-token-prediction
    head are dropped); the conv1d weight [C, 1, K] becomes [C, K]; projections are fused."""
    out = {}
    for name, w in weights.items():
        if name.startswith(("model.visual.", "mtp.")):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        if name.endswith(".conv1d.weight"):
            name, w = name.replace(".conv1d.weight", ".conv_weight"), w[:, 0]
        out[name] = w
    return fuse_hf_weights(out)


class Qwen3_5(Transformer):
    """A Qwen3.5 causal LM (HF `Qwen3_5ForCausalLM`, or the language model of
    `Qwen3_5ForConditionalGeneration`). The target interface of `Transformer`, with a
    `HybridCache` whose `commit` keeps the linear layers' states at the accepted tokens."""

    backbone = HybridBackbone
    recurrent = True
    from_hf_weights = staticmethod(qwen3_5_hf_weights)

    def __init__(self, cfg: TargetConfig):
        super().__init__(cfg)
        kinds = cfg.layer_types
        self.cache_index = [kinds[:i].count(kind) for i, kind in enumerate(kinds)]  # among layers of its kind

    @property
    def attention_chunk(self) -> int:
        """As `Transformer.attention_chunk`, for the full-attention layers (exact mode)."""
        return next((layer.self_attn.chunk for layer in self.model.layers if not layer.linear), 0)

    def set_attention_chunk(self, chunk: int):
        if chunk and chunk % 16:
            raise ValueError("the attention chunk must be a multiple of 16")
        for layer in self.model.layers:
            if not layer.linear:
                layer.self_attn.chunk = chunk

    def new_cache(self, batch: int, slots: int) -> HybridCache:
        """Keys/values of the attention layers for `batch` sequences of `slots` cache slots each,
        and the linear layers' states."""
        cfg = self.config
        if self.attention_chunk:  # whole attention chunks, as `Transformer.new_cache`
            slots = -(-slots // self.attention_chunk) * self.attention_chunk
        kv = KVCache(
            cfg.layer_types.count("full_attention"),
            batch,
            cfg.num_key_value_heads,
            slots,
            cfg.head_dim,
            self.dtype,
            self.device,
        )
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        )
        return HybridCache(
            kv,
            cfg.layer_types.count("linear_attention"),
            batch,
            conv_dim,
            cfg.linear_conv_kernel_dim,
            (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
            self.dtype,
            self.device,
        )

    def commit(self, cache: HybridCache, rows: slice, committed: torch.Tensor):
        """After every cached forward: rows `rows` (the forward's) now hold `committed` [B]
        tokens; the linear layers keep their states after exactly those (`HybridCache.commit`)."""
        cache.commit(rows, committed)

    def layer_inputs(self, positions, dtype, cache, slots, mask, rows, groups):
        """Attention layers: as `Transformer.layer_inputs`, over the attention caches. Linear
        layers: the cache and their index in it. A cached forward continues every row from its
        committed state (a row at position 0 starts a sequence); `commit` must follow it."""
        attention = super().layer_inputs(
            positions, dtype, None if cache is None else cache.kv, slots, mask, rows, groups
        )
        if cache is not None:
            cache.begin(rows, positions[:, 0])
        index = self.cache_index
        return lambda i: (cache, index[i]) if self.model.layers[i].linear else attention(index[i])
