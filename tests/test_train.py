"""Training: anchors and masks, train/inference consistency, resume after SIGKILL or a stop signal, DDP."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import blockdraft.train.blocks as blocks_mod
from blockdraft.batcher import generate_steps
from blockdraft.decode import DecodeLoop
from blockdraft.draft import DFlashDrafter
from blockdraft.models import load_target
from blockdraft.proposers import DFlashProposer, Draft, Proposer
from blockdraft.sequences import Request, SequenceState
from blockdraft.train.blocks import IGNORE, build_blocks
from blockdraft.train.config import TrainConfig
from blockdraft.errors import BlockdraftError
from blockdraft.train.trainer import Trainer

from .conftest import save_tiny_hf

VOCAB, MASK = 97, 96


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """A tiny random target and its own greedy answers to 16 random prompts."""
    root = tmp_path_factory.mktemp("train")
    hf = save_tiny_hf("llama", root / "target", vocab_size=VOCAB, num_hidden_layers=4)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8)
    hf.save_pretrained(str(root / "target"))
    target = load_target(root / "target")
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, MASK, (int(torch.randint(5, 10, (1,), generator=g)),), generator=g).tolist() for _ in range(16)
    ]
    states = []
    list(generate_steps(target, Proposer(), [Request(p, 40) for p in prompts], 1, states))
    (root / "data").mkdir()
    with open(root / "data" / "shard-00000.jsonl", "w") as f:
        for i, (p, s) in enumerate(zip(prompts, states, strict=False)):
            f.write(
                json.dumps(
                    {
                        "id": f"t/{i}",
                        "split": "train",
                        "prompt": "",
                        "prompt_ids": p,
                        "answer_ids": s.output_ids,
                        "finish_reason": s.finish_reason,
                    }
                )
                + "\n"
            )
    return root, target, prompts, [s.output_ids for s in states]


def tiny_config(root, out, **kw):
    base = dict(
        data=str(root / "data"),
        out=str(out),
        target=str(root / "target"),
        block_size=4,
        num_layers=2,
        mask_token_id=MASK,
        num_anchors=12,
        target_layer_ids=[3],
        batch_size=4,
        max_seq_len=64,
        max_steps=20,
        lr=3e-3,
        warmup_frac=0.05,
        eval_every=10_000,
        eval_prompts=4,
        eval_max_new_tokens=24,
        save_every=5,
        log_every=1,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_blocks_follow_the_recipe():
    seq = list(range(10, 30))  # prompt 10..14, answer from position 5
    b = build_blocks(
        [seq],
        [5],
        block_size=4,
        num_anchors=3,
        mask_token_id=MASK,
        gamma=4.0,
        generator=torch.Generator().manual_seed(0),
    )
    width = len(seq)
    for j in range(3):
        rows = slice(4 * j, 4 * j + 4)
        a = int(b.block_positions[0, 4 * j])
        assert 5 <= a <= len(seq) - 2
        assert b.block_tokens[0, rows].tolist() == [seq[a], MASK, MASK, MASK]
        assert b.block_positions[0, rows].tolist() == [a, a + 1, a + 2, a + 3]
        assert b.labels[0, 4 * j] == IGNORE
        for k in range(1, 4):  # same-position labels, no shift
            assert b.labels[0, 4 * j + k] in (seq[a + k] if a + k < len(seq) else IGNORE,)
        assert b.weights[0, 4 * j + 1 : 4 * j + 4].tolist() == pytest.approx([1.0, 0.7788, 0.6065], abs=1e-4)
        m = b.mask[0, 0, 4 * j]
        assert m[:width].tolist() == [p < a for p in range(width)]  # context strictly before the anchor
        own = m[width:].view(3, 4)
        assert own[j].all() and own.sum() == 4  # its own block, never another


def check_forward_consistency(trainer):
    """Every block's hidden states from the masked training forward equal those of the
    decode loop's cached forward, where the target has processed exactly x_0..x_{a-1}."""
    batch = trainer.batch_at(0)
    with torch.no_grad():
        train_hidden, _ = trainer.block_hidden(batch)
    target, drafter, bs = trainer.target, trainer.drafter, trainer.cfg.block_size
    checked = 0
    for i in range(batch.tokens.shape[0]):
        seq = batch.tokens[i, : int(batch.lengths[i])].tolist()
        for j in range(batch.block_tokens.shape[1] // bs):
            rows = slice(j * bs, (j + 1) * bs)
            if (batch.labels[i, rows] == IGNORE).all():
                continue
            a = int(batch.block_positions[i, j * bs])
            proposer = DFlashProposer(drafter, target)
            proposer.reset(1, a + bs)
            with torch.no_grad():
                pos = torch.arange(a)[None]
                _, feats = target(
                    torch.tensor([seq[:a]]), pos, target.new_cache(1, a + bs), capture=proposer.capture_layers
                )
                proposer.observe(None, feats, pos)
                proposer.propose(torch.tensor([seq[a]]), torch.tensor([a]), proposer.max_block_size - 1)  # the context
                block = torch.tensor([[seq[a]] + [MASK] * (bs - 1)])
                dec = drafter(target.embed(block), torch.arange(a, a + bs)[None], cache=proposer.cache)
            torch.testing.assert_close(train_hidden[i, rows], dec[0], atol=2e-5, rtol=1e-4)
            checked += 1
    assert checked >= 8


class LabelProposer(DFlashProposer):
    """Drafts exactly the training labels of a block anchored at the current position."""

    def __init__(self, drafter, target, label_of):
        super().__init__(drafter, target)
        self.label_of = label_of

    def propose(self, last_tokens, positions, n, rows=slice(None), probs=False):
        super().propose(last_tokens, positions, n, rows)
        return Draft(torch.tensor([self.label_of(int(positions[0]), n)]))


def check_label_consistency(trainer, corpus_prompts, corpus_answers):
    """Drafting a block's training labels in the real decode loop gets it fully accepted."""
    cfg = trainer.cfg
    first = 1 - trainer.shift  # the first block slot with a label
    for p, ans in list(zip(corpus_prompts, corpus_answers, strict=False))[:4]:
        seq = p + ans
        batch = build_blocks(
            [seq],
            [len(p)],
            block_size=cfg.block_size,
            num_anchors=len(seq),
            mask_token_id=MASK,
            gamma=None,
            generator=torch.Generator().manual_seed(0),
            shift=trainer.shift,
        )
        labels = {
            int(batch.block_positions[0, j]): batch.labels[0, j + first : j + cfg.block_size].tolist()
            for j in range(0, batch.block_tokens.shape[1], cfg.block_size)
        }

        def label_of(a, n):
            got = labels.get(a, [IGNORE] * n)  # noqa: B023 (called within this iteration, by generate_steps below)
            return [t if t != IGNORE else 0 for t in got]

        states = []
        proposer = LabelProposer(trainer.drafter, trainer.target, label_of)
        verified = proposer.max_block_size  # the block size, one more in DSpark's layout
        assert verified == cfg.block_size + trainer.shift
        list(generate_steps(trainer.target, proposer, [Request(p, len(ans))], verified, states))
        assert states[0].output_ids == ans
        full = states[0].acceptance_lengths[:-1]  # the last block may run past the answer
        assert full and set(full) == {verified}, f"training labels not accepted: {full}"


@pytest.mark.parametrize("layout", ["mask", "anchor"])
def test_training_and_decoding_see_the_same_blocks(tiny_corpus, tmp_path, layout):
    root, _, prompts, answers = tiny_corpus
    trainer = Trainer(tiny_config(root, tmp_path / "run", draft_layout=layout))
    check_forward_consistency(trainer)
    check_label_consistency(trainer, prompts, answers)


def test_anchor_layout_blocks_label_the_token_after_each_slot():
    """DSpark's layout: every slot of [x_a, MASK x 3] is labelled with the token after it, the
    anchor's included; weights decay from the anchor slot; the Markov head's previous token is
    the slot's own (x_{a+k})."""
    from blockdraft.train.loss import previous_tokens

    seq = list(range(10, 30))
    b = build_blocks(
        [seq],
        [5],
        block_size=4,
        num_anchors=3,
        mask_token_id=MASK,
        gamma=4.0,
        generator=torch.Generator().manual_seed(0),
        shift=1,
    )
    prev = previous_tokens(b)
    for j in range(3):
        a = int(b.block_positions[0, 4 * j])
        assert b.block_tokens[0, 4 * j : 4 * j + 4].tolist() == [seq[a], MASK, MASK, MASK]
        for k in range(4):
            want = seq[a + k + 1] if a + k + 1 < len(seq) else IGNORE
            assert int(b.labels[0, 4 * j + k]) == want
            if want != IGNORE:
                assert int(prev[0, 4 * j + k]) == seq[a + k]
        assert b.weights[0, 4 * j : 4 * j + 3].tolist() == pytest.approx([1.0, 0.7788, 0.6065], abs=1e-4)


class SlotOneProposer(DFlashProposer):
    """A decode loop that reads an anchor-layout block the DFlash way (drafts from slot 1)."""

    def block_hidden(self, last_tokens, positions, n, rows):
        self.first_slot = 1
        return super().block_hidden(last_tokens, positions, n, rows)


def test_overfit_anchor_layout_drafter_is_accepted_whole_and_a_misread_loop_is_not(tiny_corpus, tmp_path):
    """An anchor-layout drafter overfit on the corpus is accepted nearly whole in the real decode
    loop at its full block (4 drafts + 1); a loop that reads its slots DFlash's way is not."""
    root, _, prompts, _ = tiny_corpus
    cfg = tiny_config(root, tmp_path / "run", max_steps=200, save_every=10_000, log_every=50, draft_layout="anchor")
    trainer = Trainer(cfg)
    trainer.run()
    drafter = DFlashDrafter.load(tmp_path / "run" / "drafter")
    assert drafter.config.sample_from_anchor and drafter.config.max_drafts == 4

    def tau(proposer_class):
        states = []
        reqs = [Request(p, 32) for p in prompts[:8]]
        list(generate_steps(trainer.target, proposer_class(drafter, trainer.target), reqs, 5, states))
        lengths = [a for s in states for a in s.acceptance_lengths]
        return sum(lengths) / len(lengths)

    right = tau(DFlashProposer)
    assert right >= 4.0, f"tau {right:.2f} of 5 after overfitting: train and decode disagree"
    blocks = trainer.evaluate_blocks(16)
    assert blocks["blocks"] > 100 and abs(blocks["tau_blocks"] - right) < 0.4, (blocks, right)
    assert len(blocks["val_acc"]) == 4 and blocks["val_acc"][0] > 0.9
    assert tau(SlotOneProposer) < right - 1.0


def buggy_blocks(bug):
    right = blocks_mod.build_blocks

    def build(*args, **kw):
        b = right(*args, **kw)
        block = int(b.offsets.max()) + 1
        if bug == "labels shifted by one":
            b.labels = torch.cat([b.labels[:, 1:], torch.full_like(b.labels[:, :1], IGNORE)], dim=1)
            b.labels[b.offsets == 0] = IGNORE
        else:  # `<=` instead of `<`: each block also sees the context feature AT its anchor
            for i in range(b.mask.shape[0]):
                for j in range(b.mask.shape[2] // block):
                    rows = slice(j * block, (j + 1) * block)
                    if (b.labels[i, rows] != IGNORE).any():
                        b.mask[i, 0, rows, int(b.block_positions[i, j * block])] = True
        return b

    return build


@pytest.mark.parametrize("bug", ["labels shifted by one", "context visible at the anchor"])
def test_the_consistency_checks_catch_the_classic_bugs(tiny_corpus, tmp_path, monkeypatch, bug):
    import blockdraft.train.trainer as trainer_mod

    root, _, prompts, answers = tiny_corpus
    monkeypatch.setattr(trainer_mod, "build_blocks", buggy_blocks(bug))
    monkeypatch.setattr(sys.modules[__name__], "build_blocks", buggy_blocks(bug))
    trainer = Trainer(tiny_config(root, tmp_path / "run"))
    with pytest.raises(AssertionError):
        check_forward_consistency(trainer)
        check_label_consistency(trainer, prompts, answers)


def test_overfit_drafter_accepts_nearly_whole_blocks_in_the_real_decode_loop(tiny_corpus, tmp_path):
    root, _, prompts, _ = tiny_corpus
    cfg = tiny_config(root, tmp_path / "run", max_steps=200, save_every=10_000, log_every=50)
    trainer = Trainer(cfg)
    trainer.run()
    drafter = DFlashDrafter.load(tmp_path / "run" / "drafter")
    states = []
    reqs = [Request(p, 32) for p in prompts[:8]]
    list(generate_steps(trainer.target, DFlashProposer(drafter, trainer.target), reqs, 4, states))
    lengths = [a for s in states for a in s.acceptance_lengths]
    tau = sum(lengths) / len(lengths)
    assert tau >= 3.3, f"tau {tau:.2f} of 4 after overfitting: train and decode disagree"
    # the teacher-forced estimate on the same answers agrees with the decode loop
    blocks = trainer.evaluate_blocks(16)
    assert blocks["blocks"] > 100 and abs(blocks["tau_blocks"] - tau) < 0.3, (blocks, tau)
    assert blocks["val_acc"][0] > 0.9


def train_cli(root, out, *extra, nproc=1):
    args = [
        "--data",
        str(root / "data"),
        "--out",
        str(out),
        "--target",
        str(root / "target"),
        "--block-size",
        "4",
        "--num-layers",
        "1",
        "--mask-token-id",
        str(MASK),
        "--num-anchors",
        "6",
        "--batch-size",
        "2",
        "--max-steps",
        "12",
        "--save-every",
        "3",
        "--log-every",
        "1",
        "--eval-every",
        "1000",
        "--eval-prompts",
        "2",
        "--eval-max-new-tokens",
        "8",
        *extra,
    ]
    runner = (
        [sys.executable, "-m", "blockdraft"]
        if nproc == 1
        else [
            # --standalone: a free port: two suites may run at once
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--standalone",
            "-m",
            "blockdraft",
        ]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*runner, "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def drafter_weights(folder):
    return DFlashDrafter.load(folder).state_dict()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_a_killed_or_stopped_run_resumes_to_the_same_weights_as_an_uninterrupted_run(tiny_corpus, tmp_path, sig):
    """SIGKILL: --resume continues from the last periodic checkpoint (every 3 steps). SIGTERM /
    SIGINT: the run stops at the end of the step it is in with a checkpoint there (none are due:
    --save-every 1000) and exits with the shell's code for the signal. Either way the resumed run
    ends with the straight run's weights, bit for bit, and logs every step once."""
    root = tiny_corpus[0]
    # 60 steps: the signal below lands at step 7 or soon after, and a tiny run of 12 steps could
    # finish (~0.3 s) before the poll saw step 7 on a loaded machine
    steps = ("--max-steps", "60")
    straight = train_cli(root, tmp_path / "straight", *steps)
    assert straight.wait(timeout=600) == 0, straight.stderr.read()
    graceful = sig != signal.SIGKILL
    killed = train_cli(root, tmp_path / "killed", *steps, *(("--save-every", "1000") if graceful else ()))
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline:  # let it pass a checkpoint or two, then stop it mid-run
        if metrics.is_file() and any(
            json.loads(line)["step"] >= 7 for line in metrics.read_text().splitlines() if line
        ):
            break
        time.sleep(0.05)
    killed.send_signal(sig)
    _, err = killed.communicate(timeout=600)
    state = json.loads((tmp_path / "killed" / "checkpoint" / "state.json").read_text())
    if graceful:
        assert killed.returncode == 128 + sig, err
        logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        assert 7 <= state["step"] == logged[-1] < 60  # the step it was in, saved although none was due
        assert f"stopped at step {state['step']} of 60" in err
    else:
        assert killed.returncode == -signal.SIGKILL
        assert 3 <= state["step"] < 60
    resumed = train_cli(root, tmp_path / "killed", *steps, "--resume")
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()
    a, b = drafter_weights(tmp_path / "straight" / "drafter"), drafter_weights(tmp_path / "killed" / "drafter")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert logged == list(range(1, 61))  # no step lost or logged twice


def test_two_process_ddp_training_on_cpu(tiny_corpus, tmp_path):
    root = tiny_corpus[0]
    proc = train_cli(root, tmp_path / "ddp", nproc=2)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    assert "2 process(es)" in err and "2 processes in sync" in err
    records = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[-1]["loss"] < records[0]["loss"]
    assert "tau" in records[-1]


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker of `rank`: a descendant of the launcher with RANK=rank in its
    environment (Linux's /proc)."""

    def parent(pid: int) -> int:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])

    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or f"RANK={rank}".encode() not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            pid = int(entry.name)
            while pid > 1 and pid != launcher_pid:
                pid = parent(pid)
        except OSError:
            continue
        if pid == launcher_pid:
            return int(entry.name)
    return None


def test_a_stop_signal_to_one_ddp_process_stops_both_at_the_next_checkpoint(tiny_corpus, tmp_path):
    """DDP: SIGTERM reaches only rank 1; both processes agree at the next checkpoint step (every
    5), save there and stop; --resume on two processes ends with the straight run's weights."""
    root = tiny_corpus[0]
    steps = ("--max-steps", "200", "--save-every", "5")  # long enough for the signal to land mid-run
    straight = train_cli(root, tmp_path / "straight", *steps, nproc=2)
    out, err = straight.communicate(timeout=600)
    assert straight.returncode == 0, out + err
    stopped = train_cli(root, tmp_path / "stopped", *steps, nproc=2)
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline:
        if metrics.is_file() and any(
            json.loads(line)["step"] >= 7 for line in metrics.read_text().splitlines() if line
        ):
            break
        time.sleep(0.05)
    pid = worker_pid(stopped.pid, 1)
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    out, err = stopped.communicate(timeout=600)
    assert stopped.returncode != 0  # torchrun reports its workers' exit code 143 as a failure
    state = json.loads((tmp_path / "stopped" / "checkpoint" / "state.json").read_text())
    assert 10 <= state["step"] < 200 and state["step"] % 5 == 0, out + err
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert logged[-1] == state["step"], out + err  # both stopped there: rank 0 logs and saved nothing after
    assert f"stopped at step {state['step']} of 200" in err
    resumed = train_cli(root, tmp_path / "stopped", *steps, "--resume", nproc=2)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out + err
    a, b = drafter_weights(tmp_path / "straight" / "drafter"), drafter_weights(tmp_path / "stopped" / "drafter")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eagle_training_forward_equals_the_decode_chain(tiny_corpus):
    """The EAGLE baseline's training-time-test forward (mask, positions, fed-back hidden
    states) reproduces exactly the chain its proposer drafts in the decode loop."""
    from blockdraft.eagle import EagleConfig, EagleDrafter
    from blockdraft.proposers import EagleProposer

    _, target, prompts, answers = tiny_corpus
    torch.manual_seed(3)
    drafter = EagleDrafter(EagleConfig.for_target(target.config, block_size=5, target_layer_ids=[1, 3])).eval()
    drafter.reset_parameters(0.2)
    seq = prompts[0] + answers[0]
    anchors = [len(prompts[0]) + 2, len(prompts[0]) + 9]
    with torch.no_grad():
        _, feats = target(torch.tensor([seq]), torch.arange(len(seq))[None], capture=(1, 3))
        for a in anchors:
            proposer = EagleProposer(drafter, target)
            # prefill x_0 .. x_{a-1} through the loop's own machinery, then draft 4 tokens after x_a
            loop = DecodeLoop(target, proposer, 5, 1, len(seq) + 8)
            loop.admit([(0, Request(seq[:a], 1), SequenceState())])
            drafts = proposer.propose(torch.tensor([seq[a]]), torch.tensor([a]), 4).tokens[0].tolist()
            teacher = torch.tensor([[[seq[a]] + drafts[:3]]])
            hidden = drafter(target.embed, torch.tensor([seq]), feats, torch.tensor([[a]]), teacher)
            chain = drafter.draft_tokens(hidden[0, 1:], target.lm_head.weight).tolist()
            assert chain == drafts, (a, chain, drafts)


def test_draft_vocabulary_covers_the_answers_and_survives_a_round_trip(tiny_corpus, tmp_path):
    root, _, prompts, answers = tiny_corpus
    trainer = Trainer(tiny_config(root, tmp_path / "run", draft_vocab=40))
    vocab = set(trainer.drafter.draft_vocab.tolist())
    counts = {}
    for a in answers:
        for t in a:
            counts[t] = counts.get(t, 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    assert len(vocab) == 40 and len(counts) > 40  # the vocabulary must choose
    # every answer token more frequent than the 40th most frequent one is in the vocabulary
    assert {t for t, c in counts.items() if c > ranked[39]} <= vocab
    assert all(counts.get(t, 0) >= ranked[40] for t in vocab)
    check_forward_consistency(trainer)
    trainer.drafter.save(tmp_path / "d", dtype=torch.float16)
    back = DFlashDrafter.load(tmp_path / "d")
    assert torch.equal(back.draft_vocab, trainer.drafter.draft_vocab) and back.draft_vocab.dtype == torch.long
    h = torch.randn(3, trainer.drafter.config.hidden_size)
    ids = back.draft_tokens(h, trainer.target.lm_head.weight)
    assert set(ids.tolist()) <= vocab


def test_overfit_eagle_drafter_accepts_long_chains(tiny_corpus, tmp_path):
    from blockdraft.eagle import EagleDrafter
    from blockdraft.proposers import EagleProposer

    root, _, prompts, _ = tiny_corpus
    trainer = Trainer(
        tiny_config(root, tmp_path / "run", arch="eagle3", max_steps=200, save_every=10_000, log_every=50)
    )
    trainer.run()
    drafter = EagleDrafter.load(tmp_path / "run" / "drafter")
    states = []
    list(
        generate_steps(
            trainer.target, EagleProposer(drafter, trainer.target), [Request(p, 32) for p in prompts[:8]], 4, states
        )
    )
    lengths = [a for s in states for a in s.acceptance_lengths]
    assert sum(lengths) / len(lengths) >= 3.0


def test_target_forward_can_stop_at_the_deepest_captured_layer(tiny_corpus):
    _, target, prompts, answers = tiny_corpus
    seq = torch.tensor([prompts[0] + answers[0]])
    pos = torch.arange(seq.shape[1])[None]
    with torch.no_grad():
        final, full = target(seq, pos, capture=(1, 2))
        none, early = target(seq, pos, capture=(1, 2), features_only=True)
    assert none is None and final is not None and torch.equal(full, early)


def test_learning_rate_schedules():
    from blockdraft.train.config import lr_at

    cos = TrainConfig(data="", out="", max_steps=100, lr=1.0, warmup_frac=0.1)
    wsd = TrainConfig(data="", out="", max_steps=100, lr=1.0, warmup_frac=0.1, schedule="wsd", decay_frac=0.2)
    assert lr_at(cos, 0) == pytest.approx(0.1) and lr_at(wsd, 9) == pytest.approx(1.0)
    assert lr_at(cos, 55) == pytest.approx(0.5) and lr_at(cos, 99) < 0.01
    assert lr_at(wsd, 50) == 1.0 and lr_at(wsd, 79) == 1.0  # stable
    assert lr_at(wsd, 90) == pytest.approx(0.5) and lr_at(wsd, 99) == pytest.approx(0.05)  # linear decay


@pytest.mark.parametrize("topk", [8, 97])
def test_soft_label_loss_is_the_cross_entropy_against_the_target_distribution(tiny_corpus, tmp_path, monkeypatch, topk):
    """distill=1: the loss equals sum_k w_k * CE(q, drafter logits) / sum_k w_k, where q is the target's
    distribution predicting x_{a+k} cut to its `topk` likeliest tokens and renormalized (log-probabilities
    rounded to float16, as the feature cache keeps them), computed here from the full target forward
    position by position; at topk = the vocabulary that is the whole distribution. distill=0 is the
    hard-label loss."""
    import torch.nn.functional as F

    from blockdraft.train import features, trainer as trainer_mod
    from blockdraft.train.loss import weighted_loss

    monkeypatch.setattr(features, "TEACHER_TOPK", topk)
    monkeypatch.setattr(trainer_mod, "TEACHER_TOPK", topk)
    root = tiny_corpus[0]
    trainer = Trainer(tiny_config(root, tmp_path / "run", distill=1.0))
    batch = trainer.batch_at(0)
    with torch.no_grad():
        hidden, teacher = trainer.block_hidden(batch)
        head = trainer.target.lm_head.weight
        n, width = batch.tokens.shape
        final, _ = trainer.target(batch.tokens, torch.arange(width).expand(n, -1))  # no cache: causal
        num = den = 0.0
        for i in range(n):
            for j in range(batch.labels.shape[1]):
                if batch.labels[i, j] == IGNORE:
                    continue
                p = int(batch.block_positions[i, j]) - 1  # the target predicts x_{p+1} at p
                logp = torch.log_softmax(trainer.target.logits(final[i, p]).float(), -1)
                top = logp.topk(topk)
                want = torch.softmax(top.values.half().float(), -1)
                if topk == head.shape[0]:
                    torch.testing.assert_close(want, logp.exp()[top.indices], rtol=2e-3, atol=1e-5)
                got = torch.log_softmax(F.linear(hidden[i, j], head), -1)[top.indices]
                num += float(batch.weights[i, j]) * float(-(want * got).sum())
                den += float(batch.weights[i, j])
        args = (hidden, head, batch.labels, batch.weights, batch.offsets, 4, 7)
        soft, _, _ = weighted_loss(*args, teacher=teacher, distill=1.0)
        hard, _, _ = weighted_loss(*args)
        hard_too, _, _ = weighted_loss(*args, teacher=teacher, distill=0.0)
    assert float(soft) == pytest.approx(num / den, rel=1e-4)
    assert float(hard_too) == pytest.approx(float(hard), rel=1e-6) and abs(float(soft) - float(hard)) > 1e-3


def test_mixed_precision_training_bf16_target_fp32_drafter(tiny_corpus, tmp_path):
    """A bf16 target with an fp32 drafter under autocast (the CUDA configuration), on CPU: the
    drafter keeps fp32 weights, its first loss matches the fp32 run's to bf16 precision, the loss
    falls, the held-out tau evaluation runs the drafter in the target's dtype, and the
    teacher-forced evaluation agrees with the fp32 one on the same drafter."""
    root = tiny_corpus[0]
    kw = dict(max_steps=30, lr=1e-2, save_every=10_000, eval_every=30, log_every=1)
    ref = Trainer(tiny_config(root, tmp_path / "fp32", **kw))
    mixed = Trainer(tiny_config(root, tmp_path / "bf16", dtype="bfloat16", **kw))
    assert mixed.target.lm_head.weight.dtype == torch.bfloat16
    first_ref = Trainer.host_record(ref.train_step())
    first = Trainer.host_record(mixed.train_step())
    assert all(p.dtype == torch.float32 for p in mixed.drafter.parameters())
    assert first["loss"] == pytest.approx(first_ref["loss"], rel=0.03)
    mixed.run()
    records = [json.loads(line) for line in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < 0.7 * first["loss"]
    assert records[-1]["tau"] >= 1.0
    ref.drafter.load_state_dict(mixed.drafter.state_dict())
    blocks, blocks_ref = mixed.evaluate_blocks(num_samples=8), ref.evaluate_blocks(num_samples=8)
    assert blocks["blocks"] == blocks_ref["blocks"] > 0
    assert blocks["val_ce"] == pytest.approx(blocks_ref["val_ce"], rel=0.05, abs=0.05)


def test_regeneration_with_a_bf16_target_records_it(tiny_corpus, tokenizer):
    """`data regenerate --dtype bfloat16`: the batched loop's answers are the bf16 target's own
    one-by-one greedy answers, and each sample says which precision answered (fp32 ones do not)."""
    from blockdraft import Engine
    from blockdraft.train.regen import answer_prompts

    root, _, prompts, _ = tiny_corpus
    items = [{"id": f"t/{i}", "split": "train", "prompt_ids": p} for i, p in enumerate(prompts[:5])]
    for dtype in (torch.bfloat16, torch.float32):
        engine = Engine(load_target(root / "target", dtype=dtype), tokenizer)
        got = []
        answer_prompts(engine, iter(items), max_new_tokens=16, batch_size=2, on_sample=got.append, share_prefix=False)
        assert len(got) == 5
        for s in got:
            assert s["answer_ids"] == engine.generate(s["prompt_ids"], method="ar", max_new_tokens=16).token_ids
            assert s.get("dtype") == ("bfloat16" if dtype == torch.bfloat16 else None)


def test_warm_start_from_a_saved_drafter_and_a_clear_error_on_a_shape_mismatch(tiny_corpus, tmp_path):
    from blockdraft.errors import BlockdraftError

    root = tiny_corpus[0]
    first = Trainer(tiny_config(root, tmp_path / "a", max_steps=3, eval_every=10_000))
    first.run()
    warm = Trainer(tiny_config(root, tmp_path / "b", init_from=str(tmp_path / "a" / "drafter")))
    saved = DFlashDrafter.load(tmp_path / "a" / "drafter").state_dict()
    assert all(torch.equal(saved[k].float(), v.float()) for k, v in warm.drafter.state_dict().items())
    with pytest.raises(BlockdraftError, match="another shape"):
        Trainer(tiny_config(root, tmp_path / "c", target_layer_ids=[1, 3], init_from=str(tmp_path / "a" / "drafter")))
    # a deeper drafter: the saved layers, and its own fresh initialization past them
    fresh = Trainer(tiny_config(root, tmp_path / "d", num_layers=3)).drafter.state_dict()
    deeper = Trainer(tiny_config(root, tmp_path / "e", num_layers=3, init_from=str(tmp_path / "a" / "drafter")))
    for k, v in deeper.drafter.state_dict().items():
        want = fresh[k] if k.startswith("layers.2.") else saved[k]
        assert torch.equal(want.float(), v.float()), k


def test_warm_start_keeps_the_saved_draft_vocabulary_on_other_data(tiny_corpus, tmp_path):
    """A warm start on other data (here: 2 samples, whose frequent tokens differ) scores the saved
    drafter's draft vocabulary, not one recounted from its own data."""
    root = tiny_corpus[0]
    Trainer(tiny_config(root, tmp_path / "a", max_steps=2, draft_vocab=48)).run()
    saved = DFlashDrafter.load(tmp_path / "a" / "drafter").draft_vocab
    recount = Trainer(tiny_config(root, tmp_path / "r", draft_vocab=48, limit_samples=2)).drafter.draft_vocab
    assert not torch.equal(recount, saved)  # the small data's own count would give another vocabulary
    warm = Trainer(
        tiny_config(root, tmp_path / "b", draft_vocab=48, limit_samples=2, init_from=str(tmp_path / "a" / "drafter"))
    )
    assert torch.equal(warm.drafter.draft_vocab, saved)
    assert torch.equal(warm.to_draft[saved], torch.arange(48))


def test_a_resumed_run_widens_its_draft_vocabulary_keeping_what_it_learned(tiny_corpus, tmp_path):
    """`--resume --draft-vocab N` above the checkpoint's: the saved tokens kept, the most frequent
    others added; each kept token's logit (the Markov correction included) and AdamW moments are
    where they were, an added token's Markov row starts at the kept rows' mean (every added token
    gets the correction's common part), its moments at 0, and training goes on."""
    root, _, _, answers = tiny_corpus
    out, warm = tmp_path / "run", tmp_path / "warm"
    Trainer(tiny_config(root, warm, draft_vocab=40, markov_rank=8, max_steps=1)).run()
    kw = dict(markov_rank=8, max_steps=6, save_every=4, init_from=str(warm / "drafter"))  # a warm-started run
    Trainer(tiny_config(root, out, draft_vocab=40, **kw)).run(until=4)
    before = DFlashDrafter.load(out / "checkpoint" / "drafter")
    moments = torch.load(out / "checkpoint" / "optimizer.pt")["state"]
    wide = Trainer(tiny_config(root, out, draft_vocab=56, **kw), resume=True)
    old, new = before.draft_vocab, wide.drafter.draft_vocab
    assert new.numel() == 56 and set(old.tolist()) <= set(new.tolist())
    counts = torch.bincount(torch.tensor([t for a in answers for t in a]), minlength=wide.target.config.vocab_size)
    added = sorted(set(new.tolist()) - set(old.tolist()))
    outside = counts.clone()
    outside[new] = -1
    assert min(counts[added].tolist()) >= int(outside.max())  # the most frequent of the rest
    assert torch.equal(wide.to_draft[new], torch.arange(56))
    h, prev = torch.randn(5, before.config.hidden_size), torch.tensor(old[:5].tolist())
    head = wide.target.lm_head.weight
    with torch.no_grad():
        was = before.draft_logits(h, head) + before.markov_head(prev)
        now = wide.drafter.draft_logits(h, head) + wide.drafter.markov_head(prev)
    kept = torch.searchsorted(new, old)
    assert torch.allclose(now[:, kept], was, atol=1e-5)
    fresh = torch.tensor([i for i in range(56) if i not in set(kept.tolist())])
    w2 = wide.drafter.markov_head.markov_w2.weight
    assert torch.allclose(w2[fresh], before.markov_head.markov_w2.weight.mean(0).expand(len(fresh), -1))
    index = [n for n, _ in wide.drafter.named_parameters()].index("markov_head.markov_w2.weight")
    state = wide.optimizer.state_dict()["state"][index]
    assert torch.equal(state["exp_avg"][kept], moments[index]["exp_avg"]) and not state["exp_avg_sq"][fresh].any()
    wide.run()
    assert wide.step == 6 and DFlashDrafter.load(out / "drafter").draft_vocab.numel() == 56


def test_sliding_window_drafter_trains_on_the_blocks_it_decodes(tiny_corpus, tmp_path):
    """`blockdraft train --sliding-window W --full-layers ...`: the masked training forward of a
    drafter with a sliding-window layer equals its cached decode forward block for block (the
    window cuts real context here: sequences are longer than W), and the saved drafter keeps
    the reference's `layer_types` / `sliding_window` fields."""
    root = tiny_corpus[0]
    out = tmp_path / "run"
    proc = train_cli(root, out, "--num-layers", "2", "--sliding-window", "6", "--full-layers", "1", "--max-steps", "3")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    saved = json.loads((out / "drafter" / "config.json").read_text())
    assert saved["layer_types"] == ["sliding_attention", "full_attention"] and saved["sliding_window"] == 6
    trainer = Trainer(tiny_config(root, tmp_path / "check", sliding_window=6, full_layers=[1]))
    assert trainer.drafter.config.window(0) == 6 and trainer.drafter.config.window(1) is None
    check_forward_consistency(trainer)


def test_teacher_forced_acceptance(tiny_corpus, tmp_path):
    """accepted_lengths counts the verify step's tokens exactly; an untrained drafter's
    teacher-forced τ is about 1 and its statistics cover every labelled draft position."""
    from blockdraft.train.loss import accepted_lengths

    right = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 0, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    assert accepted_lengths(right).tolist() == [4, 1, 2, 3, 1]
    trainer = Trainer(tiny_config(tiny_corpus[0], tmp_path / "run"))
    out = trainer.evaluate_blocks(8)
    assert 1.0 <= out["tau_blocks"] < 1.3 and out["blocks"] > 50
    assert len(out["val_acc"]) == len(out["val_ce"]) == 3 and min(out["val_ce"]) > 0
    assert trainer.evaluate_blocks(8) == out  # the same blocks every time


def test_teacher_forced_acceptance_at_a_smaller_served_block(tiny_corpus, tmp_path):
    """A drafter trained at block 4 evaluated as served at block 2: one draft position, so
    tau is exactly 1 + its accuracy; at block 3, between the position accuracies' bounds;
    above the trained block it is refused. The decode loop runs at the smaller block too."""
    trainer = Trainer(tiny_config(tiny_corpus[0], tmp_path / "run", max_steps=10))
    trainer.run()
    two = trainer.evaluate_blocks(8, block_size=2, num_anchors=6)
    assert len(two["val_acc"]) == 1 and two["blocks"] > 20
    assert two["tau_blocks"] == pytest.approx(1 + two["val_acc"][0], abs=1e-3)
    three = trainer.evaluate_blocks(8, block_size=3, num_anchors=6)
    assert len(three["val_acc"]) == 2
    acc1, acc2 = three["val_acc"]  # tau = 1 + P(first right) + P(both right)
    assert 1 + acc1 - 0.02 <= three["tau_blocks"] <= 1 + acc1 + min(acc1, acc2) + 0.02
    with pytest.raises(ValueError, match="block 4"):
        trainer.evaluate_blocks(8, block_size=5)
    assert 1.0 <= trainer.evaluate_tau(block_size=2) <= 2.0


def test_a_wsd_decay_branch_equals_a_separate_run_of_its_length(tiny_corpus, tmp_path):
    """The data-scaling curve's branches (benchmarks/experiments.py scaling --wsd-branches): a run
    stopped early with `run(until=)` and continued from a copy of its checkpoint with a shorter
    schedule ends bit for bit where a separate run of that length ends (fixed warmup steps)."""
    import shutil

    root = tiny_corpus[0]
    kw = dict(schedule="wsd", warmup_steps=2, warmup_frac=0.25, decay_frac=0.25, save_every=1000)
    separate = Trainer(tiny_config(root, tmp_path / "separate", max_steps=8, **kw))
    separate.run()
    main = Trainer(tiny_config(root, tmp_path / "main", max_steps=20, **kw))
    main.run(until=6)  # the 8-step run decays over its last 2 steps
    assert main.step == 6 and not (tmp_path / "main" / "drafter").exists()
    shutil.copytree(tmp_path / "main" / "checkpoint", tmp_path / "branch" / "checkpoint")
    branch = Trainer(tiny_config(root, tmp_path / "branch", max_steps=8, **kw), resume=True)
    assert branch.step == 6
    branch.run()
    a, b = drafter_weights(tmp_path / "separate" / "drafter"), drafter_weights(tmp_path / "branch" / "drafter")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    main.run()  # the main run goes on from where it stopped
    assert main.step == 20 and (tmp_path / "main" / "drafter").is_dir()


def test_keeping_or_recomputing_the_heads_logits_changes_no_bit(monkeypatch):
    """weighted_loss keeps a small head's logits for backward and recomputes a large one's:
    loss, gradient and counts are bit-identical either way (soft labels included)."""
    import blockdraft.train.loss as loss_mod

    g = torch.Generator().manual_seed(0)
    n, h, v, b = 3000, 64, 500, 8
    head, h0 = torch.randn(v, h, generator=g), torch.randn(n, h, generator=g)
    teacher = (torch.randint(-1, v, (n, 8), generator=g), torch.randn(n, 8, generator=g))  # (ids; -1: none)
    y, k, w = torch.randint(0, v, (n,), generator=g), torch.randint(0, b, (n,), generator=g), torch.rand(n, generator=g)
    results = []
    for threshold in (0, 1 << 40):
        monkeypatch.setattr(loss_mod, "REMAT_LOGITS_ABOVE", threshold)
        hidden = h0.clone().requires_grad_()
        loss, correct, _ = loss_mod.weighted_loss(hidden, head, y, w, k, b, 1024, teacher=teacher, distill=0.5)
        loss.backward()
        results.append((loss.detach(), hidden.grad, correct))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=False))


@pytest.mark.parametrize("soft", [False, True])
def test_block_cross_entropy_gives_autograds_losses_and_gradient(soft):
    """The loss's fused cross-entropy (hard labels, and a distribution over a few tokens with
    repeated and zero-probability ids, as padded teacher rows have): its values are
    F.cross_entropy's and the soft cross-entropy's bit for bit, and its hand-written backward is
    autograd's gradient through those formulas, for any weights on the two losses."""
    import torch.nn.functional as F

    from blockdraft.train.loss import block_cross_entropy

    g = torch.Generator().manual_seed(1)
    n, v, k = 64, 300, 6
    z0 = 3 * torch.randn(n, v, generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (n,), generator=g)
    t_ids = torch.randint(0, v, (n, k), generator=g) if soft else None
    if soft:
        t_ids[:, -1] = t_ids[:, 0]  # a repeated id
        t_ids[::3, -2] = 0
        t_probs = torch.softmax(torch.randn(n, k, generator=g, dtype=torch.float64), -1)
        t_probs[::3, -2] = 0.0  # a padded slot (id -1 clamped to 0, probability 0)
    else:
        t_probs = None
    w_hard, w_soft = torch.rand(n, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64)

    def grad_of(fn):
        z = z0.clone().requires_grad_()
        hard, soft_ce = fn(z)
        loss = (w_hard * hard).sum() + ((w_soft * soft_ce).sum() if soft else 0)
        loss.backward()
        return hard.detach(), None if soft_ce is None else soft_ce.detach(), z.grad

    def reference(z):
        hard = F.cross_entropy(z, y, reduction="none")
        return hard, -(t_probs * torch.log_softmax(z, -1).gather(1, t_ids)).sum(-1) if soft else None

    got, want = grad_of(lambda z: block_cross_entropy(z, y, t_ids, t_probs)), grad_of(reference)
    assert torch.equal(got[0], want[0]) and (not soft or torch.equal(got[1], want[1]))
    torch.testing.assert_close(got[2], want[2], rtol=1e-12, atol=1e-12)


def test_epochs_fix_the_steps_and_the_samples_when_the_run_starts(tiny_corpus, tmp_path):
    """`--epochs 1.5` over two folders of 16 samples, 4 a step: 12 steps, on those 32 samples even
    when the first folder grows before the run resumes from its checkpoint."""
    import shutil

    root = tiny_corpus[0]
    first_folder, second_folder = tmp_path / "a", tmp_path / "b"
    shutil.copytree(root / "data", first_folder)
    shutil.copytree(root / "data", second_folder)
    cfg = dict(data=f"{first_folder},{second_folder}", epochs=1.5, max_steps=999, save_every=1)
    first = Trainer(tiny_config(root, tmp_path / "run", **cfg))
    assert (first.cfg.max_steps, first.cfg.folder_samples, len(first.samples)) == (12, [16, 16], 32)
    first.run(until=3)
    more = [json.loads(line) for line in (first_folder / "shard-00000.jsonl").read_text().splitlines()]
    with open(first_folder / "shard-00001.jsonl", "w") as f:  # answers added after the run started
        for s in more:
            f.write(json.dumps({**s, "id": s["id"] + "~a1", "answer_ids": s["answer_ids"][::-1]}) + "\n")
    assert len(Trainer(tiny_config(root, tmp_path / "new", **cfg)).samples) == 48  # a new run sees them
    again = Trainer(tiny_config(root, tmp_path / "run", **cfg), resume=True)
    assert (again.step, again.cfg.max_steps, len(again.samples)) == (3, 12, 32)
    assert [s[0] for s in again.samples] == [s[0] for s in first.samples]
    again.run()
    assert again.step == 12


def test_training_data_from_several_folders(tiny_corpus, tmp_path):
    """`--data A,B` trains on both folders' samples, including a second answer to a prompt that
    A answered already (same id, other folder); a missing folder is a clear error."""
    import shutil

    from blockdraft.errors import BlockdraftError

    root = tiny_corpus[0]
    second = tmp_path / "sampled"
    shutil.copytree(root / "data", second)
    one = Trainer(tiny_config(root, tmp_path / "one"))
    both = Trainer(tiny_config(root, tmp_path / "both", data=f"{root / 'data'},{second}"))
    assert len(one.samples) == 16 and len(both.samples) == 32
    assert [s[0] for s in both.samples] == [s[0] for s in one.samples] * 2
    with pytest.raises(BlockdraftError, match="training data folder not found: .*missing"):
        Trainer(tiny_config(root, tmp_path / "bad", data=f"{root / 'data'},{tmp_path / 'missing'}"))


def test_skip_trained_by_leaves_out_exactly_what_an_earlier_run_trained_on(tiny_corpus, tmp_path, monkeypatch):
    """`--skip-trained-by RUN` drops the samples RUN trained on (the first 10 of folder A, its
    --limit-samples) and keeps those added to A since, another folder's samples of the same ids,
    and A's other 6, whatever the new --data order; a run that did not go through all its samples,
    or whose sample set is not fixed, is refused."""
    import shutil

    from blockdraft.errors import BlockdraftError

    root = tiny_corpus[0]
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(root / "data", a)
    shutil.copytree(root / "data", b)
    first = Trainer(tiny_config(root, tmp_path / "first", data=str(a), limit_samples=10, max_steps=3, save_every=3))
    first.run()
    old = [json.loads(line) for line in (a / "shard-00000.jsonl").read_text().splitlines()]
    with open(a / "shard-00001.jsonl", "w") as f:  # answers added after that run
        for s in old[:8]:
            f.write(json.dumps({**s, "id": s["id"] + "~a1", "answer_ids": s["answer_ids"][::-1]}) + "\n")
    done = tmp_path / "first" / "checkpoint"
    rest = Trainer(tiny_config(root, tmp_path / "rest", data=f"{b},{a}", skip_trained_by=str(done)))
    expect = (
        [s["prompt_ids"] + s["answer_ids"] for s in old]  # B: none of them trained
        + [s["prompt_ids"] + s["answer_ids"] for s in old[10:]]
        + [s["prompt_ids"] + s["answer_ids"][::-1] for s in old[:8]]
    )
    assert [s[0] for s in rest.samples] == [e[:64] for e in expect]
    rest.run(until=1)
    saved = json.loads((tmp_path / "rest" / "checkpoint" / "state.json").read_text())["config"]
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "tools"))
    import ship_drafter  # its card counts what the run trains on and what it left out

    sources, train, valid, sampled, skipped = ship_drafter.data_summary(saved)
    assert (sources, train, valid, sampled, skipped) == ({"t": 30}, 30, 0, 0, 10)
    short = Trainer(tiny_config(root, tmp_path / "short", data=str(a), limit_samples=10, max_steps=2, save_every=2))
    short.run()
    with pytest.raises(BlockdraftError, match="went through 8 sequences, fewer than its 10 samples"):
        Trainer(tiny_config(root, tmp_path / "x", skip_trained_by=str(tmp_path / "short" / "checkpoint")))
    unfixed = Trainer(tiny_config(root, tmp_path / "unfixed", data=str(b), max_steps=4, save_every=4))
    unfixed.run()
    with pytest.raises(BlockdraftError, match="fixed neither --limit-samples nor --folder-samples"):
        Trainer(tiny_config(root, tmp_path / "y", skip_trained_by=str(tmp_path / "unfixed" / "checkpoint")))


@pytest.mark.parametrize("arch", ["dflash", "eagle3"])
def test_feature_cache_skips_the_target_after_the_first_epoch_and_trains_the_same_way(tiny_corpus, tmp_path, arch):
    """With --feature-cache, epoch 1 runs the target and stores each sample's features; later
    steps read them back (no target forward). A second run on the full cache trains bit for bit
    like the first, and the stored features are the target's own (float16 rounding)."""
    root, target, prompts, answers = tiny_corpus
    extra = dict(arch="eagle3", target_layer_ids=[1, 2, 3]) if arch == "eagle3" else {}

    def trained(out):
        trainer = Trainer(tiny_config(root, out, max_steps=8, feature_cache=str(tmp_path / "cache"), **extra))
        calls = []
        forward = trainer.target.forward

        def counting(*args, **kw):
            calls.append(kw.get("features_only", False))
            return forward(*args, **kw)

        trainer.target.forward = counting
        trainer.run()
        return trainer, sum(calls)  # the training forwards (features only; the τ check decodes)

    first, first_calls = trained(tmp_path / "first")
    assert first_calls == 4  # 16 samples, 4 per step: one epoch of target forwards, then none
    assert (first.features.hits, first.features.misses, len(first.features)) == (4, 4, 16)
    second, second_calls = trained(tmp_path / "second")
    assert second_calls == 0 and second.features.hits == 8
    a, b = first.drafter.state_dict(), second.drafter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    from blockdraft.train.features import sequence_key

    seq = prompts[0] + answers[0]
    with torch.no_grad():
        _, fresh = target(
            torch.tensor([seq]),
            torch.arange(len(seq))[None],
            capture=tuple(first.drafter.config.target_layer_ids),
            features_only=True,
        )
    stored, missing = first.features.get([sequence_key(seq)], len(seq), "cpu")
    assert missing == [] and not torch.equal(stored, fresh)  # rounded, ...
    torch.testing.assert_close(stored, fresh, rtol=1e-3, atol=1e-3)  # ... to float16
    first.features.close()
    second.features.close()


@pytest.mark.parametrize("arch,distill", [("dflash", 0.0), ("eagle3", 0.0), ("dflash", 0.5)])
def test_features_recorded_while_decoding_serve_training_like_its_own(tiny_corpus, tmp_path, arch, distill):
    """The features a `FeatureRecorder` keeps while the decode loop answers (what `data regenerate
    --feature-cache` stores) are the target's own forward's over the whole sequence, every position
    but the last, and its top tokens (soft labels) those of that forward's logits at every answer
    position; a run whose cache holds them for half its samples runs the target on the other
    half only and trains like a run that computed them all itself (soft labels too)."""
    from blockdraft.train.features import TEACHER_TOPK, FeatureCache, FeatureRecorder, sequence_key

    root, target, prompts, answers = tiny_corpus
    layers = [1, 2, 3] if arch == "eagle3" else [3]
    extra = dict(arch="eagle3", target_layer_ids=layers) if arch == "eagle3" else {}
    recorder = FeatureRecorder(layers, target.config.hidden_size)
    states = []
    list(generate_steps(target, recorder, [Request(p, 40) for p in prompts[:8]], 1, states, batch_size=3))
    assert [s.output_ids for s in states] == answers[:8]  # it only watches
    cache = FeatureCache(tmp_path / "cache", target, layers, writer="regen")
    for i, (p, a) in enumerate(zip(prompts[:8], answers[:8], strict=False)):
        seq = p + a
        rows, (ids, logp) = recorder.pop(i, len(seq) - 1, start=len(p) - 1)
        with torch.no_grad():
            final, whole = target(torch.tensor([seq]), torch.arange(len(seq))[None], capture=tuple(layers))
            full = torch.log_softmax(target.logits(final[0, len(p) - 1 : -1]).float(), -1)
        torch.testing.assert_close(rows.float(), whole[0, :-1], rtol=2e-3, atol=2e-3)  # float16, decode order
        assert ids.shape == logp.shape == (len(a), TEACHER_TOPK)
        kth = full.topk(TEACHER_TOPK).values[:, -1:]
        assert bool((full.gather(1, ids.long()) >= kth - 1e-4).all())  # the likeliest tokens, all of them
        torch.testing.assert_close(logp.float(), full.gather(1, ids.long()), rtol=1e-3, atol=1e-3)
        key = sequence_key(seq)
        cache.put([key], rows[None], [rows.shape[0]])
        cache.put_teacher(key, ids, logp, start=len(p) - 1)
        got_ids, got_logp, missing = cache.get_teacher([key, "none"], len(seq) + 2, "cpu")
        assert missing == [1] and (got_ids[1] == -1).all()
        assert (got_ids[0, : len(p) - 1] == -1).all() and (got_ids[0, len(seq) - 1 :] == -1).all()
        assert torch.equal(got_ids[0, len(p) - 1 : len(seq) - 1], ids.long())
        assert torch.equal(got_logp[0, len(p) - 1 : len(seq) - 1], logp.float())
    assert not recorder.ended
    cache.close()

    def trained(out, folder):
        trainer = Trainer(tiny_config(root, out, max_steps=4, feature_cache=str(folder), distill=distill, **extra))
        computed = []
        forward = trainer.target.forward

        def counting(tokens, *args, **kw):
            if len(args) == 1 and "features_only" in kw:  # the trainer's forwards (not the decode loop's)
                computed.append(tokens.shape[0])
            return forward(tokens, *args, **kw)

        trainer.target.forward = counting
        trainer.run()
        trainer.features.close()
        return trainer, sum(computed)

    half, half_rows = trained(tmp_path / "half", tmp_path / "cache")
    assert half_rows == 8 and len(half.features) == 16  # one epoch: the target ran for the other 8 only
    own, own_rows = trained(tmp_path / "own", tmp_path / "own-cache")
    assert own_rows == 16
    if distill:
        assert len(own.features._teacher.index) == 16
    a, b = half.drafter.state_dict(), own.drafter.state_dict()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst < 1e-4, worst  # (one position of one sample off by 0.01 moves them by 5e-3)


def test_feature_cache_refuses_another_target_layout_and_survives_a_torn_index(tiny_corpus, tmp_path):
    from blockdraft.errors import BlockdraftError
    from blockdraft.train.features import FeatureCache, sequence_key

    root, target, prompts, answers = tiny_corpus
    cache = tmp_path / "cache"
    trainer = Trainer(tiny_config(root, tmp_path / "run", max_steps=2, feature_cache=str(cache)))
    trainer.run()
    trainer.features.close()
    with open(cache / "index-rank0.jsonl", "a") as f:
        f.write('["abc", 12')  # a crash in the middle of a line
    reopened = FeatureCache(cache, target, [3])
    assert len(reopened) == 8
    other = FeatureCache(cache, target, [3], rank=1)  # a second training process, same folder
    seq = [5, 6, 7, 8]
    feats = torch.randn(1, 4, target.config.hidden_size)
    other.put([sequence_key(seq)], feats, [4])
    got, missing = reopened.get([sequence_key(seq), sequence_key([1, 2])], 6, "cpu")  # seen by the first
    assert torch.equal(got[0, :4], feats[0].half().float()) and not got[0, 4:].any()  # without reopening
    assert missing == [1] and not got[1].any()
    reopened.put([sequence_key(seq + [9])], torch.randn(1, 5, target.config.hidden_size), [5])
    assert len(FeatureCache(cache, target, [3])) == 10  # the torn line cost nothing after it
    with pytest.raises(BlockdraftError, match="made for another layers"):
        FeatureCache(cache, target, [1, 3])


def test_feature_cache_says_before_training_when_the_disk_cannot_hold_it(tiny_corpus, tmp_path, monkeypatch, capsys):
    """The bytes a run's features add are known before it starts (what it then stores, exactly);
    when the cache's disk cannot hold them the run says so at once, stores what fits (keeping
    its reserve free, `--feature-cache-reserve`), runs the target for the rest, and trains as it would have."""
    import shutil

    from blockdraft.train import features
    from blockdraft.train.features import FeatureCache

    root, target, prompts, answers = tiny_corpus
    cache = tmp_path / "cache"
    trainer = Trainer(tiny_config(root, tmp_path / "run", max_steps=2, feature_cache=str(cache)))
    everything = [s[0] for s in trainer.samples]
    this_run = [trainer.samples[i][0] for i in trainer.epoch_order(0)[:8]]  # 2 steps of 4
    need_all, need_run = trainer.features.bytes_needed(everything), trainer.features.bytes_needed(this_run)
    assert 0 < need_run < need_all
    trainer.run()
    trainer.features.close()
    assert (cache / "features-rank0.bin").stat().st_size == need_run
    assert FeatureCache(cache, target, [3]).bytes_needed(everything) == need_all - need_run
    # with soft labels the answers' top tokens are counted and stored too
    soft = Trainer(
        tiny_config(root, tmp_path / "soft", max_steps=2, feature_cache=str(tmp_path / "soft-cache"), distill=0.5)
    )
    order = soft.epoch_order(0)[:8]
    need_soft = soft.features.bytes_needed([soft.samples[i][0] for i in order], [soft.samples[i][1] for i in order])
    assert need_soft > need_run
    soft.run()
    soft.features.close()
    assert (
        sum((tmp_path / "soft-cache" / f).stat().st_size for f in ("features-rank0.bin", "teacher-rank0.bin"))
        == need_soft
    )
    # a disk with room for about half of a 2-step run's features beyond what is kept free
    small = tmp_path / "small"
    usage = shutil.disk_usage(tmp_path)

    def disk(_):
        used = sum(f.stat().st_size for f in small.glob("features-*.bin"))
        return usage._replace(free=features.RESERVE + need_run // 2 - used)

    monkeypatch.setattr(features.shutil, "disk_usage", disk)
    capsys.readouterr()
    squeezed = Trainer(tiny_config(root, tmp_path / "squeezed", max_steps=2, feature_cache=str(small)))
    assert "it stores what fits" in capsys.readouterr().err
    squeezed.run()
    squeezed.features.close()
    stored = (small / "features-rank0.bin").stat().st_size
    assert 0 < stored <= need_run // 2 and 0 < len(FeatureCache(small, target, [3])) < 8
    a, b = trainer.drafter.state_dict(), squeezed.drafter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same features, stored or not
    monkeypatch.setattr(features.shutil, "disk_usage", lambda _: usage._replace(free=features.RESERVE + need_all))
    capsys.readouterr()
    Trainer(tiny_config(root, tmp_path / "fits", max_steps=100, feature_cache=str(tmp_path / "other")))
    assert "stores what fits" not in capsys.readouterr().err
    # --feature-cache-reserve moves the line: the disk that held half of the run's features holds all
    # of them when less is kept free, and a reserve above the free space stores nothing
    for name, reserve, stored in (
        ("lower", features.RESERVE - need_run, need_run),
        ("higher", features.RESERVE + need_run, 0),
    ):
        small = tmp_path / name
        monkeypatch.setattr(features.shutil, "disk_usage", disk)
        capsys.readouterr()
        run = Trainer(
            tiny_config(
                root,
                tmp_path / f"run-{name}",
                max_steps=2,
                feature_cache=str(small),
                feature_cache_reserve=reserve / 2**30,
            )
        )
        assert ("stores what fits" in capsys.readouterr().err) == (stored == 0)
        run.run()
        run.features.close()
        assert (small / "features-rank0.bin").stat().st_size == stored
    with pytest.raises(BlockdraftError, match="--feature-cache-reserve must be >= 0"):
        Trainer(
            tiny_config(
                root, tmp_path / "bad", max_steps=2, feature_cache=str(tmp_path / "x"), feature_cache_reserve=-1
            )
        )


def test_a_card_reads_the_committed_metrics_of_a_run_resumed_on_a_new_machine(tmp_path, monkeypatch):
    """A run resumed from its committed position on a fresh machine has only its new steps in
    RUN/metrics.jsonl; the card's τ curve takes the earlier ones from data/train-logs/NAME.metrics.jsonl
    (the run folder's record winning for a step both hold), in step order."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "tools"))
    import ship_drafter

    logs, run = tmp_path / "train-logs", tmp_path / "runs" / "mine"
    logs.mkdir()
    run.mkdir(parents=True)
    monkeypatch.setattr(ship_drafter, "TRAIN_LOGS", logs)
    with pytest.raises(SystemExit, match="no metrics for"):
        ship_drafter.run_metrics(run)

    def rec(step, tau=None):
        return json.dumps({"step": step, "elapsed": step, **({"tau": tau} if tau else {})})

    (logs / "mine.metrics.jsonl").write_text("\n".join([rec(10, 1.5), rec(20), rec(30, 1.7)]) + "\n")
    (run / "metrics.jsonl").write_text("\n".join([rec(30, 1.8), rec(40, 1.9)]) + "\n\n")
    got = ship_drafter.run_metrics(run)
    assert [(m["step"], m.get("tau")) for m in got] == [(10, 1.5), (20, None), (30, 1.8), (40, 1.9)]
    (logs / "mine.metrics.jsonl").unlink()
    assert [m["step"] for m in ship_drafter.run_metrics(run)] == [30, 40]


@pytest.mark.parametrize("arch", ["dflash", "eagle3"])
def test_shipping_a_run_writes_its_fp16_weights_and_a_card_from_its_records(tiny_corpus, tmp_path, monkeypatch, arch):
    """tools/ship_drafter.py: the shipped copy is the run's drafter in fp16 and its card carries
    the run's own steps, samples, threads and the τ of the bench run it is given."""
    import argparse

    scripts = os.path.join(os.path.dirname(__file__), "..", "tools")
    monkeypatch.syspath_prepend(scripts)
    import ship_drafter

    from blockdraft.eagle import EagleDrafter

    root, *_ = tiny_corpus
    cfg = tiny_config(root, tmp_path / "run", arch=arch, max_steps=8, save_every=4)
    Trainer(cfg).run()
    bench = tmp_path / "bench"
    method = "dflash" if arch == "dflash" else "eagle3"
    for dataset, tau in (("humaneval", 1.234), ("gsm8k", 2.5)):
        (bench / dataset).mkdir(parents=True)
        (bench / dataset / "results.json").write_text(
            json.dumps(
                {
                    "num_prompts": 3,
                    "max_new_tokens": 32,
                    "methods": {"ar": {"tau": 1.0}, f"{method}@3": {"tau": tau}, "lookup": {"tau": 9.0}},
                }
            )
        )
    dest = tmp_path / "shipped"
    monkeypatch.setitem(ship_drafter.KINDS, arch, {**ship_drafter.KINDS[arch], "dest": dest})
    args = argparse.Namespace(bench=str(bench), scaling=str(tmp_path / "none.jsonl"), samples=3, max_new_tokens=32)
    ship_drafter.ship(args, tmp_path / "run", arch)
    cls = DFlashDrafter if arch == "dflash" else EagleDrafter
    trained, shipped = cls.load(tmp_path / "run" / "drafter"), cls.load(dest)
    for (name, a), b in zip(trained.state_dict().items(), shipped.state_dict().values(), strict=False):
        assert torch.equal(a.half().float(), b.float()), name
    card = (dest / "README.md").read_text()
    assert "8 steps x 4 sequences" in card and "16 training samples" in card
    assert f"({torch.get_num_threads()} threads, " in card
    assert "| HumanEval | first 3 | 1.23 |" in card and "| GSM8K | first 3 | 2.50 |" in card
    assert "9.00" not in card and "MT-Bench" not in card  # other methods and datasets stay out
    with pytest.raises(SystemExit, match="trained a"):
        ship_drafter.ship(args, tmp_path / "run", "eagle3" if arch == "dflash" else "dflash")
    assert "| warm start |" not in card and "fp32, torch" in card
    # A warm start from the shipped folder ships over it; its card keeps the first run's rows.
    Trainer(
        tiny_config(
            root, tmp_path / "warm", arch=arch, max_steps=4, save_every=4, dtype="bfloat16", init_from=str(dest)
        )
    ).run()
    ship_drafter.ship(args, tmp_path / "warm", arch)
    warm = (dest / "README.md").read_text()
    assert "4 steps x 4 sequences" in warm and "bfloat16 target, fp32 drafter under autocast" in warm
    assert f"| warm start | from `{dest}`, itself trained so: " in warm
    assert "training: 8 steps x 4 sequences" in warm and "initialised from the warm start below" in warm
    # Shipped again (say with a new bench run), the card still names the first run as the start.
    ship_drafter.ship(args, tmp_path / "warm", arch)
    assert (dest / "README.md").read_text() == warm


def test_a_committed_position_continues_the_run_on_another_machine(tiny_corpus, tmp_path):
    """`--position-dir` writes the weights (in fp16) and the schedule position without the optimizer
    state; `train --resume-from` continues from it: from a full checkpoint bit for bit as the straight
    run, from the position alone with the same schedule (learning rates, steps) and AdamW's
    moments rebuilt; the run's settings cannot be changed on the way."""
    from blockdraft.cli import main

    root = tiny_corpus[0]
    straight = Trainer(tiny_config(root, tmp_path / "straight", max_steps=12))
    straight.run()
    half = Trainer(tiny_config(root, tmp_path / "half", max_steps=12), position_dir=tmp_path / "committed")
    half.run(until=6)
    position = tmp_path / "committed"
    assert not (position / "optimizer.pt").exists() and (tmp_path / "half" / "checkpoint" / "optimizer.pt").exists()
    assert json.loads((position / "state.json").read_text())["step"] == 6
    from safetensors.torch import load_file

    a, b = (load_file(str(f / "drafter" / "model.safetensors")) for f in (position, tmp_path / "half" / "checkpoint"))
    assert a.keys() == b.keys() and {v.dtype for v in b.values() if v.is_floating_point()} == {torch.float32}
    assert all(a[k].dtype == (torch.float16 if b[k].is_floating_point() else b[k].dtype) for k in a)
    assert all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)  # the weights rounded to fp16

    assert main(["train", "--resume-from", str(tmp_path / "half" / "checkpoint"), "--out", str(tmp_path / "full")]) == 0
    a, b = drafter_weights(tmp_path / "straight" / "drafter"), drafter_weights(tmp_path / "full" / "drafter")
    assert all(torch.equal(a[k], b[k]) for k in a)  # with the optimizer state: bit for bit

    assert main(["train", "--resume-from", str(position), "--out", str(tmp_path / "moved")]) == 0
    ref = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(line) for line in (tmp_path / "moved" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == list(range(7, 13))
    assert [r["lr"] for r in got] == [r["lr"] for r in ref[6:]]
    c = drafter_weights(tmp_path / "moved" / "drafter")
    assert not all(torch.equal(a[k], c[k]) for k in a)  # the moments were rebuilt, so not bit for bit
    assert main(["train", "--resume-from", str(position), "--out", str(tmp_path / "x"), "--lr", "1.0"]) == 2


def test_a_markov_head_trains_warm_starts_from_a_plain_drafter_and_saves_round_trip(tiny_corpus, tmp_path):
    """--markov-rank: the Markov head trains with the backbone (teacher-forced on the previous
    answer token), the teacher-forced acceptance agrees with the decode loop's chain on an
    overfit drafter, the folder carries DSpark's keys and loads back equal, and a plain
    drafter's weights warm-start it (the head starts fresh)."""
    root, _, prompts, _ = tiny_corpus
    plain = Trainer(tiny_config(root, tmp_path / "plain", max_steps=2))
    plain.run()
    cfg = tiny_config(
        root,
        tmp_path / "markov",
        max_steps=200,
        save_every=10_000,
        log_every=50,
        markov_rank=8,
        init_from=str(tmp_path / "plain" / "drafter"),
    )
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    saved = drafter_weights(tmp_path / "plain" / "drafter")
    assert all(torch.equal(before[k], saved[k]) for k in saved)  # warm start: the backbone's weights
    trainer.run()
    raw = json.loads((tmp_path / "markov" / "drafter" / "config.json").read_text())
    assert (raw["markov_rank"], raw["markov_head_type"], raw["sample_from_anchor"]) == (8, "vanilla", False)
    drafter = DFlashDrafter.load(tmp_path / "markov" / "drafter")
    mine = trainer.drafter.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in drafter.state_dict().items())
    assert not torch.equal(mine["markov_head.markov_w2.weight"], before["markov_head.markov_w2.weight"])
    states = []
    list(
        generate_steps(
            trainer.target, DFlashProposer(drafter, trainer.target), [Request(p, 32) for p in prompts[:8]], 4, states
        )
    )
    lengths = [a for s in states for a in s.acceptance_lengths]
    tau = sum(lengths) / len(lengths)
    assert tau >= 3.3, f"tau {tau:.2f} of 4 after overfitting: train and decode disagree"
    blocks = trainer.evaluate_blocks(16)
    assert abs(blocks["tau_blocks"] - tau) < 0.3, (blocks, tau)


def test_int8_feature_cache_halves_the_disk_and_trains_as_it_reads(tiny_corpus, tmp_path):
    """`--feature-dtype int8`: per position and captured layer, values / (absmax / 127) rounded, so
    an outlier (the target's massive activations) coarsens only its own layer; a run that fills an
    int8 cache and one that reads it back train bit for bit alike; the records take 1 byte a value
    plus a float32 scale per position and layer; a float16 folder keeps its records readable."""
    from blockdraft.train.features import FeatureCache, dequantize, quantize, sequence_key

    root, target, prompts, answers = tiny_corpus
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3 * 64, generator=g)
    x[2, 70] = 25000.0  # a massive activation in the second layer
    q, scales = quantize(x, 64)
    back = dequantize(q, scales)
    assert q.dtype == torch.int8 and q.shape == x.shape and scales.shape == (5, 3)
    assert bool(((back - x).abs() <= scales.repeat_interleave(64, -1) / 2 * (1 + 1e-6)).all())
    assert (
        float((back[2, :64] - x[2, :64]).abs().max()) < 0.02 and float((back[2, 64:128] - x[2, 64:128]).abs().max()) > 1
    )
    runs = []
    for name in ("fill", "read"):
        trainer = Trainer(
            tiny_config(root, tmp_path / name, max_steps=4, feature_cache=str(tmp_path / "cache"), feature_dtype="int8")
        )
        trainer.run()
        trainer.features.close()
        runs.append(trainer)
    assert runs[1].features.misses == 0 and runs[1].features.hits >= 4
    a, b = runs[0].drafter.state_dict(), runs[1].drafter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    fp16 = Trainer(tiny_config(root, tmp_path / "fp16", max_steps=4, feature_cache=str(tmp_path / "fp16-cache")))
    fp16.run()
    fp16.features.close()
    int8_bytes = (tmp_path / "cache" / "features-rank0.bin").stat().st_size
    fp16_bytes = (tmp_path / "fp16-cache" / "features-rank0.bin").stat().st_size
    assert int8_bytes * 128 == fp16_bytes * (64 + 4)  # width 64: 2 bytes a value against 1 + a 4-byte scale
    mixed = FeatureCache(tmp_path / "fp16-cache", target, [3], dtype="int8")
    seq = fp16.samples[fp16.epoch_order(0)[0]][0]
    old, _ = mixed.get([sequence_key(seq)], len(seq), "cpu")
    mixed.put([sequence_key([7, 8, 9])], torch.randn(1, 3, 64), [3])
    new, missing = mixed.get([sequence_key([7, 8, 9]), sequence_key(seq)], len(seq), "cpu")
    assert missing == [] and torch.equal(new[1], old[0])  # the float16 record, read as before
    assert (
        mixed.dtype == "int8" and json.loads((tmp_path / "fp16-cache" / "meta.json").read_text())["dtype"] == "float16"
    )
    mixed.close()


def test_convert_feature_cache_copies_every_record_as_int8(tiny_corpus, tmp_path):
    """tools/convert_feature_cache.py: every record of a float16 cache (features and soft labels'
    top tokens, also those stored after their features were copied) lands in the int8 one as
    `round` stores it, a rerun copies nothing, and the source folder is only read."""
    import importlib.util

    from blockdraft.train.features import FeatureCache

    spec = importlib.util.spec_from_file_location(
        "convert_feature_cache", Path(__file__).resolve().parent.parent / "tools" / "convert_feature_cache.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    root, target, prompts, answers = tiny_corpus
    trainer = Trainer(
        tiny_config(root, tmp_path / "run", max_steps=2, feature_cache=str(tmp_path / "src"), distill=0.5)
    )
    trainer.run()
    trainer.features.close()
    before = sorted(p.name for p in (tmp_path / "src").iterdir())
    src = FeatureCache(tmp_path / "src", target, [3], readonly=True)
    dst = FeatureCache(tmp_path / "dst", target, [3], writer="convert", dtype="int8")
    assert tool.convert(src, dst) == len(src) == 8 and tool.convert(src, dst) == 0
    dst.close()  # top tokens stored after their features were copied (as a running writer stores them)
    for name in ("teacher-convert.bin", "teacher-index-convert.jsonl"):
        (tmp_path / "dst" / name).unlink()
    dst = FeatureCache(tmp_path / "dst", target, [3], writer="convert", dtype="int8")
    assert tool.convert(src, dst) == 0 and len(dst._teacher.index) == len(src._teacher.index) == 8
    for key, (_, _, rows, _) in src.index.items():
        a, _ = src.get([key], rows, "cpu")
        b, missing = dst.get([key], rows, "cpu")
        assert missing == [] and torch.equal(b, dst.round(a))
        ids, logp, missing = src.get_teacher([key], rows + 1, "cpu")
        ids2, logp2, missing2 = dst.get_teacher([key], rows + 1, "cpu")
        assert missing == missing2 == [] and torch.equal(ids, ids2) and torch.equal(logp, logp2)
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == before
    src.close()
    dst.close()


# ---- D-PACE (--position-weights dpace) ----------------------------------------------------------


def test_dpace_weights_are_the_expected_acceptance_riding_on_each_position():
    """Per block: smoothed confidences q~ = (1 - a) q + a, prefix products P_m (all drafts up to m
    accepted), weight_k = sum_{m >= k} P_m; the unlabelled anchor slot passes through, an unlabelled
    slot past the sequence's end ends the block."""
    from blockdraft.train.loss import dpace_weights

    q = torch.tensor([[0.0, 0.8, 0.4, 0.6, 0.0, 0.9, 0.2, 0.0]])  # two blocks of 4
    labelled = torch.tensor([[False, True, True, True, False, True, True, False]])
    offsets = torch.arange(4).repeat(2)[None]
    w = dpace_weights(q, labelled, offsets, 4, alpha=0.5)
    s = [0.5 * x + 0.5 for x in (0.8, 0.4, 0.6)]
    p = [s[0], s[0] * s[1], s[0] * s[1] * s[2]]
    t = [0.95, 0.95 * 0.6]
    want = [0.0, p[0] + p[1] + p[2], p[1] + p[2], p[2], 0.0, t[0] + t[1], t[1], 0.0]
    torch.testing.assert_close(w, torch.tensor([want]))
    assert dpace_weights(q.requires_grad_(), labelled, offsets, 4, 0.5).requires_grad is False


def test_dpace_loss_is_the_weighted_cross_entropy_per_block(tmp_path):
    """The loss is sum_k weight_k * CE_k over the batch's blocks, divided by the number of blocks,
    with weights from this step's own confidences (detached: the gradient is that of the weighted CE)."""
    import torch.nn.functional as F

    from blockdraft.train.loss import dpace_weights, weighted_loss

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 8, 16, generator=gen, requires_grad=True)
    head = torch.randn(12, 16, generator=gen)
    labels = torch.randint(0, 12, (2, 8), generator=gen)
    offsets = torch.arange(4).repeat(2).expand(2, -1)
    labels[offsets == 0] = IGNORE
    labels[1, 7] = IGNORE  # past the sequence's end
    weights = (labels != IGNORE).float()
    loss, _, _ = weighted_loss(hidden, head, labels, weights, offsets, 4, 5, dpace_alpha=0.5)
    keep = labels != IGNORE
    ce = torch.zeros(2, 8)
    ce[keep] = F.cross_entropy(F.linear(hidden[keep], head), labels[keep], reduction="none")
    w = dpace_weights(torch.exp(-ce.detach()) * keep, keep, offsets, 4, 0.5)
    want = (w * ce).sum() / 4
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    (grad,) = torch.autograd.grad(loss, hidden)
    (want_grad,) = torch.autograd.grad(want, hidden)
    torch.testing.assert_close(grad, want_grad)


def test_position_weights_are_checked_when_a_run_starts(tiny_corpus, tmp_path):
    with pytest.raises(BlockdraftError, match="--position-weights must be decay or dpace"):
        Trainer(tiny_config(tiny_corpus[0], tmp_path / "run", position_weights="dpac"))


def test_a_run_saved_before_position_weights_existed_resumes_with_the_fixed_decay(tiny_corpus, tmp_path):
    """D-PACE is the default now; a checkpoint whose settings predate the option keeps its decay."""
    root = tiny_corpus[0]
    first = Trainer(tiny_config(root, tmp_path / "a", max_steps=2, position_weights="decay"))
    first.run()
    state_file = tmp_path / "a" / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    del state["config"]["position_weights"]
    state_file.write_text(json.dumps(state))
    assert TrainConfig(data="", out="").position_weights == "dpace"
    resumed = Trainer(tiny_config(root, tmp_path / "a", max_steps=4, position_weights="decay"), resume=True)
    assert resumed.step == 2 and resumed.dpace_alpha is None
    with pytest.raises(BlockdraftError, match="other settings"):
        Trainer(tiny_config(root, tmp_path / "a", max_steps=4), resume=True)  # the default now: dpace


@pytest.mark.parametrize("variant", ["full", "window", "input"])
def test_the_block_mask_attends_as_the_dense_mask(variant):
    """A training forward under `BlockMask` (each block scores the context and its own keys only)
    gives the dense mask's hidden states and gradients, to fp32 noise: every layer full, one
    sliding-window layer, context in the first layer only. Padding blocks (a short sequence) and
    an anchor at the first answer token are among them."""
    from blockdraft.draft import BlockMask, DraftConfig
    from blockdraft.models.config import TargetConfig

    cfg = TargetConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 50,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    window = dict(sliding_window=5, full_layers=[1]) if variant == "window" else {}
    dcfg = DraftConfig.for_target(cfg, num_layers=2, block_size=4, mask_token_id=1, target_layer_ids=[1, 2], **window)
    if variant == "input":
        dcfg.extra = {"blockdraft": {"context_mode": "input"}}
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(2, 50, (n,), generator=gen).tolist() for n in (30, 6, 25)]
    batch = build_blocks(seqs, [5, 3, 8], block_size=4, num_anchors=5, mask_token_id=1, gamma=None, generator=gen)
    n, width = batch.tokens.shape
    features = torch.randn(n, width, 128, generator=gen)
    noise = torch.randn(n, batch.block_tokens.shape[1], 64, generator=gen)
    weight = torch.randn(n, batch.block_tokens.shape[1], 64, generator=gen)
    assert not batch.mask[1, 0, -4:, :width].any() and BlockMask.of(batch.mask).block_size == 4  # a padding block
    results = []
    for mask in (batch.mask, BlockMask.of(batch.mask)):
        drafter.zero_grad()
        out = drafter(noise, batch.block_positions, features, torch.arange(width).expand(n, -1), mask=mask)
        (out * weight).sum().backward()
        results.append([out.detach()] + [p.grad.clone() for p in drafter.parameters() if p.grad is not None])
    assert len(results[0]) == len(results[1]) > 10
    for dense, blocked in zip(*results, strict=True):
        torch.testing.assert_close(blocked, dense, atol=1e-5, rtol=1e-4)


def test_a_bf16_targets_training_features_are_the_fused_steps_row_by_row(tiny_corpus, tmp_path):
    """Where the fused native step runs (bf16 on an AVX512-BF16 CPU), training computes the
    target's features and final hidden states through it: each row of a right-padded batch gets
    bit for bit what its sequence gets alone (the numbers the decode loop's target gives the
    drafter), as close to the eager bf16 forward as bf16 allows; elsewhere the eager forward."""
    from blockdraft.models import native

    trainer = Trainer(tiny_config(tiny_corpus[0], tmp_path / "run", dtype="bfloat16"))
    batch = trainer.batch_at(0)
    tokens, lengths = batch.tokens, batch.lengths.tolist()
    assert len(set(lengths)) > 1  # padded rows
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    with torch.no_grad():
        final, features = trainer.target_forward(tokens, positions, (1, 3), full=True)
        eager_final, eager = trainer.target(tokens, positions, capture=(1, 3))
    assert bool(trainer._native_step) == native.supported()
    for i, n in enumerate(lengths):
        with torch.no_grad():
            alone_final, alone = trainer.target_forward(tokens[i : i + 1, :n], positions[:1, :n], (1, 3), full=True)
        assert torch.equal(features[i, :n], alone[0]) and torch.equal(final[i, :n], alone_final[0])
        torch.testing.assert_close(features[i, :n].float(), eager[i, :n].float(), rtol=0.05, atol=0.05)


def test_an_accelerator_lease_continues_the_committed_wide_block_run(monkeypatch, tmp_path):
    """`tools/accelerator_job.py train --recipe-from data/train-logs/positions/wide16` trains what
    that run trains (block, layers, layout, loss, draft vocabulary, data) from its weights, at the
    device's batch with the learning rate scaled by the square root of the batch ratio."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "tools"))
    import accelerator_train

    position = root / "data/train-logs/positions/wide16"
    if not (position / "state.json").is_file():
        pytest.skip("no committed wide16 position")
    run = json.loads((position / "state.json").read_text())["config"]
    recipe = accelerator_train.recipe_from(position, 64)
    for key in (
        "block_size",
        "num_layers",
        "draft_layout",
        "position_weights",
        "distill",
        "draft_vocab",
        "markov_rank",
    ):
        assert recipe[key] == run[key], key
    assert recipe["init_from"] == str(position / "drafter")
    assert [Path(d).relative_to(root).as_posix() for d in recipe["data"]] == run["data"].split(",")
    assert all(Path(d).is_dir() for d in recipe["data"])
    assert recipe["lr"] == pytest.approx(run["lr"] * 4)
    cfg = TrainConfig(data=",".join(recipe.pop("data")), out="unused", **recipe)
    shipped = DFlashDrafter.load(position / "drafter").config
    assert cfg.block_size == shipped.block_size == 16 and cfg.num_layers == shipped.num_hidden_layers
    # the job's training stage takes it, the flags given still winning
    seen = {}

    class Built(Exception):
        pass

    def trainer(cfg):
        seen["cfg"] = cfg
        raise Built

    monkeypatch.setattr("blockdraft.train.trainer.Trainer", trainer)
    with pytest.raises(Built):
        accelerator_train.train(tmp_path, None, None, 64, {"recipe_from": str(position), "num_anchors": 48})
    got = seen["cfg"]
    assert got.block_size == 16 and got.draft_layout == "anchor" and got.batch_size == 64 and got.num_anchors == 48
    assert got.init_from == str(position / "drafter") and got.lr == pytest.approx(run["lr"] * 4)
    assert got.data == ",".join(str(root / d) for d in run["data"].split(","))


def test_branches_off_a_run_decay_or_widen_it_and_leave_the_run_alone(tiny_corpus, tmp_path, monkeypatch):
    """`benchmarks/branch.py`: from the run's checkpoint, --steps steps; `--decay`: the learning
    rate falls linearly from the run's towards 0; `--draft-vocab N`: the run's schedule with its
    draft vocabulary widened; `--lr X`: at that rate; the mean loss of its logged steps; held-out
    tau before and after; the run's checkpoint and feature cache writer are untouched (a branch
    stores features under its own name)."""
    root, target, prompts, answers = tiny_corpus
    run, cache = tmp_path / "run", tmp_path / "cache"
    cfg = tiny_config(
        root, run, schedule="wsd", warmup_steps=2, save_every=3, feature_cache=str(cache), draft_vocab=40, markov_rank=8
    )
    Trainer(cfg).run(until=6)
    kept = {p.name: p.read_bytes() for p in [*(run / "checkpoint").rglob("*"), *cache.iterdir()] if p.is_file()}
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import branch

    results = tmp_path / "branches.jsonl"
    for extra in (["--decay", "--steps", "4"], ["--steps", "2", "--draft-vocab", "56", "--lr", str(2 * cfg.lr)]):
        branch.main(["--run", str(run), *extra, "--out", str(tmp_path / "branch"), "--results", str(results)])
        lrs = [json.loads(line)["lr"] for line in (tmp_path / "branch" / "metrics.jsonl").read_text().splitlines()]
        if "--decay" in extra:
            assert len(lrs) == 4 and lrs == sorted(lrs, reverse=True)
            assert lrs[0] > 0.8 * cfg.lr and lrs[-1] < 0.3 * cfg.lr
        else:
            assert lrs == [2 * cfg.lr] * 2
            assert DFlashDrafter.load(tmp_path / "branch" / "checkpoint" / "drafter").draft_vocab.numel() == 56
    decayed, widened = [json.loads(line) for line in results.read_text().splitlines()]
    assert (decayed["from_step"], decayed["steps"], decayed["decay"], decayed["draft_vocab"]) == (6, 4, True, 40)
    assert (widened["from_step"], widened["steps"], widened["decay"], widened["draft_vocab"]) == (6, 2, False, 56)
    assert (decayed["lr"], widened["lr"]) == (cfg.lr, 2 * cfg.lr)
    logged = [json.loads(line)["loss"] for line in (tmp_path / "branch" / "metrics.jsonl").read_text().splitlines()]
    assert widened["mean_loss"] == pytest.approx(sum(logged) / 2, abs=1e-4)
    assert all(1.0 <= r[k] <= 4.0 for r in (decayed, widened) for k in ("tau_before", "tau_after"))
    assert {
        p.name: p.read_bytes()
        for p in [*(run / "checkpoint").rglob("*"), *cache.iterdir()]
        if p.is_file() and p.name in kept
    } == kept
    assert (cache / "index-branch.jsonl").is_file()


def test_fit_check_pools_are_the_runs_seen_and_unseen_samples(tiny_corpus, tmp_path, monkeypatch):
    """benchmarks/fit_check.py: at step 2 of 4 a step (16 samples, 4 a step), the recently seen pool
    is what step 1 trained on, the early one step 0's, the unseen one steps 2-3's, the held-out one
    the run's validation samples; every pool's acceptance is the trainer's own evaluation."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fit_check

    trainer = Trainer(tiny_config(tiny_corpus[0], tmp_path / "run"))
    per = trainer.cfg.batch_size
    got = list(fit_check.pools(trainer, 2, 1, 16).values())
    batch = lambda first, last: [trainer.samples[i] for s in range(first, last) for i in trainer.batch_indices(s)]  # noqa: E731
    assert got[0] == trainer.valid[:16]
    assert got[1] == batch(1, 2) and got[2] == batch(0, 1) and got[3] == batch(2, len(trainer.samples) // per)
    with pytest.raises(SystemExit, match="past the first epoch"):
        fit_check.pools(trainer, len(trainer.samples) // per, 1, 16)
