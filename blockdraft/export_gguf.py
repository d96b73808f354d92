"""A DFlash drafter as the GGUF file llama.cpp's own DFlash runs (`--spec-type draft-dflash`).

llama.cpp's drafter GGUF (architecture "dflash") holds the drafter's layers, `fc`, the
context norm and the final norm, in llama.cpp's tensor names; it borrows the target's token
embedding and, for a full-vocabulary drafter, its LM head. A drafter with a draft vocabulary
carries it as `d2t` (I64, the target id of each draft row) and its own `output.weight` (the
target head's rows for those ids): llama.cpp scatters those logits into the full vocabulary,
so its drafts are the same tokens as ours. The metadata is what llama.cpp's loader reads:
the usual transformer sizes, `dflash.block_size`, `dflash.target_layers` and the mask token.
The tokenizer is copied from the target's GGUF (llama.cpp checks that the two match).
A drafter with a Markov head adds `markov_w1` / `markov_w2` and `dflash.sample_from_anchor`
false (our blocks draft from the slot after the anchor): llama.cpp then runs it as draft-dspark,
the chain greedy on the token drafted before, as ours.

llama.cpp numbers a target layer by its INPUT: our layer id i (the output of layer i, HF
`hidden_states[i + 1]`) is written as i + 1, so the target's last layer cannot be one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .draft import DFlashDrafter
from .draft_config import read_draft_config
from .errors import BlockdraftError
from .models.gguf import _gguf, copy_fields, gguf_file

ARCH = "dflash"
WEIGHT_TYPES = ("F16", "BF16", "Q8_0", "F32")
# our weight names -> llama.cpp's (per layer, then the drafter's own)
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    # a Markov head (llama.cpp runs a drafter GGUF holding these as draft-dspark)
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
}


def gguf_name(name: str) -> str:
    """Our drafter weight name -> llama.cpp's tensor name."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".")
    if parts[0] == "layers" and ".".join(parts[2:-1]) in LAYER_NAMES:
        return f"blk.{parts[1]}.{LAYER_NAMES['.'.join(parts[2:-1])]}.{parts[-1]}"
    raise BlockdraftError(f"no llama.cpp name for drafter weight {name!r}")


def check_runnable(cfg, target_layers: int) -> None:
    """Raise a clear error for what llama.cpp's DFlash cannot run."""
    last = target_layers - 1
    if any(i >= last for i in cfg.target_layer_ids):
        raise BlockdraftError(
            f"target layer ids {list(cfg.target_layer_ids)}: llama.cpp reads the INPUT of layer id + 1, and the "
            f"target's last layer ({last}) has no next layer; retrain with ids below {last}"
        )
    if cfg.attention_bias:
        raise BlockdraftError("llama.cpp's DFlash drafter has no attention biases (attention_bias=true)")
    if cfg.rope_scaling:
        raise BlockdraftError(f"rope scaling {cfg.rope_scaling} is not written to the drafter GGUF (plain RoPE only)")
    types = cfg.layer_types or []
    if any(t not in ("full_attention", "sliding_attention") for t in types):
        raise BlockdraftError(f"unknown layer types {sorted(set(types))}")
    if "sliding_attention" in types and not cfg.sliding_window:
        raise BlockdraftError("sliding_attention layers without a sliding_window")


def _tensor(gguf, t: torch.Tensor, weight_type: str):
    """(numpy data, raw type or None) for one tensor: 1-D tensors stay F32 (llama.cpp's norms)."""
    x = t.detach().float().cpu()
    if x.dim() < 2 or weight_type == "F32":
        return x.numpy(), None
    if weight_type == "F16":
        return x.half().numpy(), None
    qtype = gguf.GGMLQuantizationType[weight_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if x.shape[-1] % block:  # rows that do not split into quant blocks stay F16
        return x.half().numpy(), None
    return gguf.quants.quantize(x.numpy(), qtype), qtype


def export_gguf_drafter(
    src: str | Path, out: str | Path, target_gguf: str | Path, weight_type: str = "F16", full_vocab: bool = False
) -> dict:
    """Write DFlash drafter folder `src` as llama.cpp's drafter GGUF `out`, weights as
    `weight_type` (F16 / BF16 / Q8_0 / F32; norms stay F32). `target_gguf`: the target's GGUF
    (its tokenizer is copied, its sizes are checked, and a draft vocabulary's head rows are
    taken from its LM head). `full_vocab`: leave a draft vocabulary out (llama.cpp then scores
    the whole vocabulary with the target's head). Returns a summary."""
    gguf = _gguf()
    if weight_type not in WEIGHT_TYPES:
        raise BlockdraftError(f"weight type {weight_type!r}: choose one of {', '.join(WEIGHT_TYPES)}")
    read_draft_config(src)  # a clear error for anything else (e.g. an EAGLE-3 drafter)
    drafter = DFlashDrafter.load(src)
    cfg = drafter.config
    if (cfg.extra.get("blockdraft") or {}).get("context_mode", "kv") != "kv":
        raise BlockdraftError(f"{src}: an ablation drafter (context fed at the input) has no llama.cpp equivalent")
    target_gguf = Path(target_gguf)
    if not target_gguf.is_file():
        raise BlockdraftError(f"target GGUF not found: {target_gguf}")
    reader = gguf.GGUFReader(str(target_gguf))
    tarch = reader.fields["general.architecture"].contents()

    def target_key(key):
        field = reader.fields.get(f"{tarch}.{key}")
        return None if field is None else field.contents()

    sizes = {"block_count": cfg.num_target_layers, "embedding_length": cfg.hidden_size}
    for key, want in sizes.items():
        if target_key(key) != want:
            raise BlockdraftError(
                f"{target_gguf.name}: {key} {target_key(key)} but the drafter was trained on a "
                f"target with {want}: not this drafter's target"
            )
    check_runnable(cfg, cfg.num_target_layers)
    if cfg.sample_from_anchor and not cfg.markov_rank:
        raise BlockdraftError(
            f"{src}: a drafter in DSpark's block layout without a Markov head has no llama.cpp "
            "equivalent (its DFlash drafter drafts from the slot after the anchor)"
        )

    state = drafter.state_dict()
    vocab = state.pop("draft_vocab", None)
    if full_vocab:
        if vocab is not None and "markov_head.markov_w2.weight" in state:  # its rows spread over the vocabulary
            rows = state["markov_head.markov_w2.weight"]
            full = rows.new_zeros(cfg.vocab_size, rows.shape[1])
            full[vocab] = rows  # tokens outside the draft vocabulary get no correction, as llama.cpp scatters it
            state["markov_head.markov_w2.weight"] = full
        vocab = None
    out = Path(out)
    with gguf_file(out, ARCH) as w:
        w.add_name(f"{Path(src).name} (DFlash drafter, blockdraft)")
        w.add_file_type(
            int(
                {
                    "F32": gguf.LlamaFileType.ALL_F32,
                    "F16": gguf.LlamaFileType.MOSTLY_F16,
                    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
                    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                }[weight_type]
            )
        )
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_freq_base(float(cfg.rope_theta))
        w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
        w.add_uint32(f"{ARCH}.block_size", cfg.block_size)
        w.add_array(f"{ARCH}.target_layers", [int(i) + 1 for i in cfg.target_layer_ids])
        if cfg.markov_rank:  # the block layout: does the anchor slot draft (DSpark's) or not (DFlash's)
            w.add_bool(f"{ARCH}.sample_from_anchor", bool(cfg.sample_from_anchor))
            w.add_bool(f"{ARCH}.has_confidence_head", False)
        if cfg.layer_types and "sliding_attention" in cfg.layer_types:
            w.add_sliding_window(int(cfg.sliding_window))
            w.add_array(f"{ARCH}.attention.sliding_window_pattern", [t == "sliding_attention" for t in cfg.layer_types])
        copy_fields(reader, w, lambda name: name.startswith("tokenizer."))
        w.add_uint32("tokenizer.ggml.mask_token_id", int(cfg.mask_token_id))
        for name, t in state.items():
            data, raw = _tensor(gguf, t, weight_type)
            w.add_tensor(gguf_name(name), data, raw_dtype=raw)
        if vocab is not None:
            head = _target_head(gguf, reader)
            w.add_tensor("d2t", vocab.to(torch.int64).numpy(), raw_dtype=gguf.GGMLQuantizationType.I64)
            data, raw = _tensor(gguf, head[vocab], weight_type)
            w.add_tensor("output.weight", data, raw_dtype=raw)
    return {
        "layers": cfg.num_hidden_layers,
        "block_size": cfg.block_size,
        "weight_type": weight_type,
        "markov_rank": cfg.markov_rank,
        "draft_vocab_size": None if vocab is None else int(vocab.numel()),
        "target_layers": [int(i) + 1 for i in cfg.target_layer_ids],
        "bytes": out.stat().st_size,
    }


def _target_head(gguf, reader) -> torch.Tensor:
    """The target's LM head [V, H] in fp32 from its GGUF (`output.weight`, or the tied embedding)."""
    tensors = {t.name: t for t in reader.tensors}
    t = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if t is None:
        raise BlockdraftError("the target GGUF has neither output.weight nor token_embd.weight")
    return _fp32(gguf, t)


def _fp32(gguf, t) -> torch.Tensor:
    """A GGUF reader tensor, de-quantized, as a writable fp32 torch tensor."""
    return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))


def read_gguf_drafter(path: str | Path) -> tuple[dict, dict]:
    """(metadata, tensors as fp32 / int64 torch tensors) of a drafter GGUF, for round-trip checks."""
    gguf = _gguf()
    reader = gguf.GGUFReader(str(path))
    meta = {
        name: f.contents()
        for name, f in reader.fields.items()
        if not name.startswith("GGUF.")
        and not name.startswith("tokenizer.ggml.")
        or name == "tokenizer.ggml.mask_token_id"
    }
    tensors = {}
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.I64:
            tensors[t.name] = torch.from_numpy(np.array(t.data, dtype=np.int64))
        else:
            tensors[t.name] = _fp32(gguf, t)
    return meta, tensors
