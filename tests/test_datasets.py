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
