"""`accelerator_job.py`'s data stages: the target from its GGUF parts, new prompts, sampled answers."""

from __future__ import annotations

import glob
import os
import shutil
import time
import traceback
from pathlib import Path
import accelerator_common as A  # noqa: E402


def prepare_target(parts: str) -> Path:
    """The default target's GGUF from its parts, converted once into the cache folder that
    `default_target_dir()` reads."""
    from blockdraft.models.default import DEFAULT_TARGET_NAME, GGUF_FILE, cache_home, convert_gguf

    dest = cache_home() / "targets" / DEFAULT_TARGET_NAME
    if (dest / "config.json").is_file():
        return dest
    files = sorted(glob.glob(parts))
    if not files:
        raise SystemExit(f"no GGUF parts match {parts}")
    gguf = cache_home() / "gguf" / GGUF_FILE
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with open(gguf, "wb") as f:
        for p in files:
            f.write(Path(p).read_bytes())
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    convert_gguf(gguf, tmp)
    os.rename(tmp, dest)
    return dest


def synthesize_prompts(engine, work: Path, per_domain: int, seconds: float, batch: int) -> dict:
    from blockdraft.train.data import iter_samples
    from blockdraft.train.prompts import DOMAINS, synthesize

    kept = {}
    for domain in DOMAINS:
        folder = work / "prompts" / f"synth-{domain}"
        src = A.ROOT / A.PROMPTS / f"synth-{domain}"
        if not folder.exists():
            shutil.copytree(src, folder) if src.exists() else folder.mkdir(parents=True)
        have = sum(1 for _ in iter_samples(folder))
        t = time.time()
        stats = synthesize(
            engine, folder, have + per_domain, domain, batch_size=batch, seconds=seconds / len(DOMAINS), progress=False
        )
        kept[domain] = stats.kept - have
        A.log(f"prompts {domain}: {kept[domain]} new in {time.time() - t:.0f}s, rejected {dict(stats.rejected)}")
    return kept


def prompts_to_answer(engine, work: Path, answers: int):
    """New self-written prompts first (answer 0), then every committed prompt's answers 1..N."""
    from blockdraft.train.answers import answer_id
    from blockdraft.train.data import iter_samples, training_prompts
    from blockdraft.train.prompts import prompt_sources

    taken = set()
    for folder in A.COMMITTED_ANSWERS:
        if (A.ROOT / folder).is_dir():
            taken.update(s["id"] for s in iter_samples(A.ROOT / folder))
    if (work / "prompts").is_dir():
        for p in training_prompts(engine.tokenizer, None, 256, sources=prompt_sources(work / "prompts")):
            if p["id"] not in taken:
                yield p
    base = []
    for folder in A.COMMITTED_ANSWERS[:2]:  # the greedy answers: one per distinct prompt
        for s in iter_samples(A.ROOT / folder):
            base.append({k: s[k] for k in ("id", "source", "split", "prompt", "prompt_ids") if k in s})
    for i in range(1, answers + 1):
        for p in base:
            sid = answer_id(p["id"], i)
            if sid not in taken:
                yield {**p, "id": sid, "prompt_id": p["id"], "answer_index": i}


def answer(engine, work: Path, seconds: float, batch: int, max_new_tokens: int, answers: int) -> int:
    from blockdraft.train.answers import AnswerDeduper, AnswerSampling
    from blockdraft.train.data import ShardWriter, iter_samples
    from blockdraft.train.regen import answer_prompts

    out = work / "regen" / A.NEW_ANSWERS
    out.mkdir(parents=True, exist_ok=True)
    sampling = AnswerSampling(temperature=0.7, top_p=0.8, top_k=20)
    dedup = AnswerDeduper(out, iter_samples(out))
    writer = ShardWriter(out)
    written = [0]

    def on_sample(sample):
        if dedup.keep(sample):
            writer.write(sample)
            written[0] += 1
            if written[0] % 2000 == 0:
                A.log(f"answers: {written[0]} written")

    todo = (p for p in prompts_to_answer(engine, work, answers) if p["id"] not in dedup.written)
    next_log = [20.0]
    profiled = A.StepProfiler(start_after=30.0, steps=4)

    def until(st) -> bool:
        try:
            profiled.tick(st.seconds)  # called once per decode step
        except Exception:  # a profile is worth less than the answers
            profiled.left = 0
            A.log(f"answers: profile FAILED:\n{traceback.format_exc()}")
        if st.seconds >= next_log[0]:  # the rate as it goes, for sizing the next lease
            next_log[0] += 20
            A.log(
                f"answers: {st.seconds:.0f}s, {written[0]} written, {st.tokens / st.seconds:.0f} tok/s, "
                f"{st.steps / st.seconds:.1f} steps/s"
            )
        # a device that turns out slow (under MIN_RATE answer tokens/s after 40 s) leaves the time to training
        return st.seconds > 40 and st.tokens < A.MIN_RATE * st.seconds

    try:
        stats = answer_prompts(
            engine,
            todo,
            max_new_tokens=max_new_tokens,
            batch_size=batch,
            sampling=sampling,
            seconds=seconds,
            on_sample=on_sample,
            until=until,
        )
    finally:
        writer.close()
    A.log(
        f"answers: {written[0]} written, {stats.tokens} tokens in {stats.seconds:.0f}s "
        f"({stats.tokens / max(stats.seconds, 1e-9):.0f} tok/s, {stats.steps} steps)"
    )
    return written[0]
