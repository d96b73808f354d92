"""Target model code for the Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM).

gpt-fast style: one decoder written out, a static KV cache preallocated per
layer and addressed by absolute position, and capture of chosen layers' hidden
states during the same forward (the DFlash context feature).

Each batch row is an independent sequence with its own length. A forward writes
the keys/values of its tokens at their positions and lets every query see only
cache slots at positions <= its own. Rolling a sequence back to a committed
length therefore needs no copy: slots past it are never attended and are
overwritten by the next write.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import TargetConfig
from .layers import RMSNorm, Rotary, apply_rotary, attend


class KVCache(nn.Module):
    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: int, rows: slice):
        """Store k/v [B, KV, T, D] of batch rows `rows` at positions [B, T]; return
        those rows' first `used` slots."""
        index = torch.arange(positions.shape[0], device=positions.device)[:, None]
        kc, vc = self.k[rows], self.v[rows]  # views: writes land in the cache
        kc.transpose(1, 2)[index, positions] = k.transpose(1, 2)
        vc.transpose(1, 2)[index, positions] = v.transpose(1, 2)
        return kc[:, :, :used], vc[:, :, :used]


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        # q, k and v in one matmul (fewer, larger kernels: this path is memory-bound on CPU)
        self.qkv_proj = nn.Linear(h, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=cfg.attention_bias)
        # Qwen2 has biases on q/k/v only; Llama's attention_bias covers o_proj too.
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=cfg.attention_bias and cfg.model_type != "qwen2")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.cache: KVCache | None = None

    def forward(self, x, cos, sin, positions, mask, used, rows):
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).view(b, t, -1, self.head_dim).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        k, v = self.cache.write(positions, k, v.transpose(1, 2), used, rows)
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class FusedSwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.hidden = hidden
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.hidden, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def fuse_hf_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map an HF checkpoint's q/k/v and gate/up projections onto our fused ones."""
    out = dict(weights)
    for name in list(weights):
        for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            if f".{parts[0]}." in name:
                names = [name.replace(f".{parts[0]}.", f".{p}.") for p in parts]
                if all(n in weights for n in names):
                    out[name.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat([weights[n] for n in names])
                    for n in names:
                        out.pop(n)
    return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = FusedSwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, positions, mask, used, rows):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, mask, used, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """A causal LM loaded from HF `*ForCausalLM` checkpoints (see `fuse_hf_weights`)."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.max_len = 0

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def setup_caches(self, batch: int, max_len: int):
        """Preallocate KV caches for `batch` sequences of up to `max_len` positions."""
        cfg = self.config
        for layer in self.model.layers:
            layer.self_attn.cache = KVCache(batch, cfg.num_key_value_heads, max_len, cfg.head_dim, self.dtype, self.device)
        self.max_len = max_len

    def ensure_caches(self, batch: int, max_len: int):
        """Reuse the caches when they fit `batch` rows of `max_len` positions, else reallocate."""
        cache = self.model.layers[0].self_attn.cache
        if cache is None or cache.k.shape[0] != batch or self.max_len < max_len:
            self.setup_caches(batch, max_len)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, capture: tuple[int, ...] = (),
                rows: slice = slice(None), features_only: bool = False):
        """Run tokens [B, T] at absolute positions [B, T] through the model, updating the caches
        of batch rows `rows` (all by default; a slice lets one sequence be prefilled alone).

        Returns the final-norm hidden states [B, T, H] (apply `logits` to the rows you need)
        and, if `capture` names layers, their outputs concatenated as [B, T, len(capture)*H]
        (layer i's output is HF's `hidden_states[i + 1]`), else None. `features_only` stops
        after the deepest captured layer (training needs nothing later) and returns None for
        the hidden states.
        """
        used = int(positions.max()) + 1
        x = self.embed(tokens)
        cos, sin = self.rotary(positions, x.dtype)
        mask = self._mask(positions, used)
        captured = {}
        last = max(capture) if features_only and capture else len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers[: last + 1]):
            x = layer(x, cos, sin, positions, mask, used, rows)
            if i in capture:
                captured[i] = x
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return (None if features_only else self.model.norm(x)), features

    def _mask(self, positions: torch.Tensor, used: int) -> torch.Tensor | None:
        window = self.config.sliding_window
        b, t = positions.shape
        if b == 1 and t == 1 and (window is None or used <= window):
            return None  # one query at the newest position sees every slot
        keys = torch.arange(used, device=positions.device)
        query = positions[:, None, :, None]
        mask = keys <= query
        if window is not None:
            mask &= keys > query - window
        return mask
