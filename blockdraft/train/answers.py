"""One answer of the target to a training prompt, as a sample: its id (several sampled answers
per prompt), its seed, how it was sampled, and the JSON line written for it; duplicates of an
answer already kept for the same prompt are dropped. Shared by in-process regeneration
(`data.py`) and regeneration through a server (`remote.py`)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable, Iterator

from ..sampling import SamplingParams


def sample_seed(sample_id: str) -> int:
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class AnswerSampling:
    """How the target answers training prompts: greedy (temperature 0) or sampled with
    temperature, top-p and top-k (0 = off), HF's order. Each answer is seeded by its sample id."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        SamplingParams(self.temperature, self.top_p, self.top_k, seed=0)  # the same range checks

    def params(self, sample_id: str) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, seed=sample_seed(sample_id))

    def fields(self) -> dict:
        """What a sample records of its sampling (top-p / top-k only where they cut)."""
        out = {"temperature": self.temperature}
        if self.temperature > 0 and self.top_p < 1:
            out["top_p"] = self.top_p
        if self.temperature > 0 and self.top_k > 0:
            out["top_k"] = self.top_k
        return out


ANSWER_SEP = "~a"  # sample id of a prompt's answer i > 0: f"{prompt id}~a{i}" (answer 0 keeps the prompt's id)


def answer_id(prompt_id: str, index: int) -> str:
    return prompt_id if index == 0 else f"{prompt_id}{ANSWER_SEP}{index}"


def prompt_of(sample_id: str) -> str:
    """The prompt id a sample answers (`answer_id`'s inverse)."""
    return sample_id.split(ANSWER_SEP)[0]


def answer_copies(prompts: Iterable[dict], answers_per_prompt: int, first: int = 0) -> Iterator[dict]:
    """Each prompt `answers_per_prompt` times, as samples to answer: copy i (from `first`) has the
    id `answer_id(prompt id, i)` (and so its own seed) and records `prompt_id` / `answer_index`."""
    for p in prompts:
        for i in range(first, first + answers_per_prompt):
            yield (
                p
                if (answers_per_prompt, first) == (1, 0)
                else {**p, "id": answer_id(p["id"], i), "prompt_id": p["id"], "answer_index": i}
            )


def make_sample(
    prompt: dict,
    answer_ids: list[int],
    finish_reason: str,
    *,
    method: str,
    sampling: AnswerSampling,
    max_new_tokens: int,
    dtype: str | None = None,
) -> dict:
    """The JSON line written for an answered prompt (its chat messages are not kept). `dtype`: the
    precision the target ran in, when known (in-process); samples without it came from fp32."""
    fields = {k: v for k, v in prompt.items() if k != "messages"}
    sample = {
        **fields,
        "answer_ids": answer_ids,
        "finish_reason": finish_reason,
        "method": method,
        **sampling.fields(),
        "max_new_tokens": max_new_tokens,
    }
    if dtype is not None and dtype != "float32":
        sample["dtype"] = dtype
    return sample


class AnswerDeduper:
    """Drops an answer identical to one already kept for the same prompt (sampled answers can
    repeat, short ones most of all). Dropped ids go to `dropped.txt` in the folder, so that a
    rerun counts them as done and never answers them again."""

    def __init__(self, folder: Path, samples: Iterable[dict], others: Iterable[dict] = ()):
        """`samples`: the folder's own; `others`: answers kept elsewhere (e.g. the greedy answers
        beside sampled ones), which count as kept for their prompts."""
        self.path = folder / "dropped.txt"
        self.dropped = set(self.path.read_text().split()) if self.path.exists() else set()
        self.kept: dict[str, set[bytes]] = {}
        self.written: set[str] = set()  # ids already in the folder
        for s in samples:
            self.written.add(s["id"])
            self.kept.setdefault(prompt_of(s["id"]), set()).add(self._key(s["answer_ids"]))
        for s in others:
            self.kept.setdefault(prompt_of(s["id"]), set()).add(self._key(s["answer_ids"]))

    @staticmethod
    def _key(ids: list[int]) -> bytes:
        return hashlib.sha1(json.dumps(ids).encode()).digest()

    def keep(self, sample: dict) -> bool:
        seen = self.kept.setdefault(prompt_of(sample["id"]), set())
        key = self._key(sample["answer_ids"])
        if key not in seen:
            seen.add(key)
            return True
        with open(self.path, "a") as f:
            f.write(sample["id"] + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.dropped.add(sample["id"])
        return False
