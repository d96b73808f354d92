"""Building blocks shared by the target models and the DFlash drafter.

RMSNorm, rotary position embeddings (with the Llama-3 and linear scalings) and
the SwiGLU MLP. Each is written once and used by every model in the package.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import BlockdraftError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # (no conversions: each is an op call per layer per step)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of RoPE, with HF's 'default', 'linear' and 'llama3' rules."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise BlockdraftError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")


class Rotary(nn.Module):
    """cos/sin tables indexed by absolute position: `forward(positions)` -> (cos, sin), each
    [B, 1, T, D] (broadcast over heads). The sin table carries the sign of the rotation (its
    first half negated), so `apply_rotary` is x * cos + roll(x, D/2) * sin: four ops.

    The table runs a little past the context length: a verify block may extend
    beyond the last token that can be emitted, and those positions are discarded.
    """

    SLACK = 256

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions + self.SLACK, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", torch.cat([freqs, freqs], dim=-1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([-freqs, freqs], dim=-1).sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, 1, T, D] from `Rotary`. Same values as HF's
    x * cos + rotate_half(x) * sin (rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1, 1])."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def permute_rows_(t: torch.Tensor, order, dim: int = 1) -> torch.Tensor:
    """In place: entry i along `dim` becomes old entry order[i], one permutation cycle at a time
    through a single spare entry. A cache of a GB is then neither reallocated nor copied whole:
    `t[:, order]` made a fresh tensor and page-faulted it in, 0.8-1.9 s for regeneration's
    cache of 128 rows (every 32 steps: 12% of the time)."""
    order = order.tolist() if isinstance(order, torch.Tensor) else list(order)
    done = [False] * len(order)
    for start in range(len(order)):
        if done[start] or order[start] == start:
            continue
        spare = t.select(dim, start).clone()
        cur = start
        while True:
            done[cur] = True
            nxt = order[cur]
            if nxt == start:
                t.select(dim, cur).copy_(spare)
                break
            t.select(dim, cur).copy_(t.select(dim, nxt))
            cur = nxt
    return t


def attention_dtype(dtype: torch.dtype, device) -> torch.dtype:
    """The precision attention runs in (and KV caches are kept in) for weights of `dtype`: fp32
    on CPU for bf16 / fp16 weights, whose products a CPU may run natively while its attention
    kernels in those types do not pay (one decode step of 128 rows over 300 cached slots: 24 ms
    in bf16 against 13 in fp32 on a 2-core AVX512-BF16 CPU); elsewhere the weights' own."""
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


# cuDNN's attention builds a plan per new shape, ~12 ms of host time a call (measured in training on an
# H200: 31 calls a step, most of a 400 ms step); decode lengths and training widths change every step,
# so its plan cache rarely hits. On CUDA attention runs on the flash / memory-efficient / math kernels.
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads. q: [B,H,T,D], k/v: [B,KV,S,D]."""
    if q.is_cuda:
        with sdpa_kernel(_CUDA_BACKENDS):
            return attend_kv_grouped(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def attend_kv_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`attend` with each KV head's query heads folded into its query length (q [B,H,T,D] ->
    [B,KV,G*T,D], a mask [B,1,T,S] -> [B,1,G*T,S]): the same products, no `enable_gqa`. On CUDA
    the memory-efficient kernel takes a mask but not `enable_gqa`, which sends a masked grouped
    call to the math kernel, and that copies every key and value G times."""
    b, h, t, d = q.shape
    kv = k.shape[1]
    if kv == h:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    g = h // kv
    folded = q.reshape(b, kv, g * t, d)  # heads are ordered KV-major: head i uses KV head i // g
    if mask is not None:
        if mask.shape[1] != 1:
            raise BlockdraftError(f"a per-head attention mask {tuple(mask.shape)} cannot be folded")
        mask = mask.expand(mask.shape[0], g, t, mask.shape[-1]).reshape(mask.shape[0], 1, g * t, mask.shape[-1])
    return F.scaled_dot_product_attention(folded, k, v, attn_mask=mask).reshape(b, h, t, d)


def chunked_mask(mask: torch.Tensor, heads_per_kv: int) -> torch.Tensor:
    """A boolean mask [B, 1, T, S] as the additive mask `attend_chunked` takes: [B, 1, G*T, S]
    (0 where allowed, -inf elsewhere), made once per forward and shared by every layer."""
    b, _, t, s = mask.shape
    grouped = mask.expand(b, heads_per_kv, t, s).reshape(b, 1, heads_per_kv * t, s)
    return torch.zeros(grouped.shape, dtype=torch.float32, device=mask.device).masked_fill_(~grouped, float("-inf"))


def attend_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, additive: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Attention whose result for a query does not depend on the other queries of the call
    nor on how many masked key slots follow its own: bit for bit, a token verified in a block
    gets what it got decoded alone. q [B,H,T,D]; k/v [B,KV,S,D] with S a multiple of `chunk`;
    `additive` from `chunked_mask`.

    Why: MKL's products and torch's reductions change their summation order with the length
    of the reduced dimension, so SDPA over 100 keys and over 100 keys + 7 masked ones differ in
    the last bits. Harmless in fp32; with bf16-rounded activations (quantized weights) one
    flipped rounding grows into a different token. Here each query's scores are plain dot
    products over the head dimension (independent of S), the softmax runs over a multiple of 16
    keys (masked ones add exact zeros), and probabilities meet values in fixed chunks of keys
    whose partial sums are added in chunk order (a fully masked chunk adds exact zeros).
    Each query's dot products must also not depend on how many queries share the product:
    every product here has at least `_MIN_ROWS` rows (zero-padded), and MKL's are then
    row-independent for many head shapes (SmolLM2's 9 heads / 3 KV heads / 64 dims among them)
    but not all; `chunked_attention_is_exact` checks a shape."""
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = h // kv
    rows = g * t
    scores = torch.matmul(_at_least_rows(q.reshape(b, kv, rows, d)), k.transpose(-1, -2))[..., :rows, :]
    p = torch.softmax(scores * (d**-0.5) + additive, dim=-1)
    n = s // chunk
    probs = _at_least_rows(p.view(b, kv, rows, n, chunk).transpose(2, 3))
    out = torch.matmul(probs, v.view(b, kv, n, chunk, d))[..., :rows, :].sum(2)
    return out.view(b, h, t, d)


def gathered_keys(
    visible: torch.Tensor, first: torch.Tensor, chunk: int, heads_per_kv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For `attend_gathered`: visible [B, T, S] bool (which cache slots each query sees), first
    [B] each row's first tree slot (its committed length) -> (each query's slots in the order of
    its own sequence: every context slot, then the tree slots it sees, padded to whole chunks
    [B, T, N]; the additive mask over them [B*T, 1, G, N], which hides what `visible` hides)."""
    b, t, s = visible.shape
    slot = torch.arange(s, device=visible.device)
    keep = visible | (slot < first[:, None, None])  # context slots keep their places, seen or not
    n = max(chunk, -(-int(keep.sum(-1).max()) // chunk) * chunk)
    order = torch.where(keep, slot, s + slot).argsort(-1)  # kept slots first, each in slot order
    if n > s:
        order = torch.cat([order, order[..., :1].expand(b, t, n - s)], -1)
    order = order[..., :n]
    valid = visible.gather(2, order.clamp(max=s - 1)) & (
        torch.arange(n, device=visible.device) < keep.sum(-1, keepdim=True)
    )
    return order, chunked_mask(valid.reshape(b * t, 1, 1, n), heads_per_kv)


def attend_gathered(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order: torch.Tensor, additive: torch.Tensor, chunk: int
) -> torch.Tensor:
    """`attend_chunked` for queries that see scattered cache slots (the nodes of a token tree):
    each query's keys and values are first gathered into the order of its own sequence (the
    committed context, then its ancestors, then itself), so it meets them exactly as it would
    decoded alone. q [B, H, T, D]; k/v [B, KV, S, D]; `order`, `additive` from `gathered_keys`."""
    b, h, t, d = q.shape
    kv, n = k.shape[1], order.shape[-1]
    index = order[:, None, :, :, None].expand(b, kv, t, n, d).reshape(b, kv, t * n, d)
    kg, vg = (x.gather(2, index).view(b, kv, t, n, d).transpose(1, 2).reshape(b * t, kv, n, d) for x in (k, v))
    out = attend_chunked(q.transpose(1, 2).reshape(b * t, h, 1, d), kg, vg, additive, chunk)
    return out.view(b, t, h, d).transpose(1, 2)


# MKL takes another kernel for products of 1-3 rows on some CPUs (an AVX2 AMD EPYC: a row's dot
# products then differ in the last bit from the same row among 4+); padding every product that
# `attend_chunked` makes to this many rows keeps one kernel for a query decoded alone or verified.
_MIN_ROWS = 16


def _at_least_rows(x: torch.Tensor) -> torch.Tensor:
    """x with zero rows appended (dim -2) up to `_MIN_ROWS`; the caller slices the result back."""
    short = _MIN_ROWS - x.shape[-2]
    return x if short <= 0 else torch.cat([x, x.new_zeros(*x.shape[:-2], short, x.shape[-1])], dim=-2)


def chunked_attention_is_exact(heads: int, kv_heads: int, head_dim: int, chunk: int, block: int = 16) -> bool:
    """Whether `attend_chunked` gives a query verified among `block` queries bit for bit what it
    gets alone, for this head shape on this machine (random data, several context lengths)."""
    gen = torch.Generator().manual_seed(0)
    for start in (1, chunk - 3, 3 * chunk + 5):
        slots = -(-(start + block) // chunk) * chunk
        q = torch.randn(1, heads, block, head_dim, generator=gen)
        k, v = (torch.randn(1, kv_heads, slots, head_dim, generator=gen) for _ in range(2))
        pos = torch.arange(start, start + block)
        mask = (torch.arange(slots)[None] <= pos[:, None])[None, None]
        together = attend_chunked(q, k, v, chunked_mask(mask, heads // kv_heads), chunk)
        for j in range(block):
            n = -(-(start + j + 1) // chunk) * chunk
            alone = attend_chunked(
                q[:, :, j : j + 1],
                k[:, :, :n],
                v[:, :, :n],
                chunked_mask(mask[:, :, j : j + 1, :n], heads // kv_heads),
                chunk,
            )
            if not torch.equal(alone, together[:, :, j : j + 1]):
                return False
    return True
