"""`blockdraft train`: one flag per TrainConfig field."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import BlockdraftError
from ..train.checkpoints import SKIP_ON_RESUME


def add_train_args(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """One flag per TrainConfig field (--block-size, --num-anchors, ...): help and defaults from the
    dataclass. Returns each field's flag (its argparse action) by field name."""
    import dataclasses

    from ..train.config import TrainConfig

    actions = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        kind = str(f.type)
        help_text = f.metadata.get("help", "") + ("" if required or f.default is None else " (default: %(default)s)")
        opts = dict(help=help_text, default=None if required else f.default, required=required)
        if "list" in kind:
            actions[f.name] = p.add_argument(flag, type=int, nargs="+", metavar="N", **opts)
        elif "float" in kind:
            actions[f.name] = p.add_argument(flag, type=float, **opts)
        elif "int" in kind:
            actions[f.name] = p.add_argument(flag, type=int, **opts)
        else:
            actions[f.name] = p.add_argument(flag, **opts)
    return actions


def cmd_train(args) -> int:
    import dataclasses

    from ..train.config import SETTINGS_BEFORE, TrainConfig
    from ..train.trainer import Trainer

    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"extra"}
    settings = {k: v for k, v in vars(args).items() if k in names}
    resume = args.resume
    if args.resume_from:
        # the run's settings are the position's; only what a resume may change comes from the flags given
        from pathlib import Path

        from ..train.samples import adopt_position

        src = Path(args.resume_from)
        if not (src / "state.json").is_file() or not (src / "drafter").is_dir():
            raise BlockdraftError(
                f"--resume-from: {src} holds no training position (state.json + drafter/, "
                "written by --position-dir or a checkpoint)"
            )
        state = json.loads((src / "state.json").read_text())
        given = {a.split("=")[0][2:].replace("-", "_") for a in args.argv if a.startswith("--")}
        refused = sorted(given & names - set(Trainer.SKIP_ON_RESUME))
        if refused:
            raise BlockdraftError(
                f"--resume-from: the run's settings come from {src}/state.json; "
                f"--{', --'.join(n.replace('_', '-') for n in refused)} cannot change on a resume"
            )
        settings = {
            **{k: v for k, v in {**SETTINGS_BEFORE, **state["config"]}.items() if k in names},
            **{k: settings[k] for k in given & set(Trainer.SKIP_ON_RESUME)},
        }
        if adopt_position(src, Path(settings["out"])):
            print(f"train: resuming {src} (step {state['step']}) in {settings['out']}", file=sys.stderr)
        resume = True
    elif not settings.get("data"):
        raise BlockdraftError("train needs --data (a folder of regenerated samples) or --resume-from")
    cfg = TrainConfig(**settings)
    trainer = Trainer(cfg, resume=resume, position_dir=args.position_dir)
    trainer.run()
    trainer.close()
    return 0 if trainer.stopped_by is None else 128 + trainer.stopped_by  # the shell's code for a signal


def register(sub, methods) -> None:
    t = sub.add_parser("train", help="train a DFlash drafter on regenerated data (torchrun for DDP)")
    add_train_args(t)
    for action in t._actions:  # --resume-from takes the data folder from the position
        if action.dest == "data":
            action.required = False
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint, bit for bit")
    t.add_argument(
        "--position-dir",
        metavar="DIR",
        help="at every checkpoint also write the weights and schedule position to DIR, without the "
        "optimizer state: small enough to commit, so that another machine continues the run",
    )
    t.add_argument(
        "--resume-from",
        metavar="DIR",
        help="continue the run whose position DIR holds (a --position-dir folder or a checkpoint) in "
        f"--out: its settings are DIR's; {', '.join('--' + n.replace('_', '-') for n in SKIP_ON_RESUME)} "
        "may be given; without optimizer state AdamW's moments start anew",
    )
    t.set_defaults(func=cmd_train)
