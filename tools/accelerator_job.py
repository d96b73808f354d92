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
    # continue a committed run (its recipe, data folders and weights) on the device:
    python tools/accelerator_job.py train --seconds 480 --recipe-from data/train-logs/positions/wide16

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
import io
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accelerator_common as A  # noqa: E402
from accelerator_data import answer, prepare_target, synthesize_prompts  # noqa: E402
from accelerator_files import pack, set_aside  # noqa: E402
from accelerator_train import train  # noqa: E402


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


def cmd_main(args):
    import torch

    from blockdraft.engine import Engine

    if args.fingerprints:
        A.use_fingerprints(args.fingerprints)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        A.log(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    target = args.target or str(prepare_target(args.gguf_parts))
    A.log(f"target ready: {target}")
    engine = Engine.load(target, use_draft=False, dtype=args.dtype)
    if args.prompt_seconds > 0:
        A.stage("prompts", synthesize_prompts, engine, work, args.prompts_per_domain, args.prompt_seconds, args.batch)
    if args.answer_seconds > 0:
        A.stage("answers", answer, engine, work, args.answer_seconds, args.batch, args.max_new_tokens, args.answers)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if args.train:
        A.stage("train", train, work, args.seconds, args.target, args.train_batch, train_settings(args))
    A.stage("pack", pack, work, out)
    A.log("done")


def cmd_more(args):
    """A further run on the same machine from the last run's weights, `--steps` steps of its own
    warmup-stable-decay schedule (warmup 30, decay over the last 30%); the last run moves to
    WORK/train1 and everything is packed again."""
    if args.fingerprints:
        A.use_fingerprints(args.fingerprints)
    work = Path(args.work)
    first = set_aside(work, "train1")
    overrides = dict(
        lr=args.lr, warmup_steps=30, decay_frac=0.3, max_steps=args.steps, init_from=str(first / "drafter")
    )
    A.stage("train", train, work, None, args.target, args.train_batch, overrides)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    A.stage("pack", pack, work, Path(args.out))


def cmd_train(args):
    """Training alone, time-boxed, on the committed answers and those an earlier `main --no-train`
    call left in WORK (the target as that call converted it), then everything packed again."""
    if args.fingerprints:
        A.use_fingerprints(args.fingerprints)
    set_aside(Path(args.work), "train0")
    A.stage("train", train, Path(args.work), args.seconds, args.target, args.train_batch, train_settings(args))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    A.stage("pack", pack, Path(args.work), Path(args.out))
    A.log("done")


def train_settings(args) -> dict:
    """--train-settings (JSON) with --recipe-from: the committed run the training continues."""
    settings = json.loads(args.train_settings)
    if getattr(args, "recipe_from", None):
        settings["recipe_from"] = args.recipe_from
    return settings


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
                            dest = A.ROOT / "data/regen" / folder.name
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
                    dest = A.ROOT / A.PROMPTS
                    members = [m for m in tar.getmembers() if m.name.startswith("prompts/")]
                    for m in members:
                        m.name = m.name[len("prompts/") :]
                else:
                    dest, members = A.ROOT / "runs/accelerator", tar.getmembers()
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


RECIPE_HELP = (
    "a committed position (data/train-logs/positions/NAME): continue that run's drafter, its recipe, data "
    "and weights, at this job's batch (accelerator_train.recipe_from)"
)


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
            p.add_argument("--recipe-from", help=RECIPE_HELP)
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
    p.add_argument("--recipe-from", help=RECIPE_HELP)
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
