"""Replace the text between two `<!-- NAME -->` markers of a Markdown file (the docs' generated tables)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# how the generated tables name the benchmark's datasets
DATASET_LABELS = {"humaneval": "HumanEval", "mtbench": "MT-Bench", "gsm8k": "GSM8K"}


def write_between(doc: Path, name: str, text: str) -> None:
    mark = f"<!-- {name} -->"
    body = doc.read_text()
    if body.count(mark) != 2:
        sys.exit(f"{doc}: needs exactly two {mark} markers")
    a, _, b = body.split(mark)
    doc.write_text(f"{a}{mark}\n{text}\n{mark}{b}")


def main(doc: str, name: str, make_table, argv=None, plot=None, **paths) -> int:
    """The command line every table script shares: positional `paths` (name -> help), --doc, and
    --plot FILE where the script can draw its table (`plot(args, file)`)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    for arg, (nargs, help_text) in paths.items():
        ap.add_argument(arg, nargs=nargs, type=Path, help=help_text)
    ap.add_argument("--doc", type=Path, help=f"write the table between the file's <!-- {name} --> markers")
    ap.add_argument("--marker", default=name, help=f"the markers' name (default: {name})")
    if plot is not None:
        ap.add_argument("--plot", type=Path, help="also draw it into this image file (.png)")
    args = ap.parse_args(argv)
    text = make_table(args)
    if plot is not None and args.plot:
        plot(args, args.plot)
    if args.doc:
        write_between(args.doc, args.marker, text)
    else:
        print(text)
    return 0
