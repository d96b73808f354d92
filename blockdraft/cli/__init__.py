"""`blockdraft` command line: generate | demo | data | train | bench | export | serve.

One module per command (its flags in `register(sub, methods)`, its work in `cmd_*`); the
flags several share live in `common`."""

from __future__ import annotations

import argparse
import sys

from ..errors import BlockdraftError
from . import bench, data, export, generate, serve, train
from .train import add_train_args

COMMANDS = (generate, data, train, bench, export, serve)  # the order `blockdraft --help` lists them in

__all__ = ["main", "add_train_args"]


def main(argv: list[str] | None = None) -> int:
    from .. import methods

    parser = argparse.ArgumentParser(prog="blockdraft", description="DFlash block-diffusion speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub, methods)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # which flags were given (train --resume-from)
    try:
        return args.func(args)
    except BlockdraftError as exc:
        print(f"blockdraft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
