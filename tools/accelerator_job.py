"""Data and a drafter from one short accelerator lease (a CUDA machine with nothing installed of
ours and no network): the default target arrives as its GGUF file in parts, is converted there,
and in one time-boxed run the target

1. writes new user turns (`synthesize`, per domain, continuing the committed prompt folders),
2. answers them and the prompts of the committed greedy answers again, sampled (answer index
   1, 2, 3 of each prompt; T 0.7, top-p 0.8, top-k 20), into a new answer folder,
3. trains a drafter on everything (committed answers + the new ones) for the seconds left,

and everything comes back as files of at most 15 MB: the new prompt and answer shards
(`data-*.tar.partNN`) and the drafter's weights (`drafter.tar.partNN`, fp16) with its metrics.
Unpack them here with `tools/accelerator_job.py unpack FILES_DIR...` (every call's folder, in order:
answers are merged by id).

    python tools/accelerator_job.py smoke --target DIR             # tiny target: every stage, seconds
    python tools/accelerator_job.py main --gguf-parts 'DIR/gguf.part*' --out OUT --seconds 480
    python tools/accelerator_job.py main --no-train ...            # prompts and answers only
    python tools/accelerator_job.py train --seconds 330            # then training alone, time-boxed
    python tools/accelerator_job.py more --steps 300 --lr 1e-3 --out OUT   # a second run from the first's weights

The first lease (one H200, 2026-12-04; logs in data/train-logs/accelerator-h200-1), with the
working tree carried as small as it goes (two calls of at most 64 MiB each: the GGUF's two
halves) and `.xfer/` from `prepare`:

    call 1: mkdir -p /tmp/xfer && cp .xfer/gguf.part0 /tmp/xfer/ && pip install --target /tmp/site .xfer/whl/*.whl
    call 2: cp .xfer/gguf.part1 /tmp/xfer/ && PYTHONPATH=/tmp/site BLOCKDRAFT_HOME=/tmp/bdhome python3 \
            tools/accelerator_job.py main --gguf-parts '/tmp/xfer/gguf.part*' --seconds 520 \
            --prompt-seconds 40 --answer-seconds 160 --batch 2048
    call 3: PYTHONPATH=/tmp/site BLOCKDRAFT_HOME=/tmp/bdhome python3 tools/accelerator_job.py more --steps 300

The second lease (one H200, 2026-12-04; data/train-logs/accelerator-h200-2): the same two calls with
`main --no-train --prompt-seconds 20 --answer-seconds 320 --batch 2048`, which still answered at
1,330 tok/s (0.6 steps/s) and stopped itself after 40 s; `train --seconds 330` (a profile of three
steps: cuDNN attention planning on the host, ~12 ms a call, 31 calls a step, most of 401 ms a step);
then, on a second machine after the fixes here (attention groups off on an accelerator), the same
answer call at `--answer-seconds 230`: 4,554 tok/s, 3,018 answers. Budget: ~70 s per machine start,
~35 s for the GGUF conversion, the rest is the job's own seconds.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import shutil
import sys
import tarfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMMITTED_ANSWERS = [
    "data/regen/smollm2-135m-instruct",
    "data/regen/smollm2-135m-instruct-synth",
    "data/regen/smollm2-135m-instruct-t07",
    "data/regen/smollm2-135m-instruct-t08",
    "data/regen/smollm2-135m-instruct-t10",
    "data/regen/smollm2-135m-instruct-sampled",
]
PROMPTS = "data/prompts/smollm2-135m-instruct"
NEW_ANSWERS = "smollm2-135m-instruct-sampled"  # the folder under data/regen the new answers go to
PART = 15 * 2**20
MIN_RATE = 3000
T0 = time.time()


def log(msg: str):
    print(f"[{time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


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
        src = ROOT / PROMPTS / f"synth-{domain}"
        if not folder.exists():
            shutil.copytree(src, folder) if src.exists() else folder.mkdir(parents=True)
        have = sum(1 for _ in iter_samples(folder))
        t = time.time()
        stats = synthesize(
            engine, folder, have + per_domain, domain, batch_size=batch, seconds=seconds / len(DOMAINS), progress=False
        )
        kept[domain] = stats.kept - have
        log(f"prompts {domain}: {kept[domain]} new in {time.time() - t:.0f}s, rejected {dict(stats.rejected)}")
    return kept


def prompts_to_answer(engine, work: Path, answers: int):
    """New self-written prompts first (answer 0), then every committed prompt's answers 1..N."""
    from blockdraft.train.answers import answer_id
    from blockdraft.train.data import iter_samples, training_prompts
    from blockdraft.train.prompts import prompt_sources

    taken = set()
    for folder in COMMITTED_ANSWERS:
        if (ROOT / folder).is_dir():
            taken.update(s["id"] for s in iter_samples(ROOT / folder))
    if (work / "prompts").is_dir():
        for p in training_prompts(engine.tokenizer, None, 256, sources=prompt_sources(work / "prompts")):
            if p["id"] not in taken:
                yield p
    base = []
    for folder in COMMITTED_ANSWERS[:2]:  # the greedy answers: one per distinct prompt
        for s in iter_samples(ROOT / folder):
            base.append({k: s[k] for k in ("id", "source", "split", "prompt", "prompt_ids") if k in s})
    for i in range(1, answers + 1):
        for p in base:
            sid = answer_id(p["id"], i)
            if sid not in taken:
                yield {**p, "id": sid, "prompt_id": p["id"], "answer_index": i}


def profile_tables(prof, rows: int, *sort_keys: str) -> str:
    """A finished torch profile's ops, one table per sort key (the log's profiles)."""
    avg = prof.key_averages()
    return "".join(avg.table(sort_by=key, row_limit=rows, max_name_column_width=50) for key in sort_keys)


class StepProfiler:
    """Where `steps` decode steps' time goes on the device, once, `start_after` seconds into the
    answers (2,048 rows ran at 2.3 steps/s on an H200 in the second lease, far below the model's
    cost: the next lease reads why from this table)."""

    def __init__(self, start_after: float, steps: int):
        self.start_after, self.steps, self.prof, self.left, self.t = start_after, steps, None, steps, 0.0

    def tick(self, seconds: float):
        import torch

        if not torch.cuda.is_available() or self.left <= 0 or seconds < self.start_after:
            return
        from torch.profiler import ProfilerActivity, profile

        if self.prof is None:
            self.prof, self.t = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]), time.time()
            self.prof.__enter__()
            return
        self.left -= 1
        if self.left == 0:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            log(
                f"answers: profile of {self.steps} steps, {time.time() - self.t:.2f}s wall\n"
                + profile_tables(self.prof, 12, "self_device_time_total", "self_cpu_time_total")
            )


def answer(engine, work: Path, seconds: float, batch: int, max_new_tokens: int, answers: int) -> int:
    from blockdraft.train.answers import AnswerDeduper, AnswerSampling
    from blockdraft.train.data import ShardWriter, iter_samples
    from blockdraft.train.regen import answer_prompts

    out = work / "regen" / NEW_ANSWERS
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
                log(f"answers: {written[0]} written")

    todo = (p for p in prompts_to_answer(engine, work, answers) if p["id"] not in dedup.written)
    next_log = [20.0]
    profiled = StepProfiler(start_after=30.0, steps=4)

    def until(st) -> bool:
        try:
            profiled.tick(st.seconds)  # called once per decode step
        except Exception:  # a profile is worth less than the answers
            profiled.left = 0
            log(f"answers: profile FAILED:\n{traceback.format_exc()}")
        if st.seconds >= next_log[0]:  # the rate as it goes, for sizing the next lease
            next_log[0] += 20
            log(
                f"answers: {st.seconds:.0f}s, {written[0]} written, {st.tokens / st.seconds:.0f} tok/s, "
                f"{st.steps / st.seconds:.1f} steps/s"
            )
        # a device that turns out slow (under MIN_RATE answer tokens/s after 40 s) leaves the time to training
        return st.seconds > 40 and st.tokens < MIN_RATE * st.seconds

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
    log(
        f"answers: {written[0]} written, {stats.tokens} tokens in {stats.seconds:.0f}s "
        f"({stats.tokens / max(stats.seconds, 1e-9):.0f} tok/s, {stats.steps} steps)"
    )
    return written[0]


def train(work: Path, seconds: float | None, target: str | None, batch: int, overrides: dict) -> Path:
    """A DSpark drafter (DFlash + rank-256 Markov head) on all the answers, its schedule sized
    from the first steps' speed so that it ends (decayed) inside `seconds` (None: the
    `max_steps` of `overrides`)."""
    import torch

    from blockdraft.train.config import TrainConfig
    from blockdraft.train.trainer import Trainer

    data = [str(ROOT / f) for f in COMMITTED_ANSWERS if (ROOT / f).is_dir()]
    if (work / "regen" / NEW_ANSWERS).is_dir():
        data.append(str(work / "regen" / NEW_ANSWERS))
    settings = dict(
        block_size=8,
        num_layers=3,
        num_anchors=64,
        batch_size=batch,
        lr=2e-3,
        draft_vocab=8192,
        init="target-last-fc",
        max_seq_len=1024,
        markov_rank=256,
        schedule="wsd",
        warmup_steps=60,
        decay_frac=0.25,
        eval_every=0,
        eval_prompts=32,
        eval_max_new_tokens=96,
        save_every=10**9,
        log_every=20,
        max_steps=10**6,
    )
    settings.update(overrides)
    t = time.time()
    cfg = TrainConfig(data=",".join(data), out=str(work / "train"), target=target, **settings)
    trainer = Trainer(cfg)
    log(f"train: {len(trainer.samples)} sequences loaded in {time.time() - t:.0f}s")
    decode_tau = trainer.evaluate_tau

    def evaluate_tau(*a, **kw):  # a failing decode-loop evaluation must not cost the weights
        try:
            return decode_tau(*a, **kw)
        except Exception:
            log(f"train: decode-loop evaluation FAILED:\n{traceback.format_exc()}")
            return float("nan")

    trainer.evaluate_tau = evaluate_tau
    if seconds is None:
        trainer.run()
        return finish_training(work, trainer)
    probe = 30
    trainer.run(until=10)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.time()
    trainer.run(until=probe)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    per_step = (time.time() - t) / (probe - 10)
    if trainer.device.type == "cuda":
        stage("profile", profile_steps, trainer, probe + 3)
        probe += 3
    left = seconds - (time.time() - T0) - 40  # the final evaluation and packing
    cfg.max_steps = max(probe + 10, probe + int(left / per_step))
    log(
        f"train: {per_step * 1000:.0f} ms/step at batch {batch}; {cfg.max_steps} steps "
        f"({cfg.max_steps * batch / len(trainer.samples):.2f} epochs)"
    )
    trainer.run()
    return finish_training(work, trainer)


def profile_steps(trainer, until: int):
    """Where a few training steps' time goes on the device (for the next lease's sizing)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    t, start = time.time(), trainer.step
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.run(until=until)
        torch.cuda.synchronize()
    log(
        f"profile: {until - start} steps in {time.time() - t:.2f}s wall under the profiler\n"
        + profile_tables(prof, 15, "self_device_time_total")
    )


def finish_training(work: Path, trainer) -> Path:
    if not (work / "train" / "drafter").is_dir():
        trainer.drafter.save(work / "train" / "drafter")
    blocks = trainer.evaluate_blocks(128)
    log(f"train: done; teacher-forced {json.dumps(blocks)[:300]}")
    (work / "train" / "blocks.json").write_text(json.dumps(blocks))
    return work / "train"


def pack(work: Path, out: Path, budget: int = 60 * 2**20):
    """Everything worth keeping as files of at most PART bytes: first the logs and the drafter,
    then the data; what does not fit in `budget` stays in work/ship (a second call fetches it)."""
    ship = work / "ship"
    shutil.rmtree(ship, ignore_errors=True)
    ship.mkdir(parents=True)

    def split(name: str, blob: bytes):
        for i in range(0, max(1, len(blob)), PART):
            (ship / f"{name}.part{i // PART:02d}").write_bytes(blob[i : i + PART])

    run = work / "train"
    if (run / "drafter").is_dir():
        import torch
        from safetensors.torch import load_file

        from blockdraft.checkpoint import write_model_folder

        half = work / "drafter-fp16"  # the drafter's folder with fp16 weights (half the bytes)
        write_model_folder(
            half,
            json.loads((run / "drafter" / "config.json").read_text()),
            load_file(str(run / "drafter" / "model.safetensors")),
            dtype=torch.float16,
        )
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(half, arcname="drafter")
            for name in ("metrics.jsonl", "blocks.json"):
                if (run / name).exists():
                    tar.add(run / name, arcname=name)
        split("drafter.tar", buf.getvalue())
    for what, folder in (("prompts", work / "prompts"), ("answers", work / "regen")):
        if folder.is_dir():
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:  # the shards are gzip files already
                tar.add(folder, arcname=what)
            split(f"data-{what}.tar", buf.getvalue())
    used = 0
    for f in sorted(ship.iterdir(), key=lambda p: (not p.name.startswith("drafter"), p.name)):
        if used + f.stat().st_size > budget:
            log(f"pack: {f.name} stays in {ship} (fetch it with a second call)")
            continue
        shutil.copy(f, out / f.name)
        used += f.stat().st_size
    log(f"pack: {used / 2**20:.1f} MB in {out}: {sorted(p.name for p in out.iterdir())}")


def use_fingerprints(path: Path):
    """The evaluation prompts' fingerprints from a file (their packages are not installed there)."""
    import blockdraft.datasets
    import blockdraft.train.data
    import blockdraft.train.prompts

    fps = json.loads(Path(path).read_text())
    for module in (blockdraft.datasets, blockdraft.train.data, blockdraft.train.prompts):
        if hasattr(module, "eval_fingerprints"):
            module.eval_fingerprints = lambda: fps


def cmd_prepare(args):
    """Here, before the lease: the GGUF in parts, the evaluation fingerprints, the `gguf` wheel and
    a tiny target (the smoke test's) in XFER, which the device calls carry."""
    import torch
    import transformers

    from blockdraft.datasets import eval_fingerprints
    from blockdraft.models.default import default_target_dir, gguf_path

    xfer = Path(args.xfer)
    xfer.mkdir(parents=True, exist_ok=True)
    blob = gguf_path().read_bytes()
    half = (len(blob) + 1) // 2
    for i in range(2):
        (xfer / f"gguf.part{i}").write_bytes(blob[i * half : (i + 1) * half])
    (xfer / "fingerprints.json").write_text(json.dumps(eval_fingerprints()))
    # the GGUF reader transformers converts with (the CUDA machine's image lacks it)
    import subprocess
    from importlib.metadata import version

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(xfer / "whl"),
            f"gguf=={version('gguf')}",
        ],
        check=True,
    )
    tiny = xfer / "tiny-target"
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(tiny))
    transformers.AutoTokenizer.from_pretrained(str(default_target_dir())).save_pretrained(str(tiny))
    for f in sorted(xfer.rglob("*")):
        if f.is_file():
            print(f"{f}: {f.stat().st_size / 2**20:.1f} MB")


def stage(name: str, fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception:  # one stage failing leaves the others (and what it wrote) to come back
        log(f"{name} FAILED:\n{traceback.format_exc()}")
        return None


def cmd_main(args):
    import torch

    from blockdraft.engine import Engine

    if args.fingerprints:
        use_fingerprints(args.fingerprints)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        log(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    target = args.target or str(prepare_target(args.gguf_parts))
    log(f"target ready: {target}")
    engine = Engine.load(target, use_draft=False, dtype=args.dtype)
    if args.prompt_seconds > 0:
        stage("prompts", synthesize_prompts, engine, work, args.prompts_per_domain, args.prompt_seconds, args.batch)
    if args.answer_seconds > 0:
        stage("answers", answer, engine, work, args.answer_seconds, args.batch, args.max_new_tokens, args.answers)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if args.train:
        stage("train", train, work, args.seconds, args.target, args.train_batch, json.loads(args.train_settings))
    stage("pack", pack, work, out)
    log("done")


def set_aside(work: Path, name: str) -> Path:
    """Moves an earlier run's folder WORK/train to WORK/NAME (replacing what was there): left in
    place, its drafter would be packed as the next run's. Returns WORK/NAME."""
    earlier, aside = work / "train", work / name
    if earlier.exists():
        shutil.rmtree(aside, ignore_errors=True)
        earlier.rename(aside)
    return aside


def cmd_more(args):
    """A further run on the same machine from the last run's weights, `--steps` steps of its own
    warmup-stable-decay schedule (warmup 30, decay over the last 30%); the last run moves to
    WORK/train1 and everything is packed again."""
    if args.fingerprints:
        use_fingerprints(args.fingerprints)
    work = Path(args.work)
    first = set_aside(work, "train1")
    overrides = dict(
        lr=args.lr, warmup_steps=30, decay_frac=0.3, max_steps=args.steps, init_from=str(first / "drafter")
    )
    stage("train", train, work, None, args.target, args.train_batch, overrides)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    stage("pack", pack, work, Path(args.out))


def cmd_train(args):
    """Training alone, time-boxed, on the committed answers and those an earlier `main --no-train`
    call left in WORK (the target as that call converted it), then everything packed again."""
    if args.fingerprints:
        use_fingerprints(args.fingerprints)
    set_aside(Path(args.work), "train0")
    stage("train", train, Path(args.work), args.seconds, args.target, args.train_batch, json.loads(args.train_settings))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    stage("pack", pack, Path(args.work), Path(args.out))
    log("done")


def cmd_fetch_rest(args):
    out, ship = Path(args.out), Path(args.work) / "ship"
    for f in sorted(ship.iterdir()):
        if not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    print(sorted(p.name for p in out.iterdir()))


def cmd_unpack(args):
    """Join the parts and unpack: prompts into data/prompts/... (the device's folders are the
    committed ones plus new shards), answers merged by id into data/regen/... (several calls and
    machines number their shards from 0 and may answer the same (prompt, answer index): a sample
    whose id the folder holds is skipped), the drafter into runs/accelerator/."""
    import tempfile

    from blockdraft.train.data import ShardWriter, iter_samples

    for files in args.files:
        src = Path(files)
        groups: dict[str, list[Path]] = {}
        for p in sorted(src.glob("*.part*")):
            groups.setdefault(p.name.rsplit(".part", 1)[0], []).append(p)
        for name, parts in groups.items():
            blob = b"".join(p.read_bytes() for p in sorted(parts))
            with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
                if name.startswith("data-answers"):
                    with tempfile.TemporaryDirectory() as tmp:
                        tar.extractall(tmp, filter="data")
                        for folder in sorted(Path(tmp, "answers").iterdir()):
                            dest = ROOT / "data/regen" / folder.name
                            dest.mkdir(parents=True, exist_ok=True)
                            have = {s["id"] for s in iter_samples(dest)}
                            writer, added = ShardWriter(dest), 0
                            for sample in iter_samples(folder):
                                if sample["id"] not in have:
                                    writer.write(sample)
                                    have.add(sample["id"])
                                    added += 1
                            writer.close()
                            print(f"{src / name}: {added} new answers -> {dest}")
                    continue
                if name.startswith("data-prompts"):
                    dest = ROOT / PROMPTS
                    members = [m for m in tar.getmembers() if m.name.startswith("prompts/")]
                    for m in members:
                        m.name = m.name[len("prompts/") :]
                else:
                    dest, members = ROOT / "runs/accelerator", tar.getmembers()
                members = [m for m in members if m.name]
                tar.extractall(dest, members=members, filter="data")
                print(f"{src / name}: {len(parts)} part(s) -> {dest}")


def cmd_smoke(args):
    """Every stage on a tiny target, on whatever device is here, in seconds."""
    args.gguf_parts = None
    args.prompt_seconds, args.answer_seconds, args.seconds = 6, 8, 60
    args.prompts_per_domain, args.answers, args.max_new_tokens, args.batch = 8, 1, 24, 16
    args.train, args.train_batch = True, 4
    args.train_settings = json.dumps({"eval_prompts": 2, "eval_max_new_tokens": 16, "max_seq_len": 256})
    cmd_main(args)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("main", "smoke"):
        p = sub.add_parser(name)
        p.add_argument("--target", help="a target folder (default: the default target from --gguf-parts)")
        p.add_argument("--out", default=os.environ.get("OUT", "out/accelerator"))
        p.add_argument("--work", default="/tmp/accelerator-work")
        p.add_argument("--dtype", default=None)
        p.add_argument(
            "--fingerprints",
            default=".xfer/fingerprints.json",
            help="the evaluation prompts' fingerprints (written by `prepare`); empty: computed here",
        )
        if name == "main":
            p.add_argument("--gguf-parts", default=".xfer/gguf.part*")
            p.add_argument("--seconds", type=float, default=480, help="the whole job's wall-clock budget")
            p.add_argument("--prompt-seconds", type=float, default=60)
            p.add_argument("--prompts-per-domain", type=int, default=10000)
            p.add_argument("--answer-seconds", type=float, default=200)
            p.add_argument("--answers", type=int, default=3, help="sampled answers per committed prompt")
            p.add_argument("--max-new-tokens", type=int, default=512)
            p.add_argument("--batch", type=int, default=1024)
            p.add_argument("--train", action=argparse.BooleanOptionalAction, default=True)
            p.add_argument("--train-batch", type=int, default=64)
            p.add_argument("--train-settings", default="{}")
    p = sub.add_parser("more")
    p.add_argument("--target")
    p.add_argument("--out", default=os.environ.get("OUT", "out/accelerator"))
    p.add_argument("--work", default="/tmp/accelerator-work")
    p.add_argument("--fingerprints", default=".xfer/fingerprints.json")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-batch", type=int, default=64)
    p = sub.add_parser("train")
    p.add_argument("--target")
    p.add_argument("--out", default=os.environ.get("OUT", "out/accelerator"))
    p.add_argument("--work", default="/tmp/accelerator-work")
    p.add_argument("--fingerprints", default=".xfer/fingerprints.json")
    p.add_argument("--seconds", type=float, default=300, help="this call's wall-clock budget")
    p.add_argument("--train-batch", type=int, default=64)
    p.add_argument("--train-settings", default="{}")
    for name in ("fetch-rest",):
        p = sub.add_parser(name)
        p.add_argument("--out", default=os.environ.get("OUT", "out/accelerator"))
        p.add_argument("--work", default="/tmp/accelerator-work")
    p = sub.add_parser("prepare")
    p.add_argument("--xfer", default=".xfer")
    p = sub.add_parser("unpack")
    p.add_argument("files", nargs="+", help="folders of parts, in the order the calls returned them")
    args = ap.parse_args()
    {
        "main": cmd_main,
        "smoke": cmd_smoke,
        "prepare": cmd_prepare,
        "more": cmd_more,
        "train": cmd_train,
        "fetch-rest": cmd_fetch_rest,
        "unpack": cmd_unpack,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
