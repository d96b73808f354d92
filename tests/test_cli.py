"""The CLI's JSON contract and its error messages (real subprocesses)."""

import json
import re
import subprocess
import sys

import pytest
import torch

from blockdraft.draft import DFlashDrafter, DraftConfig
from blockdraft.engine import Engine

CONTRACT = {
    "text",
    "token_ids",
    "num_prompt_tokens",
    "num_output_tokens",
    "acceptance_lengths",
    "tau",
    "decode_seconds",
    "tokens_per_second",
}


def cli(*args, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "blockdraft", *args], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def run_main(capsys, *args):
    """The same command in this process, without a torch start-up: (exit code, stderr)."""
    from blockdraft.cli import main

    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, random_drafter):
    path = tmp_path_factory.mktemp("drafts") / "random"
    random_drafter.save(path)
    return path


def test_generate_json_contract_and_losslessness(draft_dir, hf_smol, tokenizer):
    outs = {}
    for method, extra in (("ar", []), ("dflash", []), ("dflash-tree", ["--tree-budget", "6"])):
        code, out, err = cli(
            "generate",
            "--prompt",
            "Name three fruits.",
            "--chat",
            "--max-new-tokens",
            "12",
            "--method",
            method,
            "--draft",
            str(draft_dir),
            "--json",
            *extra,
        )
        assert code == 0, err
        outs[method] = data = json.loads(out)
        assert CONTRACT <= set(data)
        assert data["num_output_tokens"] == len(data["token_ids"]) <= 12
        assert data["tau"] == pytest.approx(sum(data["acceptance_lengths"]) / len(data["acceptance_lengths"]))
        assert data["tokens_per_second"] > 0
        # which dtype ran and why (on a CPU `auto` measures), and that it ran in exact mode
        assert data["dtype"] in ("float32", "bfloat16") and data["dtype_reason"].startswith("auto: a 16-row bf16")
        assert data["exact"] is True
    assert outs["ar"]["token_ids"] == outs["dflash"]["token_ids"] == outs["dflash-tree"]["token_ids"]
    assert outs["dflash-tree"]["method"] == "dflash-tree" and outs["dflash-tree"]["block_size"] == 7
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three fruits."}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    assert outs["ar"]["num_prompt_tokens"] == len(ids)
    ref = hf_smol.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=2)
    assert outs["ar"]["token_ids"] == ref[0, len(ids) :].tolist()
    assert outs["ar"]["text"] == tokenizer.decode(ref[0, len(ids) :], skip_special_tokens=True)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "/nonexistent/model"], "target model folder not found"),
        (["--prompt-override", ""], "empty prompt"),
        (["--block-size", "32"], "block size 32 must be between 2 and the drafter's trained block size 16"),
        (["--max-new-tokens", "9000"], "exceeds the model's context of 8192 tokens"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--tree-budget", "4", "--method", "lookup"], "--tree-budget applies to method dflash-tree"),
        (["--tree-budget", "0"], "--tree-budget must be at least 1"),
    ],
)
def test_bad_input_is_a_clear_error_not_a_traceback(args, message, draft_dir, capsys):
    """The first case runs as a real process (exit code 2, no traceback on stderr); the others
    call the same `main` in this process (an exception other than the one-line error would fail
    the test just the same)."""
    prompt = "Hello"
    if args[0] == "--prompt-override":
        prompt, args = args[1], []
    argv = ["generate", "--prompt", prompt, "--draft", str(draft_dir), *args]
    if args[:1] == ["--target"]:
        code, _, err = cli(*argv)
    else:
        code, err = run_main(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_mismatched_drafter_and_unsupported_target_are_clear_errors(tmp_path, draft_dir, capsys):
    torch.manual_seed(0)
    wrong = DraftConfig(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=1000,
        num_target_layers=30,
        target_layer_ids=[15],
        mask_token_id=4,
        block_size=8,
    )
    DFlashDrafter(wrong).save(tmp_path / "wrong")
    code, err = run_main(capsys, "generate", "--prompt", "Hi", "--draft", str(tmp_path / "wrong"))
    assert code == 2 and "hidden size 64 != target's 576" in err and "vocab size 1000" in err
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    code, err = run_main(capsys, "generate", "--prompt", "Hi", "--target", str(tmp_path / "gpt2"), "--method", "ar")
    assert code == 2 and "unsupported architecture 'gpt2'" in err


def test_no_shipped_drafter_yet_says_so(monkeypatch, tmp_path):
    import blockdraft.engine as engine_mod

    monkeypatch.setitem(engine_mod.SHIPPED_DRAFTS, (engine_mod.DEFAULT_TARGET_NAME, "dflash"), tmp_path / "none")
    engine = Engine.load()
    from blockdraft.errors import BlockdraftError

    with pytest.raises(BlockdraftError, match="no trained drafter is shipped"):
        engine.generate("Hi", method="dflash")
    assert engine.generate("Hi", method="ar", max_new_tokens=3).num_output_tokens == 3


@pytest.mark.slow
def test_api_stream_and_stop_strings(draft_dir):
    engine = Engine.load(draft=draft_dir)
    full = engine.generate("List the days of the week, one per line.", chat=True, max_new_tokens=40)
    pieces = list(engine.stream("List the days of the week, one per line.", chat=True, max_new_tokens=40))
    assert "".join(pieces) == full.text and len(pieces) > 3
    word = full.text.split()[2]
    cut = engine.generate("List the days of the week, one per line.", chat=True, max_new_tokens=40, stop=word)
    assert cut.finish_reason == "stop" and word not in cut.text and full.text.startswith(cut.text)
    streamed = "".join(
        engine.stream("List the days of the week, one per line.", chat=True, max_new_tokens=40, stop=word)
    )
    assert streamed == cut.text
    batch = engine.generate(["Hi!", "Count to five."], chat=True, max_new_tokens=8, method="ar")
    assert [b.token_ids for b in batch] == [
        engine.generate(p, chat=True, max_new_tokens=8, method="ar").token_ids for p in ["Hi!", "Count to five."]
    ]


def test_the_shipped_drafter_is_the_default_and_matches_its_card():
    from blockdraft.engine import SHIPPED_DRAFTS
    from blockdraft.models.default import DEFAULT_TARGET_NAME

    folder = SHIPPED_DRAFTS[DEFAULT_TARGET_NAME, "dflash"]
    engine = Engine.load()
    assert engine.drafter is not None and engine.drafter.kind == "dflash"
    cfg = json.loads((folder / "config.json").read_text())
    # a Markov head: the folder says it is DSpark's (the authors' DFlash class would drop the head)
    assert cfg["architectures"] == (["Qwen3DSparkModel"] if cfg.get("markov_rank") else ["DFlashDraftModel"])
    assert cfg["dtype"] == "float16"
    assert engine.drafter.config.block_size == cfg["block_size"]
    card = (folder / "README.md").read_text()
    assert "HumanEval" in card and "MT-Bench" in card and "τ" in card


def test_demo_compares_both_dflash_runs_with_hf_greedy(hf_smol, tokenizer):
    """`make demo`'s command: ar, dflash and dflash-cut with the shipped drafter, the texts
    it prints are HF's own greedy answer, and it reports both speedups."""
    prompt = "Write a Python function that adds two numbers."
    code, out, err = cli("demo", "--prompt", prompt, "--max-new-tokens", "24", "--dtype", "float32")  # as HF's
    assert code == 0, err
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    ref = hf_smol.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=2)
    expected = tokenizer.decode(ref[0, len(ids) :], skip_special_tokens=True).strip()
    parts = re.split(r"^=== (\S+): [^\n]* ===\n", out.split("\noutputs: ")[0], flags=re.M)
    assert parts[1::2] == ["ar", "dflash", "dflash-cut"], out
    assert [p.strip() for p in parts[2::2]] == [expected] * 3
    assert "outputs: identical; speedup over ar: dflash " in out and "dflash-cut " in out


def test_method_registry_drives_the_cli_and_finds_shipped_drafters():
    from blockdraft import methods
    from blockdraft.errors import BlockdraftError

    assert {"ar", "lookup", "eagle3", "dflash"} <= set(methods.names())
    assert {"hf", "hf-lookup"} <= set(methods.names(include_peers=True)) - set(methods.names())
    assert methods.parse("dflash@8")[1] == 8 and methods.parse("lookup")[1] is None
    for bad in ("nosuch", "ar@4", "dflash@x", "dflash@1", "hf"):
        with pytest.raises(BlockdraftError):
            methods.parse(bad)
    engine = Engine.load(use_draft=False)
    assert engine.drafter is None and engine.eagle is None
    out = engine.generate("Hi", chat=True, method="eagle3", max_new_tokens=6)  # shipped baseline, no --eagle
    assert (
        engine.eagle is not None
        and out.token_ids == engine.generate("Hi", chat=True, method="ar", max_new_tokens=6).token_ids
    )
    code, _, err = cli("generate", "--prompt", "Hi", "--method", "nosuch")
    assert code == 2 and "invalid choice" in err


def test_an_abandoned_stream_stops_within_a_step():
    import time

    from blockdraft.proposers import Proposer

    class Counting(Proposer):
        calls = 0

        def propose(self, last_tokens, positions, n, rows=slice(None), probs=False):
            Counting.calls += 1
            return super().propose(last_tokens, positions, n, rows, probs)

    engine = Engine.load(use_draft=False)
    stream = engine.stream(
        "Tell me a long story about a dragon.", chat=True, method="ar", max_new_tokens=300, proposer=Counting()
    )
    first = [next(stream), next(stream)]
    assert all(isinstance(p, str) for p in first)
    stream.close()  # the consumer goes away
    stopped_at = Counting.calls
    time.sleep(0.5)
    assert Counting.calls == stopped_at < 40  # no step after the close (the worker was joined)
    assert engine.generate("Hi", chat=True, method="ar", max_new_tokens=4).num_output_tokens == 4


def test_train_flags_document_every_setting_and_keep_its_defaults(capsys):
    """`blockdraft train` has one flag per TrainConfig field, each with its help text, and a
    command line naming only the required flags gives exactly TrainConfig's defaults."""
    import argparse
    import dataclasses

    from blockdraft.cli import add_train_args
    from blockdraft.train.config import TrainConfig

    parser = argparse.ArgumentParser(prog="train")
    actions = add_train_args(parser)
    fields = [f for f in dataclasses.fields(TrainConfig) if f.name != "extra"]
    for f in fields:
        assert f.metadata.get("help"), f"TrainConfig.{f.name} has no help text"
    helps = {name: a.help for name, a in actions.items()}
    for f in fields:
        assert helps[f.name].startswith(f.metadata["help"])
    args = parser.parse_args(["--data", "d", "--out", "o"])
    parsed = TrainConfig(**{f.name: getattr(args, f.name) for f in fields})
    assert parsed == TrainConfig(data="d", out="o")
    args = parser.parse_args(
        [
            "--data",
            "d",
            "--out",
            "o",
            "--block-size",
            "4",
            "--lr",
            "2e-4",
            "--target-layer-ids",
            "1",
            "5",
            "--init-from",
            "x",
        ]
    )
    assert (args.block_size, args.lr, args.target_layer_ids, args.init_from) == (4, 2e-4, [1, 5], "x")
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "o"])  # --data is required
    assert "--data" in capsys.readouterr().err
