"""Offline prompt sets: complete, and evaluation prompts kept out of training data."""

import gzip
import json

import pytest

from blockdraft.datasets import (
    PROMPT_SOURCES,
    contaminated,
    eval_fingerprints,
    gsm8k,
    humaneval,
    is_code_prompt,
    is_validation,
    iter_sharegpt,
    mtbench,
)


def test_eval_sets_load():
    he, mt, gsm = humaneval(), mtbench(), gsm8k()
    assert len(he) == 164 and he[0]["id"] == "HumanEval/0"
    assert he[0]["turns"][0].startswith("Write a solution to the following problem")
    assert "def has_close_elements" in he[0]["turns"][0]
    assert len(mt) == 80 and all(len(r["turns"]) == 2 for r in mt)
    assert (
        len(gsm) == 100 and len({r["id"] for r in gsm}) == 100 and all(r["id"].startswith("gsm8k-test-") for r in gsm)
    )
    assert gsm[0]["turns"][0].startswith("Melanie is a door-to-door saleswoman")
    assert gsm[0]["turns"][0].endswith("put your final answer within \\boxed{}.") and gsm[0]["answer"] == "18"


@pytest.mark.parametrize("name,low,high", [("asdiv", 2305, 2305), ("leetcode", 1300, 1405), ("codeio", 3000, 3002)])
def test_packaged_training_sources_load_completely(name, low, high):
    records = list(PROMPT_SOURCES[name]())
    assert low <= len(records) <= high
    assert len({r["id"] for r in records}) == len(records)
    assert all(r["messages"][-1]["role"] == "user" and r["messages"][-1]["content"].strip() for r in records)


def test_later_sharegpt_turns_carry_the_conversation_and_its_split():
    later = [r for _, r in zip(range(300), PROMPT_SOURCES["sharegpt-later"](), strict=False)]
    assert later
    for r in later:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        assert r["id"].startswith(r["group"] + "/turn")  # the split follows the whole conversation


def test_code_prompts_are_told_apart_from_chat():
    assert is_code_prompt("In Java, I want to replace string like {object}")
    assert is_code_prompt("Fix this:\n```\nprint(1\n```")
    assert not is_code_prompt("Write a poem about autumn leaves falling in the park.")
    assert not is_code_prompt("What are the best places to visit in Lisbon?")


def test_sharegpt_reader_keeps_every_complete_conversation():
    records = list(iter_sharegpt())
    assert 17_000 < len(records) < 18_000  # the file is cut off inside the last conversation
    assert len({r["id"] for r in records}) == len(records)
    assert all(r["turns"] and r["conversation"] for r in records)
    held_out = sum(is_validation(r["id"]) for r in records)
    assert 0.01 * len(records) < held_out < 0.03 * len(records)
    # the split is a fixed function of the id, the same on every machine
    assert [i for i in range(140) if is_validation(f"x/{i}")] == [34, 68, 72, 126, 139]
    assert sum(is_validation(f"x/{i}") for i in range(10_000)) == 217


def test_evaluation_prompts_are_recognised_for_exclusion():
    fps = eval_fingerprints()
    assert contaminated("Please help: " + humaneval()[3]["turns"][0], fps)
    assert contaminated(mtbench()[5]["turns"][0].upper(), fps)
    assert contaminated("Q: " + gsm8k()[7]["turns"][0].split("\n")[0], fps)
    assert not contaminated("Write a poem about autumn leaves falling in the park.", fps)


def test_prompt_mix_is_a_deterministic_weighted_round_robin():
    from blockdraft.train.data import interleave, parse_mix

    out = [name for name, _ in interleave({"a": range(100), "b": range(3), "c": range(100)}, {"a": 2, "b": 1, "c": 1})]
    assert out[:8] == ["a", "b", "c", "a", "a", "b", "c", "a"]
    assert out.count("b") == 3 and out.count("a") == 100 and out.count("c") == 100  # exhausted streams drop out
    assert parse_mix("asdiv=2, leetcode") == {"asdiv": 2.0, "leetcode": 1.0}
    from blockdraft.errors import BlockdraftError

    for bad in ("nosuch=1", "asdiv=x", "asdiv=0"):
        with pytest.raises(BlockdraftError):
            parse_mix(bad)


def test_training_prompts_exclude_evaluation_prompts_and_long_ones(tokenizer):
    from blockdraft.train.data import training_prompts

    fps = ["allan brought two balloons and jake brought four balloons"]  # pretend ASDiv #3 is an eval prompt
    prompts = [p for _, p in zip(range(50), training_prompts(tokenizer, "asdiv", 90, fingerprints=fps), strict=False)]
    assert len(prompts) == 50 and "asdiv/3" not in {p["id"] for p in prompts}
    assert all(len(p["prompt_ids"]) <= 90 and p["source"] == "asdiv" for p in prompts)
    assert all(p["split"] == ("valid" if is_validation(p["id"]) else "train") for p in prompts)


def test_regeneration_resumes_without_losing_or_duplicating(tmp_path):
    import fcntl

    from blockdraft import Engine
    from blockdraft.errors import BlockdraftError
    from blockdraft.train.data import iter_samples
    from blockdraft.train.regen import regenerate

    engine = Engine.load(use_draft=False)
    run = dict(mix="asdiv", max_new_tokens=4, batch_size=2, progress=False)
    assert regenerate(engine, tmp_path, limit=3, **run).written == 3
    shards = sorted(tmp_path.glob("shard-*"))
    assert [p.name for p in shards] == ["shard-00000.jsonl.gz"]  # closed shards are compressed
    kept = gzip.open(shards[0], "rt").read().splitlines()
    # A writer killed mid-line leaves a plain shard with a torn last line...
    (tmp_path / "shard-00001.jsonl").write_text(kept[1] + "\n" + '{"id": "asdiv/torn", "prom')
    # ... and one killed between compressing and deleting leaves a plain twin of a .gz shard.
    (tmp_path / "shard-00000.jsonl").write_text("\n".join(kept) + "\n")
    assert [s["id"] for s in iter_samples(tmp_path)] == [json.loads(k)["id"] for k in kept]
    assert regenerate(engine, tmp_path, limit=5, **run).written == 2
    samples = list(iter_samples(tmp_path))
    ids = [s["id"] for s in samples]
    assert len(ids) == 5 == len(set(ids)) and "asdiv/torn" not in ids
    assert all(p.name.endswith(".jsonl.gz") for p in tmp_path.glob("shard-*"))
    for s in samples[:2]:  # greedy answers are the target's own
        assert s["answer_ids"] == engine.generate(s["prompt_ids"], method="ar", max_new_tokens=4).token_ids
        assert s["source"] == "asdiv" and s["max_new_tokens"] == 4
    with open(tmp_path / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(BlockdraftError, match="another `data regenerate`"):
            regenerate(engine, tmp_path, limit=6, **run)


def test_regeneration_in_a_large_continuous_batch_equals_one_by_one(tmp_path):
    """Rows join and leave a 3-row batch at different times; every answer is still the
    target's own greedy answer for that prompt alone."""
    from blockdraft import Engine
    from blockdraft.train.data import training_prompts
    from blockdraft.train.regen import answer_prompts

    engine = Engine.load(use_draft=False)
    prompts = [p for _, p in zip(range(7), training_prompts(engine.tokenizer, "asdiv=1,leetcode=1", 256), strict=False)]
    got = []
    stats = answer_prompts(engine, iter(prompts), max_new_tokens=12, batch_size=3, on_sample=got.append)
    assert stats.written == 7 == len(got) and stats.tokens == sum(len(s["answer_ids"]) for s in got)
    for s in got:
        assert s["answer_ids"] == engine.generate(s["prompt_ids"], method="ar", max_new_tokens=12).token_ids


def test_regeneration_stores_each_answers_features_for_training(tmp_path):
    """`--feature-cache`: while rows join, leave and are re-sorted in a 3-row batch (and start from
    the shared chat-template prefix), every answered sequence's features go to the training feature
    cache: the target's own forward's over the whole sequence at the drafter's layers, every
    position but the last, under the key training looks them up by, with the target's top tokens
    (soft labels) at every answer position: those of the same forward's logits."""
    import argparse

    import torch

    from blockdraft import Engine
    from blockdraft.cli.data import feature_layers
    from blockdraft.errors import BlockdraftError
    from blockdraft.train.data import training_prompts
    from blockdraft.train.regen import answer_prompts, regenerate
    from blockdraft.train.features import FeatureCache, sequence_key

    engine = Engine.load(use_draft=False, dtype=torch.float32)  # compared with a whole-sequence fp32 forward
    args = argparse.Namespace(feature_layers=None, feature_cache=str(tmp_path / "cache"), draft=None)
    layers = feature_layers(args, engine)  # the shipped drafter's
    assert layers == [1, 14, 27]
    cache = FeatureCache(tmp_path / "cache", engine.target, layers, writer="regen")
    prompts = [p for _, p in zip(range(7), training_prompts(engine.tokenizer, "asdiv=1,leetcode=1", 256), strict=False)]
    got = []
    stats = answer_prompts(
        engine, iter(prompts), max_new_tokens=12, batch_size=3, on_sample=got.append, sort_every=2, features=cache
    )
    assert stats.written == stats.features == 7 == len(cache)
    for s in got:
        seq = s["prompt_ids"] + s["answer_ids"]
        stored, missing = cache.get([sequence_key(seq)], len(seq), "cpu")
        with torch.no_grad():
            _, whole = engine.target(
                torch.tensor([seq]), torch.arange(len(seq))[None], capture=tuple(layers), features_only=True
            )
        assert missing == [] and not stored[0, -1].any()  # the last position never went through the target
        torch.testing.assert_close(stored[0, :-1], whole[0, :-1], rtol=1e-3, atol=1e-3)
        ids, logp, missing = cache.get_teacher([sequence_key(seq)], len(seq), "cpu")
        start = len(s["prompt_ids"]) - 1  # the position predicting the first answer token
        assert missing == [] and (ids[0, :start] == -1).all() and (ids[0, len(seq) - 1 :] == -1).all()
        with torch.no_grad():
            final, _ = engine.target(torch.tensor([seq]), torch.arange(len(seq))[None])
            full = torch.log_softmax(engine.target.logits(final[0, start:-1]).float(), -1)
        assert torch.equal(ids[0, start:-1, 0], full.argmax(-1))  # greedy answers: the top token is the answer's
        assert torch.equal(ids[0, start:-1, 0], torch.tensor(s["answer_ids"]))
        torch.testing.assert_close(logp[0, start:-1], full.gather(1, ids[0, start:-1]), rtol=1e-3, atol=2e-3)
    cache.close()
    assert feature_layers(args, engine) == [1, 14, 27]  # now the cache's own
    from blockdraft.models import load_target
    from blockdraft.models.default import default_target_dir

    trainers = FeatureCache(tmp_path / "cache", load_target(default_target_dir()), layers)  # as training opens it
    assert len(trainers) == 7
    trainers.close()
    with pytest.raises(BlockdraftError, match="--method ar"):
        answer_prompts(
            engine,
            iter(prompts),
            max_new_tokens=2,
            batch_size=2,
            method="dflash",
            features=FeatureCache(tmp_path / "cache", engine.target, layers, writer="regen"),
        )
    # through `regenerate`, and only as long as the disk keeps its reserve
    again = FeatureCache(tmp_path / "cache", engine.target, layers, writer="regen")
    run = dict(mix="asdiv", limit=3, max_new_tokens=4, batch_size=2, progress=False)
    assert regenerate(engine, tmp_path / "answers", feature_cache=again, **run).features == 3
    again.room = lambda nbytes, reserve=0: False
    assert regenerate(engine, tmp_path / "answers", feature_cache=again, **{**run, "limit": 5}).features == 0
    again.close()


def test_sampled_regeneration_gives_several_seeded_answers_per_prompt_and_resumes(tmp_path):
    """`--answers-per-prompt 3 --temperature 1 --top-k 50`: every answer is the target's own seeded
    sample for its (prompt, answer index) id, the settings are recorded, a rerun writes nothing new,
    and asking for more answers later adds only the new indices."""
    from blockdraft import Engine
    from blockdraft.errors import BlockdraftError
    from blockdraft.train.answers import AnswerSampling, prompt_of, sample_seed
    from blockdraft.train.data import iter_samples
    from blockdraft.train.regen import regenerate

    engine = Engine.load(use_draft=False)
    sampling = AnswerSampling(1.0, 0.9, 50)
    run = dict(mix="asdiv", limit=2, max_new_tokens=6, batch_size=4, progress=False, sampling=sampling)
    stats = regenerate(engine, tmp_path, answers_per_prompt=3, **run)
    samples = list(iter_samples(tmp_path))
    dropped = set((tmp_path / "dropped.txt").read_text().split()) if stats.duplicates else set()
    assert stats.written == len(samples) and stats.written + stats.duplicates == 6 == len(dropped) + len(samples)
    assert len({prompt_of(s["id"]) for s in samples}) == 2
    for s in samples:
        assert s["prompt_id"] == prompt_of(s["id"]) and s["id"] == (
            s["prompt_id"] if s["answer_index"] == 0 else f"{s['prompt_id']}~a{s['answer_index']}"
        )
        assert (s["temperature"], s["top_p"], s["top_k"]) == (1.0, 0.9, 50)
        alone = engine.generate(
            s["prompt_ids"],
            method="ar",
            max_new_tokens=6,
            temperature=1.0,
            top_p=0.9,
            top_k=50,
            seed=sample_seed(s["id"]),
        )
        assert s["answer_ids"] == alone.token_ids
    assert len({tuple(s["answer_ids"]) for s in samples}) > 2  # seeds differ per answer, not per prompt only
    assert regenerate(engine, tmp_path, answers_per_prompt=3, **run).written == 0
    more = regenerate(engine, tmp_path, answers_per_prompt=4, **run)
    assert more.written + more.duplicates == 2
    assert len(list(iter_samples(tmp_path))) == len(samples) + more.written
    with pytest.raises(BlockdraftError, match="need sampling"):
        regenerate(engine, tmp_path / "greedy", answers_per_prompt=2, **{**run, "sampling": AnswerSampling()})
    with pytest.raises(BlockdraftError, match="need sampling"):
        regenerate(engine, tmp_path / "greedy", first_answer=1, **{**run, "sampling": AnswerSampling()})


def test_more_sampled_answers_beside_the_greedy_ones_in_another_folder(tmp_path):
    """`--first-answer 1 --dedup-against GREEDY`: answers 1.. of the prompts whose greedy answer 0
    is in another folder, each the target's seeded sample for its id; one identical to the greedy
    answer of its prompt is dropped (a 2-token cap makes such repeats common)."""
    from blockdraft import Engine
    from blockdraft.train.answers import AnswerSampling, prompt_of, sample_seed
    from blockdraft.train.data import iter_samples
    from blockdraft.train.regen import regenerate

    engine = Engine.load(use_draft=False)
    run = dict(mix="asdiv", limit=4, max_new_tokens=2, batch_size=4, progress=False)
    regenerate(engine, tmp_path / "greedy", **run)
    greedy = {s["id"]: s["answer_ids"] for s in iter_samples(tmp_path / "greedy")}
    sampling = AnswerSampling(0.7, 0.8, 20)
    stats = regenerate(
        engine,
        tmp_path / "sampled",
        first_answer=1,
        answers_per_prompt=2,
        sampling=sampling,
        dedup_against=[tmp_path / "greedy"],
        **run,
    )
    samples = list(iter_samples(tmp_path / "sampled"))
    dropped = (tmp_path / "sampled" / "dropped.txt").read_text().split() if stats.duplicates else []
    assert sorted([s["id"] for s in samples] + dropped) == sorted(f"{p}~a{i}" for p in greedy for i in (1, 2))
    assert stats.duplicates > 0  # at T 0.7 a 2-token answer often repeats the greedy one
    for s in samples:
        assert s["answer_index"] in (1, 2) and s["answer_ids"] != greedy[prompt_of(s["id"])]
        alone = engine.generate(
            s["prompt_ids"],
            method="ar",
            max_new_tokens=2,
            temperature=0.7,
            top_p=0.8,
            top_k=20,
            seed=sample_seed(s["id"]),
        )
        assert s["answer_ids"] == alone.token_ids
    for i in dropped:  # each dropped answer did equal its prompt's greedy answer or the other sample
        p = prompt_of(i)
        alone = engine.generate(
            next(s for s in iter_samples(tmp_path / "greedy") if s["id"] == p)["prompt_ids"],
            method="ar",
            max_new_tokens=2,
            temperature=0.7,
            top_p=0.8,
            top_k=20,
            seed=sample_seed(i),
        ).token_ids
        assert alone == greedy[p] or any(s["answer_ids"] == alone for s in samples if prompt_of(s["id"]) == p)
    # ids answered (or dropped) in a --dedup-against folder are not answered again elsewhere
    again = regenerate(
        engine,
        tmp_path / "more",
        first_answer=1,
        answers_per_prompt=3,
        sampling=sampling,
        dedup_against=[tmp_path / "greedy", tmp_path / "sampled"],
        **run,
    )
    assert again.written + again.duplicates == 4 and {
        prompt_of(s["id"]) for s in iter_samples(tmp_path / "more")
    } <= set(greedy)
    assert all(s["answer_index"] == 3 for s in iter_samples(tmp_path / "more"))


def test_a_rerun_tokenizes_only_the_prompts_it_may_still_answer(tmp_path, monkeypatch):
    """Resuming a finished folder of the built-in mix took over a minute, tokenizing prompts only to
    find them answered or too long: a prompt whose every answer of this run is done, or which was
    turned away before under the same tokenizer and prompt cap, is passed over untokenized."""
    from blockdraft import Engine
    from blockdraft.train import data, regen
    from blockdraft.train.answers import AnswerSampling

    records = [
        {"id": f"tiny/{i}", "messages": [{"role": "user", "content": f"Name {i + 2} colours."}]} for i in range(3)
    ]
    records.insert(1, {"id": "tiny/long", "messages": [{"role": "user", "content": "colour " * 40}]})
    run = dict(
        mix="tiny",
        sources={"tiny": lambda: iter(records)},
        max_new_tokens=3,
        batch_size=4,
        progress=False,
        max_prompt_tokens=40,
    )
    engine = Engine.load(use_draft=False)
    tokenized = []
    real = data.chat_prompt_ids

    def spy(tokenizer, turns):  # the prompts of the mix (not the chat template's own probes)
        if isinstance(turns, list):
            tokenized.append(turns[-1]["content"])
        return real(tokenizer, turns)

    monkeypatch.setattr(data, "chat_prompt_ids", spy)
    assert regen.regenerate(engine, tmp_path / "a0", **run).written == 3 and len(tokenized) == 4
    tokenized.clear()
    assert regen.regenerate(engine, tmp_path / "a0", **run).written == 0 and tokenized == []
    # answer 1 of every prompt, beside answer 0 in the other folder: the three are still to answer
    sampled = dict(sampling=AnswerSampling(0.7, 0.8, 20), first_answer=1, dedup_against=[tmp_path / "a0"])
    stats = regen.regenerate(engine, tmp_path / "a1", **run, **sampled)
    assert stats.written + stats.duplicates == 3 and len(tokenized) == 4
    tokenized.clear()
    assert regen.regenerate(engine, tmp_path / "a1", **run, **sampled).written == 0 and tokenized == []
    # a limit counts the first prompts of the mix, done or not: those are still read, the long one not
    assert regen.regenerate(engine, tmp_path / "a0", limit=2, **run).written == 0 and len(tokenized) == 2
    assert "colour colour" not in "".join(tokenized)
    tokenized.clear()
    # under another prompt cap the long prompt is looked at again, and answered
    assert regen.regenerate(engine, tmp_path / "a0", **{**run, "max_prompt_tokens": 256}).written == 1
    assert tokenized == ["colour " * 40]


def test_an_answer_identical_to_one_kept_for_its_prompt_is_dropped_for_good(tmp_path):
    from blockdraft.train.answers import AnswerDeduper

    kept = [{"id": "p/1", "answer_ids": [5, 6, 2]}]
    dedup = AnswerDeduper(tmp_path, kept)
    assert not dedup.keep({"id": "p/1~a1", "answer_ids": [5, 6, 2]})  # same prompt, same answer
    assert dedup.keep({"id": "p/1~a2", "answer_ids": [5, 7, 2]})
    assert dedup.keep({"id": "q/1~a1", "answer_ids": [5, 6, 2]})  # another prompt may say the same
    assert not dedup.keep({"id": "p/1~a3", "answer_ids": [5, 7, 2]})
    again = AnswerDeduper(tmp_path, kept)  # a rerun knows what it dropped
    assert again.dropped == {"p/1~a1", "p/1~a3"}


def test_self_written_prompts_are_the_targets_own_seeded_samples_resume_and_feed_regeneration(tmp_path):
    """`data prompts --synthesize N --domain D`: every kept prompt is the target's own seeded sample
    (temperature 1, top-p 0.95) after the domain's system prompt and the user header, decoded;
    a rerun for the same N writes nothing, a larger N only adds; every candidate is kept or
    rejected with a reason, never both; `data regenerate --prompts` answers the kept ones
    (math ones in the benchmark's math template) with the usual held-out split."""
    from blockdraft import Engine
    from blockdraft.datasets import MATH_TEMPLATE, is_validation
    from blockdraft.train.answers import sample_seed
    from blockdraft.train.data import iter_samples
    from blockdraft.train.regen import regenerate
    from blockdraft.train.prompts import DOMAINS, prompt_head_ids, prompt_sources, synthesize

    engine = Engine.load(use_draft=False)
    out = tmp_path / "synth-math"
    run = dict(max_prompt_tokens=48, batch_size=4, progress=False)
    stats = synthesize(engine, out, 3, "math", **run)
    kept = list(iter_samples(out))
    assert stats.kept == len(kept) == 3
    for rec in kept:
        head = prompt_head_ids(engine.tokenizer, DOMAINS["math"][rec["system"]])
        alone = engine.generate(
            head, method="ar", max_new_tokens=48, temperature=1.0, top_p=0.95, seed=sample_seed(rec["id"])
        )
        assert alone.finish_reason == "stop"
        assert rec["question"] == engine.tokenizer.decode(alone.token_ids, skip_special_tokens=True).strip()
        assert rec["turns"] == [MATH_TEMPLATE.format(question=rec["question"])]
    rejected = dict(line.split("\t") for line in (out / "rejected.tsv").read_text().splitlines())
    assert not set(rejected) & {r["id"] for r in kept}
    assert set(rejected.values()) <= {"cut", "short", "role", "language", "repetitive", "evaluation", "near-duplicate"}
    assert synthesize(engine, out, 3, "math", **run).kept == 3 and len(list(iter_samples(out))) == 3
    assert synthesize(engine, out, 5, "math", **run).kept == 5
    again = list(iter_samples(out))
    assert [r["id"] for r in again[:3]] == [r["id"] for r in kept] and len({r["id"] for r in again}) == 5

    answers = tmp_path / "answers"
    regenerate(engine, answers, sources=prompt_sources(tmp_path), max_new_tokens=4, batch_size=4, progress=False)
    samples = {s["id"]: s for s in iter_samples(answers)}
    assert set(samples) == {r["id"] for r in again}
    for r in again:
        s = samples[r["id"]]
        assert s["source"] == "synth-math" and s["prompt"] == r["turns"][0]
        assert s["split"] == ("valid" if is_validation(r["id"]) else "train")


def test_prompt_filters_and_near_duplicates():
    from blockdraft.train.prompts import NearDuplicates, problem

    fps = ["a prompt of an evaluation set, long enough to fingerprint"]
    ok = "How do I reverse a linked list in Python without recursion?"
    assert problem(ok, "stop", fps) is None
    assert problem(ok, "length", fps) == "cut"
    assert problem("Hi there", "stop", fps) == "short"
    assert problem("assistant: Sure, here is the code you asked for", "stop", fps) == "role"
    assert problem("Как мне развернуть связанный список на питоне?", "stop", fps) == "language"
    assert problem("1 2 3 4 5 6 7 8 9 10 11 12 13 = ?", "stop", fps) == "language"
    assert problem("tell me more " * 8, "stop", fps) == "repetitive"
    assert (
        problem("Please answer: A prompt of an evaluation set, long enough to fingerprint it.", "stop", fps)
        == "evaluation"
    )
    near = NearDuplicates(0.5)
    near.add(ok)
    assert near.similar("How do I reverse a linked list in Python without recursion, please?")
    assert not near.similar("How do I sort a dictionary by its values in Python?")
    assert not near.similar("Write a poem about the sea at night.")
