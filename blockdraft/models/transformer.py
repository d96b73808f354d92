"""Target model code for the Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM).

gpt-fast style: one decoder written out, and capture of chosen layers' hidden
states during the same forward (the DFlash context feature). The model holds
weights only: a `KVCache` (static buffers, made by `new_cache`) is passed in by
whoever owns the sequences (the decode loop's `DecodeState`).

The target interface, shared by every family: `forward(tokens, positions, cache,
slots=..., mask=...)` -> (final hidden states, captured features), `logits`,
`embed`, `new_cache`, and `commit(cache, rows, ...)` (nothing to do for attention
layers; recurrent layers keep their state at the accepted position there, see `qwen3_5`).

Each batch row is an independent sequence. A forward writes the keys/values of its
tokens into cache slots (by default slot = position) and lets every query see the
slots its mask allows (by default: positions <= its own). Rolling a sequence back
to a committed length therefore needs no copy: slots past it are never attended
and are overwritten by the next write. A tree verify writes siblings at one
position into different slots and passes an explicit mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import TargetConfig
from .layers import (
    RMSNorm,
    Rotary,
    apply_rotary,
    attend,
    attend_chunked,
    attend_gathered,
    attention_dtype,
    chunked_mask,
    gathered_keys,
    permute_rows_,
)


class KVCache:
    """Keys and values of every layer for `batch` sequences of `slots` cache slots each:
    k, v [layers, batch, kv_heads, slots, head_dim], preallocated once."""

    def __init__(self, layers: int, batch: int, kv_heads: int, slots: int, head_dim: int, dtype, device):
        shape = (layers, batch, kv_heads, slots, head_dim)
        dtype = attention_dtype(dtype, device)  # fp32 on CPU for bf16 / fp16 weights
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def slots(self) -> int:
        return self.k.shape[3]

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        used: int,
        rows: slice,
        index: torch.Tensor | None = None,
    ):
        """Store k/v [B, KV, T, D] of batch rows `rows` in cache slots [B, T]; return those
        rows' first `used` slots. `index`: `scatter_index(slots)`, if the caller made it already
        (it is the same for every layer)."""
        if index is None:
            index = self.scatter_index(slots)
        kc, vc = self.k[layer, rows], self.v[layer, rows]  # views: writes land in the cache
        kc.scatter_(2, index, k.to(kc.dtype))
        vc.scatter_(2, index, v.to(vc.dtype))
        return kc[:, :, :used], vc[:, :, :used]

    def scatter_index(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [B, T] -> the [B, KV, T, D] index `scatter_` takes along the slot dimension."""
        b, t = slots.shape
        return slots[:, None, :, None].expand(b, self.k.shape[2], t, self.k.shape[4])

    def permute(self, order: torch.Tensor):
        """Reorder the rows: row i becomes old row order[i]."""
        permute_rows_(self.k, order)
        permute_rows_(self.v, order)


def attend_groups(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    groups: list[tuple[slice, int]] | None,
    chunk: int = 0,
) -> torch.Tensor:
    """Attention of q [B, H, T, D] over k/v [B, KV, S, D]. `groups`: (row range, slots) pairs:
    each range of rows attends to its own first slots only (views, no copies). `chunk` > 0:
    `attend_chunked` with an additive mask."""

    dtype = attention_dtype(q.dtype, q.device)
    if dtype != q.dtype:  # bf16 / fp16 on CPU: attention in fp32 (`attention_dtype`), the result back
        return attend_groups(q.to(dtype), k.to(dtype), v.to(dtype), mask, groups, chunk).to(q.dtype)
    if isinstance(mask, tuple):  # a tree under exact attention: each query's keys gathered first
        return attend_gathered(q, k, v, *mask, chunk)

    def run(q, k, v, mask):
        return attend_chunked(q, k, v, mask, chunk) if chunk else attend(q, k, v, mask)

    if groups is None:
        return run(q, k, v, mask)
    return torch.cat(
        [run(q[r], k[r, :, :u], v[r, :, :u], None if mask is None else mask[r, ..., :u]) for r, u in groups]
    )


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
        self.chunk = 0  # > 0: cached forwards use `attend_chunked` with chunks of this many keys

    def forward(self, x, cos, sin, mask, write, groups=None):
        """`write(k, v)` stores this layer's new keys/values in the cache and returns the
        keys/values to attend to (or, without a cache, returns them unchanged). `groups`:
        (row range, slots) pairs: each range of rows attends to its own first slots only."""
        b, t, _ = x.shape
        qkv = self.qkv_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, heads, T, D]
        if self.q_norm is not None:
            q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
            q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)
        else:  # q and k rotated in one go
            q, k = apply_rotary(qkv[:, : self.heads + self.kv_heads], cos, sin).split(
                [self.heads, self.kv_heads], dim=1
            )
            v = qkv[:, self.heads + self.kv_heads :]
        k, v = write(k, v)
        chunked = self.chunk and mask is not None and (isinstance(mask, tuple) or mask.dtype != torch.bool)
        out = attend_groups(q, k, v, mask, groups, self.chunk if chunked else 0)
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


# HF projections that read the same input -> our one fused projection (Qwen3.5's linear
# attention has four: q/k/v, its output gate z, beta's b and the decay's a)
FUSED = (
    (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (("gate_proj", "up_proj"), "gate_up_proj"),
    (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), "in_proj"),
)


def fuse_hf_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map an HF checkpoint's projections onto our fused ones (`FUSED`)."""
    out = dict(weights)
    for name in list(weights):
        for parts, fused in FUSED:
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

    def forward(self, x, cos, sin, mask, write, groups=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, write, groups)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """A causal LM loaded from HF `*ForCausalLM` checkpoints of the Llama family."""

    from_hf_weights = staticmethod(fuse_hf_weights)  # HF checkpoint names -> our fused parameters
    backbone = Backbone  # the embedding, decoder layers and final norm
    recurrent = False  # no layer keeps a state per sequence besides its cache slots (see `qwen3_5`)
    native_step = None  # a `models.native_step.NativeStep` runs every cached forward when set (`make_exact`)

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        self.model = self.backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations and of the KV cache (quantized weights keep their own)."""
        return self.model.norm.weight.dtype

    @property
    def attention_chunk(self) -> int:
        """0: attention by SDPA. C > 0: cached forwards use `attend_chunked` (bit-identical for a
        token whether it is decoded alone or verified in a block), reading keys in chunks of C
        slots. Quantized weights turn it on (`models.quant`)."""
        layers = self.model.layers
        return layers[0].self_attn.chunk if len(layers) else 0

    def set_attention_chunk(self, chunk: int):
        if chunk and chunk % 16:
            raise ValueError("the attention chunk must be a multiple of 16")
        for layer in self.model.layers:
            layer.self_attn.chunk = chunk

    @torch.inference_mode()
    def warm_up(self, max_rows: int):
        """One forward of each row count the packed products bucket by (`packed.DEFAULT_SIZES`)
        up to `max_rows`: a bucket's kernel is measured and its weights packed on first use,
        and that one-off cost would otherwise land in the first step measured at that width,
        where a cost model (the server's speculation policy) keeps it."""
        from .packed import DEFAULT_SIZES

        for rows in (r for r in DEFAULT_SIZES if r <= max_rows):
            ids = torch.zeros(1, rows, dtype=torch.long, device=self.device)
            hidden, _ = self(ids, torch.arange(rows, device=self.device)[None], self.new_cache(1, rows))
            self.logits(hidden[0])

    def new_cache(self, batch: int, slots: int) -> KVCache:
        """Preallocated keys/values for `batch` sequences of `slots` cache slots each (rounded up
        to whole attention chunks)."""
        cfg = self.config
        if self.attention_chunk:
            slots = -(-slots // self.attention_chunk) * self.attention_chunk
        return KVCache(
            cfg.num_hidden_layers, batch, cfg.num_key_value_heads, slots, cfg.head_dim, self.dtype, self.device
        )

    def commit(self, cache: KVCache, rows: slice, committed: torch.Tensor):
        """Called once the verified tokens of `rows` are settled (`committed` [B] tokens each).
        Attention layers keep nothing besides their cache slots, so there is nothing to do."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        *,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        rows: slice = slice(None),
        groups: list[tuple[slice, int]] | None = None,
        capture: tuple[int, ...] = (),
        features_only: bool = False,
    ):
        """Run tokens [B, T] at absolute positions [B, T].

        Without a cache the tokens attend among themselves (causally by position: training
        and scoring). With one, their keys/values are written into `cache` rows `rows` at
        `slots` [B, T] (default: their positions) and each query attends to the cache slots
        `mask` [B, 1, T, S] allows (default: slots at positions <= its own, with slot =
        position). Returns the final-norm hidden states [B, T, H] (apply `logits` to the
        rows you need) and, if `capture` names layers, their outputs concatenated as
        [B, T, len(capture)*H] (layer i's output is HF's `hidden_states[i + 1]`), else None.
        `features_only` stops after the deepest captured layer and returns None for the
        hidden states (training needs nothing later). `groups` [(row range, slots), ...] splits
        attention by ranges of rows, each reading only the cache slots it needs (rows sorted
        by length then skip the padding up to the longest row).
        """
        if cache is not None and self.native_step is not None:
            return self.native_step(tokens, positions, cache, slots, mask, rows, capture, features_only)
        x = self.embed(tokens)
        inputs = self.layer_inputs(positions, x.dtype, cache, slots, mask, rows, groups)
        captured = {}
        last = max(capture) if features_only and capture else len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers[: last + 1]):
            x = layer(x, *inputs(i))
            if i in capture:
                captured[i] = x
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return (None if features_only else self.model.norm(x)), features

    def layer_inputs(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        cache: KVCache | None,
        slots: torch.Tensor | None,
        mask: torch.Tensor | None,
        rows: slice,
        groups: list[tuple[slice, int]] | None,
    ):
        """`inputs(i)`: what layer i takes besides its hidden states in a forward (see `forward`):
        the rotary cos/sin, the attention mask, its `write(k, v)` (store its keys/values in the
        cache and return those to attend to) and the attention groups."""
        cos, sin = self.rotary(positions, dtype)
        if cache is None:
            mask = self.attention_mask(positions, positions) if mask is None else mask

            def writer(i):
                return lambda k, v: (k, v)
        else:
            slots = positions if slots is None else slots
            used = int(slots.max()) + 1
            chunk = self.attention_chunk
            if chunk:  # whole chunks of keys; the slots past a query's own are masked
                used = min(-(-used // chunk) * chunk, cache.slots)
                if mask is not None and mask.shape[-1] < used:
                    mask = F.pad(mask, (0, used - mask.shape[-1]), value=False)
                if groups is not None:
                    groups = [(r, min(-(-u // chunk) * chunk, used)) for r, u in groups]
            if mask is None:
                keys = torch.arange(used, device=positions.device).expand(positions.shape[0], -1)
                mask = self.attention_mask(positions, keys, always=bool(chunk))
            if chunk:
                per_kv = self.config.num_attention_heads // self.config.num_key_value_heads
                if torch.equal(slots, positions):  # chains: every query sees slots 0..its own
                    mask = chunked_mask(mask[..., :used], per_kv)
                else:  # a tree: nodes sit in other slots than their positions
                    mask, groups = gathered_keys(mask[:, 0, :, :used], slots[:, 0], chunk, per_kv), None

            index = cache.scatter_index(slots)  # once for every layer

            def writer(i):
                return lambda k, v: cache.write(i, slots, k, v, used, rows, index)

        return lambda i: (cos, sin, mask, writer(i), groups)

    def attention_mask(
        self, query_positions: torch.Tensor, key_positions: torch.Tensor, always: bool = False
    ) -> torch.Tensor | None:
        """[B, 1, T, S]: a query sees keys at positions <= its own (within the sliding window);
        None when that is everything (one query at the newest position), unless `always`."""
        window = self.config.sliding_window
        b, t = query_positions.shape
        if not always and b == 1 and t == 1 and (window is None or key_positions.shape[-1] <= window):
            return None  # one query at the newest position sees every slot
        query = query_positions[:, None, :, None]
        keys = key_positions[:, None, None, :]
        mask = keys <= query
        if window is not None:
            mask &= keys > query - window
        return mask
