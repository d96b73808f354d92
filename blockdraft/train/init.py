"""Warm starts from the target: a drafter's layers copied from the target's (`--init`)."""

from __future__ import annotations

import torch

from ..errors import BlockdraftError


def _copy_layer(theirs, q_proj, k_proj, v_proj, o_proj, mlp, post_norm, columns: slice = slice(None)):
    """Copy a target decoder layer into drafter modules (`columns` of the q/k/v input side)."""
    q, k, v = theirs.self_attn.qkv_proj.weight.split([q_proj.out_features, k_proj.out_features, v_proj.out_features])
    q_proj.weight[:, columns].copy_(q)
    k_proj.weight[:, columns].copy_(k)
    v_proj.weight[:, columns].copy_(v)
    o_proj.weight.copy_(theirs.self_attn.o_proj.weight)
    gate, up = theirs.mlp.gate_up_proj.weight.split(theirs.mlp.hidden)
    mlp.gate_proj.weight.copy_(gate)
    mlp.up_proj.weight.copy_(up)
    mlp.down_proj.weight.copy_(theirs.mlp.down_proj.weight)
    post_norm.weight.copy_(theirs.post_attention_layernorm.weight)


def init_from_target(drafter, target, how: str, init_layers):
    """Warm start: copy the first or last N target layers' attention, MLP and norm weights into
    the drafter's N layers (the DFlash drafter's extra q/k norms and every fc stay freshly
    initialised; the EAGLE layer gets the target layer's q/k/v on its hidden-state half).
    `target-last-fc` also starts `fc` as the identity on the deepest captured layer and
    `hidden_norm` as the norm the target applies to it, so that the context keys and values
    begin as the target's own. `init_layers(drafter, target, how)`: the kind's own layer copy
    (`drafters.DrafterKind.init_layers`)."""
    layers = target.model.layers
    if how not in ("target-first", "target-last", "target-last-fc"):
        raise BlockdraftError(f"--init must be random, target-first, target-last or target-last-fc, not {how!r}")
    if target.recurrent:
        raise BlockdraftError(
            f"--init {how} copies Llama-style attention layers; this target's layers are "
            "linear and gated attention (use --init random)"
        )
    with torch.no_grad():
        init_layers(drafter, target, how)
        if how.startswith("target-last"):
            drafter.norm.weight.copy_(target.model.norm.weight)
        if how == "target-last-fc":
            ids, h = list(drafter.config.target_layer_ids), drafter.config.hidden_size
            j = ids.index(max(ids))
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, j * h : (j + 1) * h].copy_(torch.eye(h))
            reader = layers[ids[j] + 1] if ids[j] + 1 < len(layers) else layers[-1]
            drafter.hidden_norm.weight.copy_(reader.input_layernorm.weight)


def init_eagle_layers(drafter, target, how: str):
    """The EAGLE layer from the target's first or last layer: its q/k/v on the hidden-state half."""
    layers = target.model.layers
    theirs = layers[0] if how == "target-first" else layers[-1]
    h = drafter.config.hidden_size
    with torch.no_grad():
        _copy_layer(
            theirs,
            drafter.q_proj,
            drafter.k_proj,
            drafter.v_proj,
            drafter.o_proj,
            drafter.mlp,
            drafter.post_attention_layernorm,
            slice(h, 2 * h),
        )
        drafter.hidden_norm.weight.copy_(theirs.input_layernorm.weight)


def init_dflash_layers(drafter, target, how: str):
    """The drafter's N layers from the target's first or last N (attention, MLP, norms)."""
    layers = target.model.layers
    n = len(drafter.layers)
    with torch.no_grad():
        for mine, theirs in zip(
            drafter.layers, layers[:n] if how == "target-first" else layers[len(layers) - n :], strict=False
        ):
            att = mine.self_attn
            _copy_layer(theirs, att.q_proj, att.k_proj, att.v_proj, att.o_proj, mine.mlp, mine.post_attention_layernorm)
            mine.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
