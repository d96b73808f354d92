"""Self-written training prompts (Magpie-style): the target writes the user turn itself.

The chat template is rendered up to the user header under a system prompt that names a
domain (code, math, chat); the target samples what a user would ask there and stops at its
end-of-turn token. Each candidate has an id (`synth-DOMAIN/N`) that seeds its sampling, so a
rerun continues where the last one stopped and writes nothing twice. Candidates pass filters
(cut at the token cap, too short, not English-looking text, role markers, repetition, an
evaluation prompt's fingerprint, a near-duplicate of a kept prompt by word 4-gram overlap);
kept prompts go to crash-safe gzip shards in the same format as answers, rejected ids with
their reason to `rejected.tsv`. `data regenerate --prompts DIR` then answers them like any
other source (the held-out split is the same hash of the id).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Iterator

from tqdm import tqdm

from ..datasets import MATH_TEMPLATE, contaminated, eval_fingerprints
from ..errors import BlockdraftError
from .answers import AnswerSampling
from .data import ShardWriter, iter_samples, shard_paths, tidy_shards
from .regen import answer_prompts

# Per domain, the system prompts the target writes user turns under (one is picked per
# candidate by its id). The chat domain's first is SmolLM2's own default system prompt.
DOMAINS = {
    "code": (
        "You are a helpful AI assistant. The user is a programmer who asks you to write, explain or fix code.",
        "You are a coding assistant. Users ask you for Python functions, algorithms, and help with bugs and errors.",
        "You are an expert software engineer. Users give you programming tasks with a clear description of "
        "the input and the expected output.",
    ),
    "math": (
        "You are a helpful AI assistant. The user asks you to solve math word problems step by step.",
        "You are a math tutor. Students give you arithmetic, algebra and word problems with numbers to solve.",
    ),
    "chat": (
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
        "You are a helpful AI assistant. Users ask about everyday topics: advice, writing, explanations, "
        "history, science, travel and health.",
        "You are a friendly assistant. Users ask you to write emails, stories, summaries, lists and plans.",
    ),
}
# Magpie's sampling for the user turn: the target's full distribution, nearly.
PROMPT_SAMPLING = AnswerSampling(temperature=1.0, top_p=0.95)


def prompt_head_ids(tokenizer, system: str) -> list[int]:
    """The chat template up to and including the user header, under `system`."""
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False)
    head = text + "<|im_start|>user\n"
    probe = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "x"}], tokenize=False
    )
    if not probe.startswith(head):
        raise BlockdraftError(
            "self-written prompts need a ChatML chat template (<|im_start|>user ...); this "
            "target's template renders a user turn differently"
        )
    return tokenizer(head, add_special_tokens=False).input_ids


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def shingles(text: str, n: int = 4) -> set[int]:
    """Hashes of the text's word n-grams (of the whole text where it has fewer words)."""
    words = _words(text)
    grams = [" ".join(words[i : i + n]) for i in range(max(1, len(words) - n + 1))]
    return {int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8).digest(), "little") for g in grams}


class NearDuplicates:
    """Kept texts by their word 4-grams: a text whose Jaccard similarity with any kept one is
    at least `threshold` is a near-duplicate (an inverted index makes each check cost only the
    kept texts sharing a 4-gram with it)."""

    def __init__(self, threshold: float = 0.5):
        self.threshold = threshold
        self.index: dict[int, list[int]] = {}
        self.sizes: list[int] = []

    def similar(self, text: str) -> bool:
        grams = shingles(text)
        shared = Counter(j for g in grams for j in self.index.get(g, ()))
        return any(c / (len(grams) + self.sizes[j] - c) >= self.threshold for j, c in shared.items())

    def add(self, text: str):
        grams = shingles(text)
        for g in grams:
            self.index.setdefault(g, []).append(len(self.sizes))
        self.sizes.append(len(grams))


def problem(text: str, finish_reason: str, fingerprints: list[str]) -> str | None:
    """Why a self-written user turn is not kept (None: it is), the near-duplicate check aside."""
    if finish_reason != "stop":
        return "cut"  # ran into the token cap without ending its turn
    words = text.split()
    if len(words) < 4 or len(text) < 16:
        return "short"
    if "<|im_" in text or re.match(r"^\s*(assistant|user|system)\s*[:\n]", text, re.I):
        return "role"
    if sum(1 for ch in text if ord(ch) > 127) > 0.05 * len(text):
        return "language"
    if sum(ch.isalpha() for ch in text) < 0.4 * len(text.replace(" ", "")):
        return "language"
    lowered = _words(text)
    trigrams = [tuple(lowered[i : i + 3]) for i in range(len(lowered) - 2)]
    if len(trigrams) >= 10 and len(set(trigrams)) < 0.5 * len(trigrams):
        return "repetitive"
    if contaminated(text, fingerprints):
        return "evaluation"
    return None


@dataclass
class SynthStats:
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    tokens: int = 0


def prompt_sources(root: str | Path) -> dict[str, Callable[[], Iterator[dict]]]:
    """Prompt sources for `training_prompts` from folders written by `synthesize`: `root` itself
    if it holds shards, else each subfolder that does, named by the folder (`synth-code`, ...)."""
    root = Path(root)
    if not root.is_dir():
        raise BlockdraftError(f"--prompts: {root} is not a folder")
    folders = [root] if shard_paths(root) else [p for p in sorted(root.iterdir()) if p.is_dir() and shard_paths(p)]
    if not folders:
        raise BlockdraftError(
            f"--prompts: no prompt shards in {root} or its subfolders "
            "(write them with `blockdraft data prompts --synthesize N`)"
        )

    def records(folder: Path) -> Iterator[dict]:
        for rec in iter_samples(folder):
            yield {"id": rec["id"], "messages": [{"role": "user", "content": rec["turns"][0]}]}

    return {folder.name: (lambda folder=folder: records(folder)) for folder in folders}


def synthesize(
    engine,
    out_dir: str | Path,
    count: int,
    domain: str,
    *,
    max_prompt_tokens: int = 256,
    batch_size: int = 128,
    sampling: AnswerSampling = PROMPT_SAMPLING,
    seconds: float | None = None,
    similarity: float = 0.5,
    progress: bool = True,
) -> SynthStats:
    """Have the target write user turns of `domain` into `out_dir` until it holds `count` kept
    prompts (resumable; see the module's docstring). Math prompts are asked in the benchmark's
    math template, as the ASDiv source is."""
    if domain not in DOMAINS:
        raise BlockdraftError(f"unknown domain {domain!r}; known: {', '.join(DOMAINS)}")
    if sampling.temperature <= 0:
        raise BlockdraftError("self-written prompts need sampling (a temperature > 0): greedy ones repeat")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tidy_shards(out)
    rejected_path = out / "rejected.tsv"
    rejected = (
        dict(line.split("\t", 1) for line in rejected_path.read_text().splitlines() if "\t" in line)
        if rejected_path.exists()
        else {}
    )
    dedup, kept_ids = NearDuplicates(similarity), set()
    for rec in iter_samples(out):
        dedup.add(rec.get("question", rec["turns"][0]))
        kept_ids.add(rec["id"])
    stats = SynthStats(kept=len(kept_ids), rejected=Counter(rejected.values()))
    if stats.kept >= count:
        print(f"prompts: {out} already holds {stats.kept} {domain} prompts", file=sys.stderr)
        return stats
    fingerprints = eval_fingerprints()
    systems = DOMAINS[domain]
    heads = [prompt_head_ids(engine.tokenizer, s) for s in systems]
    done = kept_ids | set(rejected)

    def candidates():
        n = 0
        while True:
            cid = f"synth-{domain}/{n}"
            if cid not in done:
                which = int.from_bytes(hashlib.sha256(cid.encode()).digest()[:4], "little") % len(systems)
                yield {"id": cid, "system": which, "prompt_ids": heads[which]}
            n += 1

    writer = ShardWriter(out)
    bar = tqdm(total=count, initial=stats.kept, unit="prompt", desc=f"prompts ({domain})", disable=not progress)
    reject_file = open(rejected_path, "a")

    def on_sample(sample):
        text = engine.tokenizer.decode(sample["answer_ids"], skip_special_tokens=True).strip()
        stats.tokens += len(sample["answer_ids"])
        why = problem(text, sample["finish_reason"], fingerprints) or (
            "near-duplicate" if dedup.similar(text) else None
        )
        if stats.kept >= count:
            return  # finished beside the last one needed: not recorded, so a later run redoes it
        if why is not None:
            reject_file.write(f"{sample['id']}\t{why}\n")
            reject_file.flush()
            os.fsync(reject_file.fileno())
            stats.rejected[why] += 1
            bar.set_postfix(rejected=sum(stats.rejected.values()))
            return
        dedup.add(text)
        turn = MATH_TEMPLATE.format(question=text) if domain == "math" else text
        record = {
            "id": sample["id"],
            "domain": domain,
            "turns": [turn],
            "system": sample["system"],
            **sampling.fields(),
        }
        if domain == "math":
            record["question"] = text
        writer.write(record)
        stats.kept += 1
        bar.update(1)

    try:
        run = answer_prompts(
            engine,
            candidates(),
            max_new_tokens=max_prompt_tokens,
            batch_size=batch_size,
            sampling=sampling,
            max_prompt_tokens=max(len(h) for h in heads),
            seconds=seconds,
            until=lambda _s: stats.kept >= count,
            on_sample=on_sample,
            share_prefix=False,
        )
        stats.seconds = run.seconds
    finally:
        writer.close()
        reject_file.close()
        bar.close()
    return stats
