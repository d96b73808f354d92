"""Offline prompt sets: complete, and evaluation prompts kept out of training data."""

from blockdraft.datasets import contaminated, eval_fingerprints, humaneval, is_validation, iter_sharegpt, mtbench


def test_eval_sets_load():
    he, mt = humaneval(), mtbench()
    assert len(he) == 164 and he[0]["id"] == "HumanEval/0"
    assert he[0]["turns"][0].startswith("Write a solution to the following problem")
    assert "def has_close_elements" in he[0]["turns"][0]
    assert len(mt) == 80 and all(len(r["turns"]) == 2 for r in mt)


def test_sharegpt_reader_keeps_every_complete_conversation():
    records = list(iter_sharegpt())
    assert 17_000 < len(records) < 18_000  # the file is cut off inside the last conversation
    assert len({r["id"] for r in records}) == len(records)
    assert all(r["turns"] and r["conversation"] for r in records)
    held_out = sum(is_validation(r["id"]) for r in records)
    assert 0.01 * len(records) < held_out < 0.03 * len(records)
    assert is_validation(records[0]["id"]) == is_validation(records[0]["id"])  # stable


def test_evaluation_prompts_are_recognised_for_exclusion():
    fps = eval_fingerprints()
    assert contaminated("Please help: " + humaneval()[3]["turns"][0], fps)
    assert contaminated(mtbench()[5]["turns"][0].upper(), fps)
    assert not contaminated("Write a poem about autumn leaves falling in the park.", fps)


def test_regeneration_resumes_without_losing_or_duplicating(tmp_path):
    import json

    import pytest

    from blockdraft import Engine
    from blockdraft.errors import BlockdraftError
    from blockdraft.train.data import iter_samples, regenerate

    engine = Engine.load(use_draft=False)
    assert regenerate(engine, tmp_path, limit=2, max_new_tokens=4, batch_size=2) == 2
    shard = next(tmp_path.glob("shard-*.jsonl"))
    with open(shard, "a") as f:  # a writer killed mid-line
        f.write('{"id": "sharegpt/torn", "prom')
    assert regenerate(engine, tmp_path, limit=4, max_new_tokens=4, batch_size=2) == 2
    samples = list(iter_samples(tmp_path))
    ids = [s["id"] for s in samples]
    assert len(ids) == 4 == len(set(ids)) and "sharegpt/torn" not in ids
    first = samples[0]
    assert first["answer_ids"] == engine.generate(first["prompt_ids"], method="ar", max_new_tokens=4).token_ids
    assert json.loads(shard.read_text().splitlines()[-1])["id"] == ids[-1]
    with open(tmp_path / ".lock", "w") as lock:
        import fcntl
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(BlockdraftError, match="another `data regenerate`"):
            regenerate(engine, tmp_path, limit=5, max_new_tokens=4)
