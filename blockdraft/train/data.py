"""Training data: prompts from offline sources and the shards answers are written to (the answers
themselves come from `train.regen`).

Every finished sample is a JSON line. Shards are gzip-compressed JSON lines, `shard-NNNNN.jsonl.gz`;
the shard being written is a plain `shard-NNNNN.jsonl`, flushed and fsynced per
sample and compressed when it is full or the run ends. A killed run loses nothing
it wrote: the next one cuts a torn last line, compresses the leftover shard, skips
the ids already written and goes on, so no sample is written twice.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator


from ..datasets import PROMPT_SOURCES, contaminated, eval_fingerprints, is_validation
from ..errors import BlockdraftError
from ..text import chat_prompt_ids

SHARD_SIZE = 1000
# The default mix of prompt sources (see datasets.PROMPT_SOURCES), by weight.
# Code and math come early: HumanEval and GSM8K are two of the three benchmark sets.
DEFAULT_MIX = {"sharegpt": 4, "sharegpt-code": 2, "codeio": 2, "leetcode": 1, "asdiv": 1, "sharegpt-later": 1}


def template_prefix_ids(tokenizer) -> list[int]:
    """The tokens every one-turn prompt starts with in the chat template (for SmolLM2: its default
    system turn and the user header), found as the common start of two different prompts."""
    return os.path.commonprefix([chat_prompt_ids(tokenizer, "a"), chat_prompt_ids(tokenizer, "b")])


def parse_mix(text: str | dict | None, sources: dict | None = None) -> dict[str, float]:
    """`"sharegpt=3,math=1"` -> {"sharegpt": 3.0, "math": 1.0} (a bare name weighs 1). `sources`:
    the prompt sources by name (default `datasets.PROMPT_SOURCES`); without a mix, the built-in
    mix, or every source equally where `sources` are not the built-in ones."""
    sources = PROMPT_SOURCES if sources is None else sources
    if text is None:
        return dict(DEFAULT_MIX) if sources is PROMPT_SOURCES else {name: 1.0 for name in sources}
    if isinstance(text, dict):
        mix = {k: float(v) for k, v in text.items()}
    else:
        mix = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, weight = part.partition("=")
            try:
                mix[name.strip()] = float(weight) if weight else 1.0
            except ValueError:
                raise BlockdraftError(f"--mix: {part!r} is not NAME=WEIGHT") from None
    unknown = sorted(set(mix) - set(sources))
    if unknown:
        raise BlockdraftError(f"unknown prompt source(s) {', '.join(unknown)}; known: {', '.join(sources)}")
    if not mix or any(w < 0 for w in mix.values()) or not any(w > 0 for w in mix.values()):
        raise BlockdraftError("--mix needs at least one source with a positive weight")
    return {k: w for k, w in mix.items() if w > 0}


def interleave(streams: dict[str, Iterable], weights: dict[str, float]) -> Iterator[tuple[str, object]]:
    """Deterministic weighted round robin over streams; an exhausted stream drops out."""
    its = {name: iter(streams[name]) for name in weights}
    credit = {name: 0.0 for name in weights}
    while its:
        total = sum(weights[n] for n in its)
        for name in its:
            credit[name] += weights[name] / total
        name = max(its, key=lambda n: (credit[n], -list(weights).index(n)))
        credit[name] -= 1.0
        try:
            yield name, next(its[name])
        except StopIteration:
            del its[name]


def training_prompts(
    tokenizer,
    mix: dict[str, float] | str | None = None,
    max_prompt_tokens: int = 256,
    fingerprints: list[str] | None = None,
    sources: dict | None = None,
    skip: Callable[[str], bool] | None = None,
    rejected: set | None = None,
) -> Iterator[dict]:
    """Prompts to answer, lazily, in a fixed order: the sources of `mix` interleaved by weight,
    evaluation prompts excluded by fingerprint, prompts longer than `max_prompt_tokens` skipped.
    A sample's split (train / valid) is a function of its id alone. `sources`: name -> a callable
    giving `{"id", "messages"}` records (default: `datasets.PROMPT_SOURCES`; self-written prompts
    come from `prompts.prompt_sources`). `skip(id)` true: that record is passed over before it is
    fingerprinted or tokenized (a resumed run's done prompts cost nothing); `rejected`: a set that
    gets the ids of the records turned away (see `RejectedPrompts`)."""
    sources = PROMPT_SOURCES if sources is None else sources
    mix = parse_mix(mix, sources)
    fps = eval_fingerprints() if fingerprints is None else fingerprints
    for source, rec in interleave({name: sources[name]() for name in mix}, mix):
        if skip is not None and skip(rec["id"]):
            continue
        messages = rec["messages"]
        if any(m["role"] == "user" and contaminated(m["content"], fps) for m in messages):
            if rejected is not None:
                rejected.add(rec["id"])
            continue
        ids = chat_prompt_ids(tokenizer, messages)
        if len(ids) > max_prompt_tokens:
            if rejected is not None:
                rejected.add(rec["id"])
            continue
        split = "valid" if is_validation(rec.get("group", rec["id"])) else "train"
        yield {
            "id": rec["id"],
            "source": source,
            "split": split,
            "prompt": messages[-1]["content"],
            "prompt_ids": ids,
            "messages": messages,
        }


class RejectedPrompts:
    """The ids of the prompts `training_prompts` turned away (an evaluation prompt's fingerprint, or
    longer than `max_prompt_tokens` in the chat template), kept in a regeneration folder so that a
    resumed run passes over them before tokenizing them again: in the built-in mix 27,874 of 50,482
    prompts are such, and tokenizing them took a resumed run over a minute before its first answer.
    Valid for one tokenizer (its vocabulary and chat template), one `max_prompt_tokens` and one set
    of evaluation fingerprints; under any other it is read as empty and rewritten with what that run
    turns away."""

    NAME = ".rejected-prompts.json"

    def __init__(self, folder: Path, tokenizer, max_prompt_tokens: int, fingerprints: list[str]):
        self.path = Path(folder) / self.NAME
        what = [str(max_prompt_tokens), str(len(tokenizer)), str(tokenizer.chat_template), *fingerprints]
        self.key = hashlib.sha256("\n".join(what).encode()).hexdigest()[:16]
        self.ids: set[str] = set()
        try:
            stored = json.loads(self.path.read_text())
            if stored.get("key") == self.key:
                self.ids = set(stored["ids"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, or unreadable: it is only a shortcut
        self.known = len(self.ids)

    def save(self) -> None:
        if len(self.ids) == self.known:
            return
        tmp = self.path.with_name(self.NAME + ".tmp")
        tmp.write_text(json.dumps({"key": self.key, "ids": sorted(self.ids)}))
        os.replace(tmp, self.path)
        self.known = len(self.ids)


# ---- shards -----------------------------------------------------------------------------


def _index(path: Path) -> int:
    return int(path.name.split(".")[0].split("-")[1])


def _compress(plain: Path) -> Path:
    """plain shard -> .jsonl.gz, atomically (the .gz appears complete or not at all)."""
    final = plain.with_name(plain.name + ".gz")
    tmp = plain.with_name(plain.name + ".gz.tmp")
    with open(plain, "rb") as src, gzip.open(tmp, "wb", compresslevel=9) as dst:
        dst.write(src.read())
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    plain.unlink()
    return final


def _repair(plain: Path):
    """Cut a torn last line (a writer killed mid-write)."""
    data = plain.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(plain, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def _shard_lines(path: Path) -> list[str]:
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return f.read().splitlines()
    data = path.read_text()
    if data and not data.endswith("\n"):  # torn last line: not a sample yet
        data = data[: data.rfind("\n") + 1]
    return data.splitlines()


def shard_paths(folder: Path) -> list[Path]:
    """Shards in order; a plain shard whose compressed twin exists (a kill between the two
    steps of `_compress`) is left out."""
    gz = {_index(p): p for p in folder.glob("shard-*.jsonl.gz")}
    plain = {_index(p): p for p in folder.glob("shard-*.jsonl")}
    return [gz.get(i) or plain[i] for i in sorted(set(gz) | set(plain))]


def data_folders(spec: str | Path) -> list[Path]:
    """The folders of regenerated shards that `spec` names: one, or several separated by commas
    (e.g. greedy answers and sampled answers to the same prompts, regenerated into two folders)."""
    return [Path(part.strip()) for part in str(spec).split(",") if part.strip()]


def iter_samples(folders: str | Path, split: str | None = None) -> Iterator[dict]:
    """Every complete sample written so far in `folders` (`data_folders`), folder by folder in
    shard order; the first copy of an id only, within a folder (two folders may answer one
    prompt twice)."""
    for folder in data_folders(folders):
        seen = set()
        for shard in shard_paths(folder):
            for line in _shard_lines(shard):
                if not line.strip():
                    continue
                sample = json.loads(line)
                if sample["id"] in seen:
                    continue
                seen.add(sample["id"])
                if split is None or sample["split"] == split:
                    yield sample


def tidy_shards(folder: Path):
    """Before writing: drop plain twins of compressed shards, repair and compress leftovers."""
    gz = {_index(p) for p in folder.glob("shard-*.jsonl.gz")}
    for plain in folder.glob("shard-*.jsonl"):
        if _index(plain) in gz:
            plain.unlink()
        else:
            _repair(plain)
            if plain.stat().st_size:
                _compress(plain)
            else:
                plain.unlink()
    for tmp in folder.glob("shard-*.gz.tmp"):
        tmp.unlink()


class ShardWriter:
    """Appends samples to a new plain shard (fsync per sample); compresses full shards."""

    def __init__(self, folder: Path):
        self.folder = folder
        existing = [_index(p) for p in folder.glob("shard-*.jsonl*")]
        self.index = max(existing, default=-1) + 1
        self.file, self.in_shard = None, 0

    def write(self, sample: dict):
        if self.file is None:
            self.file = open(self.folder / f"shard-{self.index:05d}.jsonl", "a")
        self.file.write(json.dumps(sample, separators=(",", ":")) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.in_shard += 1
        if self.in_shard >= SHARD_SIZE:
            self.close()

    def close(self):
        if self.file is not None:
            self.file.close()
            _compress(Path(self.file.name))
            self.file, self.in_shard = None, 0
            self.index += 1
