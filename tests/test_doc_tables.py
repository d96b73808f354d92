"""Every generated table in README and docs is what its printed command writes from the results in
the tree today: each `benchmarks/SCRIPT.py ... --doc PAGE` command shown in a page (measuring commands
aside) is run against a copy of the page, and the copy must come back unchanged."""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MEASURING = {"measure", "cost", "tau"}  # subcommands that measure (minutes) rather than write a table
MEASURING_SCRIPTS = {"draft_weights.py"}  # scripts that measure and write their table in one run


def joined(text: str) -> str:
    """A page's text with shell line continuations joined and inline code spans kept on one line
    (fenced code blocks keep their lines)."""
    text = text.replace("\\\n", " ")
    parts = re.split(r"(```.*?```)", text, flags=re.S)
    inline = lambda t: re.sub(r"`[^`]*`", lambda m: re.sub(r"\s*\n\s*", " ", m.group(0)), t)  # noqa: E731
    return "".join(p if p.startswith("```") else inline(p) for p in parts)


def table_commands() -> list[tuple[Path, list[str]]]:
    found = []
    for page in PAGES:
        for m in re.finditer(r"benchmarks/\w+\.py [^`#\n]*--doc [^\s`]+[^`#\n]*", joined(page.read_text())):
            words = [w.strip("`):") for w in shlex.split(m.group(0))]
            if (len(words) > 1 and words[1] in MEASURING) or Path(words[0]).name in MEASURING_SCRIPTS:
                continue
            found.append((page, words))
    return found


COMMANDS = table_commands()


def test_the_docs_show_their_table_commands():
    assert len(COMMANDS) >= 6  # the parser sees them (exact-cost, side-by-side, headline, data, ...)


@pytest.mark.parametrize("page,words", COMMANDS, ids=[f"{p.name}:{w[0].split('/')[-1]}" for p, w in COMMANDS])
def test_a_docs_table_is_what_its_command_writes_today(tmp_path, page, words):
    target = ROOT / words[words.index("--doc") + 1]
    copy = tmp_path / target.name
    shutil.copy(target, copy)
    args = list(words)
    args[args.index("--doc") + 1] = str(copy)
    if "--plot" in args:  # the image is not compared; it goes to the temporary folder
        args[args.index("--plot") + 1] = str(tmp_path / "plot.png")
    script = " ".join(shlex.quote(a) if not set("*{") & set(a) else a for a in args[1:])
    run = subprocess.run(
        f"{shlex.quote(sys.executable)} {shlex.quote(args[0])} {script}",
        shell=True,
        executable="/bin/bash",  # brace expansion in the docs' commands
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert copy.read_text() == target.read_text(), f"{page.name}: `{' '.join(words)}` writes another table today"


def test_every_docs_page_is_at_most_300_lines():
    """Reference pages stay readable; superseded runs go to dated pages under docs/history/."""
    long = {str(p.relative_to(ROOT)): n for p in PAGES if (n := len(p.read_text().splitlines())) > 300}
    assert long == {}
