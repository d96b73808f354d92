"""`blockdraft bench` on a small sample: the results.json contract and sane values."""

import json
import subprocess
import sys

import pytest
import torch


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, random_drafter):
    path = tmp_path_factory.mktemp("bench") / "drafter"
    random_drafter.save(path)
    return path


def test_bench_json_contract(tmp_path, draft_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"turns": ["Name a colour.", "And another one?"]})
        + "\n"
        + json.dumps({"turns": ["def add(a, b):"], "extra": 1})
        + "\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "blockdraft",
            "bench",
            "--prompts",
            str(prompts),
            "--methods",
            "ar,hf,lookup,hf-lookup@4,dflash,dflash@4",
            "--max-new-tokens",
            "8",
            "--draft",
            str(draft_dir),
            "--dtype",
            "float32",  # HF's own generate (fp32) is one of the methods compared
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    methods = report["methods"]
    assert set(methods) == {"ar", "hf", "lookup", "hf-lookup@4", "dflash", "dflash@4"}
    for name, r in methods.items():
        assert {"tau", "acceptance_histogram", "tokens_per_second", "speedup_vs_ar", "prompts"} <= set(r)
        assert r["tokens_per_second"] > 0
        assert len(r["prompts"]) == 2 and len(r["prompts"][0]["token_ids"]) == 2  # both turns ran
        if name in ("ar", "lookup", "dflash", "dflash@4"):
            assert r["tau"] >= 1.0 and sum(r["acceptance_histogram"]) == pytest.approx(1.0)
            assert len(r["per_position_acceptance"]) == r["block_size"] - 1
            assert all(0 <= x <= 1 for x in r["per_position_acceptance"])
            assert r["speedup_bound"] > 0
            assert r["draft_seconds"] + r["verify_seconds"] + r["prefill_seconds"] <= r["decode_seconds"] + 1e-6
    assert methods["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert methods["ar"]["speedup_bound"] == pytest.approx(1.0)
    assert methods["dflash"]["block_size"] == 16 and methods["dflash@4"]["block_size"] == 4
    # greedy decoding is lossless: every method gives ar's tokens, turn by turn (HF included)
    for name in methods:
        assert [p["token_ids"] for p in methods[name]["prompts"]] == [p["token_ids"] for p in methods["ar"]["prompts"]]
        # each verify step commits its acceptance length after the prefill's token (the last may be cut)
        for q in r["prompts"]:
            for ids, lengths in zip(q["token_ids"], q["acceptance_lengths"], strict=False):
                assert not lengths or len(ids) - 1 <= sum(lengths) <= len(ids) - 2 + r["block_size"]
        assert 0 <= r["repetition"]["repeated_share"] <= 1
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| dflash@4 | 4 |" in report and (tmp_path / "out" / "acceptance_p.png").stat().st_size > 1000
    assert "Repetition: " in report


def test_repetition_counts_repeated_runs_and_tau_away_from_them():
    from blockdraft.bench.repetition import repeated_mask, repetition_stats, steps_outside_repeats

    ids = [1, 2, 3, 1, 2, 3, 1, 2, 3, 4]
    assert repeated_mask(ids, 3) == [False] * 5 + [True] * 4 + [False]
    assert repeated_mask([7] * 5, 3) == [False, False, False, True, True]  # overlapping runs count
    assert repeated_mask(ids[:2], 3) == [False, False]
    # the prefill commits ids[0]; the steps then commit ids[1:3], ids[3:6], ids[6:7], ids[7:10]
    assert steps_outside_repeats(ids, [2, 3, 1, 3], 3) == [2]
    assert steps_outside_repeats(ids, [2, 2, 2, 4], 3) == [2, 2]  # a cut last step: ids[7:10] only
    stats = repetition_stats([(ids, [2, 3, 1, 3]), ([5, 6], [1])], 3)
    assert stats == {
        "ngram": 3,
        "repeated_share": 4 / 12,
        "tau_outside_repeats": 1.5,
        "steps_outside_repeats_share": 2 / 5,
    }
    assert repetition_stats([(ids, [])], 3)["tau_outside_repeats"] is None


def test_lookup_continuation():
    import numpy as np

    from blockdraft.proposers import lookup_continuation

    seq = np.array([5, 1, 2, 3, 9, 9, 1, 2])
    assert lookup_continuation(seq, 3, 3, 1) == [3, 9, 9]  # the 2-gram [1, 2] matched
    assert lookup_continuation(np.array([1, 2, 3]), 2, 3, 1) == []
    assert lookup_continuation(np.array([7, 8, 7, 4, 7]), 2, 3, 1) == [4, 7]  # latest match of [7]


@pytest.mark.slow
def test_distribution_check_and_lookup_sanity(draft_dir):
    """At T=1 speculative methods keep the target's token distribution (chi-square vs ar on
    other seeds); our lookup and HF's prompt lookup agree with greedy decoding."""
    from blockdraft.bench.runner import distribution_check, run_bench
    from blockdraft.engine import Engine

    engine = Engine.load(draft=draft_dir, dtype=torch.float32)  # (HF's prompt lookup, the oracle, runs fp32)
    records = [{"id": "a", "turns": ["Pick a random animal and describe it in one sentence."]}]
    report = distribution_check(engine, ["lookup", "dflash@4"], records, samples=200, positions=3)
    for checks in report.values():
        assert all(c["same_distribution"] for c in checks), checks
    results = run_bench(
        engine,
        [{"id": "b", "turns": ["Repeat this list twice: apple, pear, plum, fig."]}],
        ["ar", "lookup@6", "hf-lookup@6"],
        max_new_tokens=40,
    )
    ar = results["ar"]["prompts"][0]["token_ids"]
    assert results["lookup@6"]["prompts"][0]["token_ids"] == ar == results["hf-lookup@6"]["prompts"][0]["token_ids"]
    assert results["lookup@6"]["tau"] > 1.2  # repetition is where prompt lookup pays


def test_per_position_acceptance_has_one_definition_for_bench_and_serve():
    """P(draft k accepted | drafts 1..k-1 accepted), counted only where position k was drafted:
    hand-counted tables for the benchmark's lengths and the server's (accepted, drafted) outcomes."""
    from blockdraft.bench.runner import acceptance_stats
    from blockdraft.costs import PositionAcceptance
    from blockdraft.policy import SpeculationPolicy
    from blockdraft.proposers import LookupProposer

    # block 4 (3 drafts): lengths 1, 2, 4, 4, 3 commit 0, 1, 3, 3, 2 drafts
    hist, rates = acceptance_stats([1, 2, 4, 4, 3], 4)
    assert hist == [0, 0.2, 0.2, 0.2, 0.4]
    assert rates == [4 / 5, 3 / 4, 2 / 3]
    acc = PositionAcceptance(3)
    for accepted, drafted in [(0, 3), (1, 1), (1, 3), (2, 2)]:  # a step drafting 1 or 2 reaches no further
        acc.record(accepted, drafted)
    assert acc.reached == [4, 2, 0] and acc.accepted == [3, 1, 0]
    assert acc.rates() == [3 / 4, 1 / 2, 0.0]
    assert acc.expected_tokens(3) == pytest.approx(1 + 4 / 6 + 4 / 6 * 2 / 4)  # prior (1, 1)
    policy = SpeculationPolicy(LookupProposer(), 4, adaptive=True)  # no probabilities: measured rates
    for accepted, drafted in [(0, 3), (1, 1), (1, 3), (2, 2)]:
        policy.verified(1, drafted + 1, 0.1, torch.tensor([accepted]), None, [True], [accepted])
    assert policy.expected_tokens(4) == pytest.approx(acc.expected_tokens(4))
