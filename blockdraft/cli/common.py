"""What several commands share: the model and sampling flags, loading the engine, the
speculation the flags ask for."""

from __future__ import annotations

import argparse
import sys

from ..errors import BlockdraftError


def add_dtype_arg(p: argparse.ArgumentParser):
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16", "q4_1"],
        default="auto",
        help="auto (default): bf16 on CUDA; on a CPU bf16 where its products measure faster than fp32's "
        "(AMX, AVX512-BF16), else fp32; q4_1: the target's linear layers from 4-bit weights "
        "(CPU; the default target's GGUF values)",
    )


def dtype_of(name: str | None):
    """The `--dtype` value as `Engine.load` takes it: a torch dtype, or "auto" / "q4_1" / None as given."""
    import torch

    return name if name in ("q4_1", "auto", None) else getattr(torch, name)


def add_model_args(p: argparse.ArgumentParser):
    p.add_argument("--target", help="local HF model folder (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--draft", help="DFlash drafter folder (default: the one shipped for the default target)")
    p.add_argument("--eagle", help="EAGLE-3-style drafter folder (method eagle3; default: the shipped one)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    add_dtype_arg(p)
    p.add_argument(
        "--draft-window",
        type=int,
        metavar="W",
        help="DFlash methods: the drafter sees only the last W committed tokens (flat draft cost on "
        "long contexts; default: the longest context the drafter was trained on when its config "
        "records it, else the whole context; 0: the whole context)",
    )
    p.add_argument(
        "--draft-weights",
        choices=["auto", "float", "int8", "bf16"],
        default="auto",
        help="drafters' linear layers: int8 copies of their weights (CPU: a draft pass reads 4x "
        "fewer bytes; the output is the target's either way), bf16 beside an fp32 target (DFlash "
        "drafters through the native pass, a CPU with AVX512-BF16), float (the target's dtype), or "
        "auto (default: bf16 for an fp32 target's DFlash drafters where the native pass runs, else "
        "int8 for fp32 drafters on CPU)",
    )


def add_sampling_args(p: argparse.ArgumentParser):
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--block-size", type=int, help="verified block length (default: the drafter's trained size)")
    p.add_argument(
        "--tree-budget", type=int, metavar="N", help="method dflash-tree: draft tokens (tree nodes) verified per step"
    )


def load_engine(args, method_names: list[str]):
    """The engine, with the DFlash drafter loaded when one of the methods needs it (other
    shipped drafters load on first use); unknown methods fail here, before any loading."""

    from .. import drafters, methods
    from ..engine import Engine

    specs = [methods.parse(m, include_peers=True)[0] for m in method_names]
    dtype = dtype_of(args.dtype)
    engine = Engine.load(
        args.target,
        args.draft,
        device=args.device,
        dtype=dtype,
        use_draft=any(s.drafter == drafters.PRIMARY for s in specs),
        eagle=args.eagle,
        draft_weights=args.draft_weights,
    )
    if "note:" in engine.dtype_reason:
        print(f"blockdraft: {engine.weights} {engine.dtype_reason}", file=sys.stderr)
    return engine


def window(args):
    return "auto" if args.draft_window is None else args.draft_window


def spec_from(args, **kw):
    """The speculation the flags ask for (`--method`, `--block-size`, `--draft-window`)."""
    from ..spec import SpecConfig

    return SpecConfig(args.method, args.block_size, window=window(args), **kw)


def sampling_kwargs(args) -> dict:
    return dict(
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )


def tree_budget(args):
    """`--tree-budget N` means method dflash-tree with N nodes (a verified block of N + 1)."""
    if args.tree_budget is None:
        return
    if args.tree_budget < 1:
        raise BlockdraftError("--tree-budget must be at least 1")
    if args.method not in ("dflash", "dflash-tree"):
        raise BlockdraftError(f"--tree-budget applies to method dflash-tree, not {args.method}")
    args.method, args.block_size = "dflash-tree", args.tree_budget + 1


def interrupt_on_sigterm():
    """SIGTERM (a session or job manager stopping us) unwinds like Ctrl-C, so files are closed."""
    import signal

    def handler(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
