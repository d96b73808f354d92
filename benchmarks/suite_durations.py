"""Compare two pytest `--durations=0` outputs test by test: the time of the tests both ran, and
what only one of them ran (the suite before / after a change, docs: the redesign's closing note).

    .venv/bin/python benchmarks/suite_durations.py BEFORE.txt AFTER.txt
"""

from __future__ import annotations

import collections
import re
import sys


def durations(path: str) -> collections.Counter:
    """Seconds per test id (setup + call + teardown)."""
    out: collections.Counter = collections.Counter()
    for line in open(path):
        m = re.match(r"^([0-9.]+)s (call|setup|teardown)\s+(\S+)", line)
        if m:
            out[m.group(3)] += float(m.group(1))
    return out


def main(before: str, after: str) -> None:
    a, b = durations(before), durations(after)
    common = a.keys() & b.keys()
    print(f"tests timed: before {len(a)}, after {len(b)}, both {len(common)}")
    print(f"seconds of the tests both ran: before {sum(a[k] for k in common):.0f}, "
          f"after {sum(b[k] for k in common):.0f}")
    print(f"only after: {len(b.keys() - common)} tests, {sum(b[k] for k in b.keys() - common):.0f} s; "
          f"only before: {len(a.keys() - common)} tests, {sum(a[k] for k in a.keys() - common):.0f} s")
    for label, keys in (("slower", sorted(common, key=lambda k: a[k] - b[k])[:5]),
                        ("faster", sorted(common, key=lambda k: b[k] - a[k])[:5])):
        for k in keys:
            print(f"  {label} {b[k] - a[k]:+6.1f} s ({a[k]:.1f} -> {b[k]:.1f})  {k}")
    for path in (before, after):
        ends = [line.strip() for line in open(path) if re.search(r"\d+ passed", line)]
        print(f"{path}: {ends[-1] if ends else 'no summary line'}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
