"""Quantized target weights: the GGUF file's own 4-bit and 8-bit values, run by torch's CPU kernels.

The default target ships as a GGUF whose 210 linear layers are Q4_1 (groups of 32 along the
input: w = d * q + m, q in 0..15, d and m fp16) and whose tied embedding is Q8_0 (groups of
32: w = d * q, q in -128..127). Our fp32 weights are their de-quantization. `quantize_target`
swaps the target's linear layers for ones that keep the integers:

- Q4_1 linears -> `Int4Linear`: torch's int4 weight-only matmul (`_weight_int4pack_mm_for_cpu`,
  the kernel gpt-fast uses), whose rule is w = (q - 8) * scale + zero per group of 32, with
  scale and zero in bf16. Q4_1 maps onto it exactly up to bf16 rounding: scale = d,
  zero = m + 8 d. The integers are the file's.
- The Q8_0 output head -> `Int8Linear`: torch's int8 weight-only matmul
  (`_weight_int8pack_mm`) has one scale per output row, not per group of 32, so each row is
  re-quantized to int8 with the row's largest group scale (the nearest that kernel allows).
  The input embedding keeps the file's exact Q8_0 values (a lookup de-quantizes its rows).

Both kernels take bf16 inputs; norms, attention and the residual stream stay fp32.
`max_weight_error` reports how far the weights in use are from the file's de-quantization.
On this CPU the bf16 int4/int8 kernels run a one-row product ~1.6-2.2x faster than the fp32
one and read 5-8x fewer bytes (fp32 inputs hit a slow reference path: never use them).

Targets that are not loaded from a GGUF are quantized here with ggml's Q4_1 rule (per group:
m = min, d = (max - min) / 15, q = round((w - m) / d)).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn

from ..errors import BlockdraftError
from .exact import ATTENTION_CHUNK, attention_is_exact

GROUP = 32
INNER_K_TILES = 8  # the packing granularity torch's int4 CPU kernel takes (2, 4 or 8)
QUANTIZED = ("q4_1",)  # the quantized formats `Engine.load(dtype=...)` accepts


def dequantize_groups(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, K] integers, d (and m) [N, K/32] -> d * q (+ m) per group of 32, fp32 [N, K]."""
    n = q.shape[0]
    w = q.float().view(n, -1, GROUP) * d[..., None]
    return (w if m is None else w + m[..., None]).view(q.shape)


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W stored as 4-bit integers and bf16 scale/zero per group of 32."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None):
        """q [N, K] integers 0..15; d, m [N, K/32]: w = d * q + m (Q4_1)."""
        super().__init__()
        n, k = q.shape
        if k % GROUP or n % 16:
            raise BlockdraftError(f"int4 weights need rows divisible by 16 and columns by {GROUP}, got {n}x{k}")
        self.in_features, self.out_features = k, n
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INNER_K_TILES)
        )
        scales_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1)  # [K/32, N, 2]
        self.register_buffer("scales_zeros", scales_zeros.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", bias)

    @staticmethod
    def weight_in_use(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """The [N, K] weight the kernel multiplies by for Q4_1 values q, d, m (bf16 scale/zero)."""
        scale, zero = d.to(torch.bfloat16).float(), (m + 8 * d).to(torch.bfloat16).float()
        return dequantize_groups(q.float() - 8, scale, zero)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as int8 and one bf16 scale per output row."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8.contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """Symmetric per-row int8 of an fp32 weight (`quantize_rows_int8`)."""
        return cls(*quantize_rows_int8(weight.detach()), bias)

    def dequantized(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scales.float()[:, None]

    @property
    def weight(self) -> torch.Tensor:
        """The weight in use as fp32, made once (drafters read rows of the target's head)."""
        cached = getattr(self, "_weight", None)
        if cached is None:
            cached = self._weight = self.dequantized()
        return cached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (int8 [N, K], bf16 scales [N]): w ~ q * scale with scale = max|row| / 127
    rounded to bf16 first, so the weight in use is exactly q * scale (error <= scale / 2 per entry)."""
    scale = (w.abs().amax(1).float() / 127).clamp_min(torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
    q = (w.float() / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


# what `Engine.load(draft_weights=...)` accepts: "float" = the target's floating dtype
DRAFT_WEIGHTS = ("auto", "float", "int8", "bf16")


def without_bf16(device: torch.device, dtype: torch.dtype) -> str:
    """The drafter weights `draft_weights="auto"` picks where bf16 is not an option: "int8" for fp32
    drafters on CPU where torch has the kernel, else "float"."""
    return "int8" if device.type == "cpu" and dtype == torch.float32 and int4_available() else "float"


def quantize_linears(module: nn.Module) -> int:
    """Swap a module's linear layers for `Int8Linear`s in place (CPU, inference only); returns
    how many were swapped. For drafters (`draft_head.quantize_drafter` adds their LM-head rows)."""
    if not int4_available():
        raise BlockdraftError("this torch build has no int8 CPU weight kernel (torch >= 2.6 needed)")
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if child.weight.device.type != "cpu":
                    raise BlockdraftError("int8 drafter weights run on CPU (torch's int8 CPU kernel)")
                setattr(parent, name, Int8Linear.from_float(child.weight, child.bias))
                swapped += 1
    return swapped


class Q8Embedding(nn.Module):
    """An embedding table of Q8_0 values (int8 + one scale per group of 32), exact."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, dtype=torch.float32):
        super().__init__()
        self.register_buffer("q", q.to(torch.int8).contiguous())
        self.register_buffer("d", d.float().contiguous())
        self.dtype = dtype

    def dequantized(self) -> torch.Tensor:
        return dequantize_groups(self.q, self.d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        q, d = self.q[tokens].float(), self.d[tokens]
        return (q.view(*q.shape[:-1], -1, GROUP) * d[..., None]).flatten(-2).to(self.dtype)


# ---- reading the GGUF's blocks -------------------------------------------------------------


def q4_1_blocks(raw: np.ndarray, rows: int, cols: int):
    """Raw Q4_1 bytes [rows, cols/32 * 20] -> q [rows, cols] uint8, d and m [rows, cols/32] fp32."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # element j, then j + 16
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)


def q8_0_blocks(raw: np.ndarray, rows: int, cols: int):
    """Raw Q8_0 bytes [rows, cols/32 * 34] -> q [rows, cols] int8, d [rows, cols/32] fp32."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return torch.from_numpy(q), torch.from_numpy(d)


def unpermute_rows(heads: int, rows: int) -> torch.Tensor:
    """llama.cpp stores q/k projection rows permuted for its rope layout; index i of the result
    is the GGUF row holding HF row i."""
    perm = torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)
    return torch.argsort(perm)


def quantize_q4_1(w: torch.Tensor):
    """ggml's Q4_1 rule on an fp32 weight [N, K] -> q, d, m (fp16-rounded d and m, as in the file)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((g - m[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    return q, d, m


def requantize_rows_int8(q: torch.Tensor, d: torch.Tensor):
    """Q8_0 (q int8 [N, K], d [N, K/32]) -> int8 [N, K] with one scale per row (the row's largest
    group scale), the nearest representation torch's int8 kernel takes."""
    scale = d.amax(-1).clamp_min(1e-12)
    q8 = (dequantize_groups(q, d) / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q8, scale


# ---- swapping a target's layers ------------------------------------------------------------


def gguf_tensors(path) -> dict:
    """The GGUF file's tensors by name (`gguf.ReaderTensor`: shape, type, raw data)."""
    import gguf

    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def quantize_target(model, gguf_file=None) -> dict:
    """Swap `model`'s linear layers (and output head) for quantized ones, in place.

    With `gguf_file` (the default target's Q4_1 file) the integers and scales are the file's;
    otherwise the fp32 weights are quantized with the Q4_1 rule. Returns a summary
    (layers swapped, max |w_in_use - w_file|) for reports."""
    if not int4_available():
        raise BlockdraftError("this torch build has no int4/int8 CPU weight kernels (torch >= 2.6 needed)")
    if model.device.type != "cpu":
        raise BlockdraftError("q4_1 weights run on CPU (torch's int4 CPU kernels)")
    if getattr(model, "recurrent", False):
        raise BlockdraftError("quantized weights are not supported for Qwen3.5 (hybrid linear-attention) targets")
    # bf16-rounded activations turn last-bit differences between a token decoded alone and the
    # same token verified in a block into different tokens: use the attention that has none
    model.set_attention_chunk(ATTENTION_CHUNK)
    cfg = model.config
    tensors = gguf_tensors(gguf_file) if gguf_file else None
    swapped, worst = 0, 0.0
    # our fused linear -> the GGUF tensors it concatenates (with the heads of rope-permuted rows)
    parts = {
        ("self_attn", "qkv_proj"): [
            ("attn_q", cfg.num_attention_heads),
            ("attn_k", cfg.num_key_value_heads),
            ("attn_v", None),
        ],
        ("self_attn", "o_proj"): [("attn_output", None)],
        ("mlp", "gate_up_proj"): [("ffn_gate", None), ("ffn_up", None)],
        ("mlp", "down_proj"): [("ffn_down", None)],
    }
    for i, layer in enumerate(model.model.layers):
        for (block, attr), names in parts.items():
            owner = getattr(layer, block)
            linear = getattr(owner, attr)
            if tensors is None:
                q, d, m = quantize_q4_1(linear.weight.detach())
            else:
                qs, ds, ms = [], [], []
                for name, heads in names:
                    t = tensors[f"blk.{i}.{name}.weight"]
                    if t.tensor_type.name != "Q4_1":
                        raise BlockdraftError(f"blk.{i}.{name}: expected Q4_1, the file has {t.tensor_type.name}")
                    cols, rows = (int(x) for x in t.shape)
                    q, d, m = q4_1_blocks(t.data, rows, cols)
                    if heads is not None:
                        order = unpermute_rows(heads, rows)
                        q, d, m = q[order], d[order], m[order]
                    qs.append(q), ds.append(d), ms.append(m)
                q, d, m = torch.cat(qs), torch.cat(ds), torch.cat(ms)
            quant = Int4Linear(q, d, m, None if linear.bias is None else linear.bias.detach())
            exact = dequantize_groups(q, d, m)
            worst = max(worst, (Int4Linear.weight_in_use(q, d, m) - exact).abs().max().item())
            setattr(owner, attr, quant)
            swapped += 1
    # the output head (tied to the embedding in the default target)
    if tensors is not None:
        t = tensors["token_embd.weight"] if cfg.tie_word_embeddings else tensors["output.weight"]
        if t.tensor_type.name != "Q8_0":
            raise BlockdraftError(f"{t.name}: expected Q8_0, the file has {t.tensor_type.name}")
        cols, rows = (int(x) for x in t.shape)
        q8, d8 = q8_0_blocks(t.data, rows, cols)
        if cfg.tie_word_embeddings:
            model.model.embed_tokens = Q8Embedding(q8, d8)
    else:
        w = model.lm_head.weight.detach().float()
        d8 = (w.view(w.shape[0], -1, GROUP).abs().amax(-1) / 127).half().float()
        q8 = (w.view(w.shape[0], -1, GROUP) / d8.clamp_min(1e-12)[..., None]).round().clamp(-127, 127)
        q8 = q8.to(torch.int8).view(w.shape)
    head = Int8Linear(*requantize_rows_int8(q8, d8))
    exact = dequantize_groups(q8, d8)
    head_error = (head.dequantized() - exact).abs().max().item()
    model.lm_head = head
    exact = attention_is_exact(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    if not exact:
        warnings.warn(
            f"q4_1: on this machine attention for {cfg.num_attention_heads} heads of {cfg.head_dim} is not "
            "bit-identical between a token decoded alone and verified in a block; speculative "
            "decoding may then differ from plain decoding where two tokens nearly tie",
            stacklevel=2,
        )
    model.quantization = {
        "format": "q4_1",
        "linears": swapped,
        "source": "gguf" if tensors else "fp32",
        "max_linear_error": worst,
        "max_head_error": head_error,
        "exact_attention": exact,
    }
    return model.quantization
