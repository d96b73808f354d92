"""A DFlash drafter in exactly the authors' published format, for vLLM and SGLang.

A drafter folder written by `blockdraft train` loads in those engines' DFlash loaders only if
it holds nothing they do not know. Ours may carry two extensions: a draft vocabulary (the
`draft_vocab` tensor and `blockdraft.draft_vocab_size`: the drafter scores only those target
ids) and other `blockdraft` config settings. `export_drafter` writes the published config keys
and weight names and nothing else. Without its draft vocabulary the drafter scores the whole
vocabulary with the target's LM head, as the engines do: the target's output is unchanged
(verification decides every token), but a draft may now pick a token the training vocabulary
left out, so τ can change (the README measures it).

A drafter with a Markov head is written in DSpark's layout (DeepSpec's names and keys:
`Qwen3DSparkModel`, `markov_head.markov_w1/w2`, `markov_rank`, top-level `mask_token_id` and
`target_layer_ids`, `num_anchors`) with the drafter's block layout in `sample_from_anchor`: true
(every block slot drafts the token after it, DSpark's own layout, which DeepSpec, vLLM and SGLang
run) for drafters trained with `--draft-layout anchor`, false (drafts from the slot after the
anchor) for the older ones: llama.cpp's converter reads that key (draft-dspark), vLLM's DSpark
loader too; SGLang's refuses the false layout. A drafter in DSpark's layout has no plain DFlash
equivalent (the published DFlash format drafts from slot 1), so it is never written as one.
W2's draft-vocabulary rows are spread over the whole
vocabulary (zeros elsewhere), as the rest of the drafter scores it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import write_model_folder
from .draft import DFlashDrafter
from .draft_config import ARCHITECTURE, DSPARK_ARCHITECTURE, PUBLISHED_KEYS, read_draft_config
from .errors import BlockdraftError

# the published drafter's weights (Qwen3-style decoder layers, the fused-context projection)
LAYER_WEIGHTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)


def published_weight_names(num_layers: int, attention_bias: bool = False) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.{w}.weight" for w in LAYER_WEIGHTS}
        if attention_bias:
            names |= {f"layers.{i}.self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    return names


def target_embedding_and_head(folder: str | Path) -> dict[str, torch.Tensor]:
    """A target folder's token embedding and LM head (the embedding where the head is tied), as a
    DSpark checkpoint names them: {"embed_tokens.weight", "lm_head.weight"}."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                key = "embed_tokens.weight" if name.endswith("embed_tokens.weight") else name
                if key in ("embed_tokens.weight", "lm_head.weight") and key not in found:
                    found[key] = f.get_tensor(name)
    if "embed_tokens.weight" not in found:
        raise BlockdraftError(f"{folder}: no token embedding (…embed_tokens.weight) in its safetensors files")
    found.setdefault("lm_head.weight", found["embed_tokens.weight"].clone())  # tied (a copy: one file, two tensors)
    return found


def export_drafter(
    src: str | Path,
    out: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    markov_head: bool = True,
    target: dict[str, torch.Tensor] | None = None,
) -> dict:
    """Write drafter folder `src` to `out` in the published format (DSpark's layout for a drafter with
    a Markov head), weights in `dtype`. Returns what was dropped and how it was written
    ({"draft_vocab_size": N or None, "config": [dropped keys], "layout": a few words}).
    `markov_head=False`: a drafter with a Markov head is written without it, as a plain DFlash
    drafter in the published format (for engines that do not run DSpark's layout, e.g. SGLang).
    `target`: the target's embedding and LM head (`target_embedding_and_head`), which a DSpark
    checkpoint carries: DeepSpec's loader fills them with random values where they are missing
    (without an error; its drafts then accept ~1.1 tokens a step instead of ours, 2.4 on
    HumanEval), so a DSpark export needs them; the published DFlash format has neither."""
    raw = read_draft_config(src)
    ours = raw.get("blockdraft") or {}
    if ours.get("context_mode", "kv") != "kv":
        raise BlockdraftError(
            f"{src}: a drafter trained with context_mode={ours['context_mode']!r} (an "
            "ablation) has no equivalent in the published format"
        )
    drafter = DFlashDrafter.load(src)
    cfg = drafter.config
    config = {k: v for k, v in cfg.to_dict().items() if k in PUBLISHED_KEYS}
    config["architectures"] = [ARCHITECTURE]  # (a Markov-head drafter's own folder says DSpark: see below)
    config["dflash_config"] = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    state = {k: v for k, v in drafter.state_dict().items() if k != "draft_vocab"}
    expected = published_weight_names(cfg.num_hidden_layers, cfg.attention_bias)
    markov = cfg.markov_rank if markov_head else 0
    if cfg.sample_from_anchor and not markov:
        raise BlockdraftError(
            f"{src}: a drafter in DSpark's block layout (every slot drafts, sample_from_anchor) "
            "has no equivalent in the published DFlash format; export it with its Markov head"
        )
    if cfg.markov_rank and not markov_head:
        state = {k: v for k, v in state.items() if not k.startswith("markov_head.")}
    if markov:
        config.update(
            {
                "architectures": [DSPARK_ARCHITECTURE],
                "mask_token_id": cfg.mask_token_id,
                "target_layer_ids": list(cfg.target_layer_ids),
                "markov_rank": cfg.markov_rank,
                "markov_head_type": "vanilla",
                "sample_from_anchor": cfg.sample_from_anchor,
                "num_anchors": ours.get("num_anchors", 32),
                "enable_confidence_head": False,
                "confidence_head_with_markov": False,
            }
        )
        vocab_ids = getattr(drafter, "draft_vocab", None)
        w2 = state["markov_head.markov_w2.weight"]
        if vocab_ids is not None:
            full = w2.new_zeros(cfg.vocab_size, w2.shape[1])
            full[vocab_ids] = w2
            state["markov_head.markov_w2.weight"] = full
        expected |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
        if target is None:
            raise BlockdraftError(
                f"{src}: a drafter in DSpark's layout carries the target's embedding and LM head: "
                "give the target's (`target_embedding_and_head`, or `export drafter --target DIR`)"
            )
        for name, w in target.items():
            if tuple(w.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise BlockdraftError(
                    f"the target's {name} is {tuple(w.shape)}, this drafter needs "
                    f"({cfg.vocab_size}, {cfg.hidden_size}): not the target it was made for"
                )
            state[name] = w
        expected |= set(target)
    if set(state) != expected:
        raise BlockdraftError(f"{src}: weights outside the published set: {sorted(set(state) ^ expected)[:4]}")
    write_model_folder(out, config, state, dtype)
    vocab, context = ours.get("draft_vocab_size"), ours.get("train_context")
    anchor = "true" if cfg.sample_from_anchor else "false"
    how = (
        f"DSpark's format with `sample_from_anchor: {anchor}` (a DFlash backbone and a rank-"
        f"{markov} Markov head): llama.cpp's converter (`--spec-type draft-dspark`) and vLLM (method "
        "`dspark`) read it"
        + (
            ", DeepSpec's and SGLang's DSpark loaders too"
            if cfg.sample_from_anchor
            else "; SGLang refuses this block layout"
        )
        if markov
        else "The published DFlash format: load with vLLM (`--speculative-config` method `dflash`) or SGLang "
        "(`--speculative-algorithm DFLASH`)"
    )
    (Path(out) / "README.md").write_text(
        f"# {'DSpark-style' if markov else 'DFlash'} drafter (exported by blockdraft)\n\n"
        f"{how}. Block size {cfg.block_size}, {cfg.num_hidden_layers} layers, "
        f"target layers {list(cfg.target_layer_ids)}, mask token id {cfg.mask_token_id}.\n\n"
        + (
            f"Trained with a draft vocabulary of {vocab} tokens, which the format cannot carry: it now scores "
            f"the target's whole vocabulary.\n\n"
            if vocab
            else ""
        )
        + (
            f"Trained on sequences of up to {context} tokens: SGLang's `--speculative-draft-window-size {context}` "
            f"keeps its draft context within what it learned.\n"
            if context
            else ""
        )
    )
    return {
        "draft_vocab_size": vocab,
        "config": sorted(set(raw) - set(config) - {"dtype"}),
        "layout": "DSpark's layout (Qwen3DSparkModel, a Markov head)" if markov else "the published DFlash format",
    }
