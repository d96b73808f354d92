"""`blockdraft bench` on a small sample: the results.json contract and sane values."""

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, random_drafter):
    path = tmp_path_factory.mktemp("bench") / "drafter"
    random_drafter.save(path)
    return path


def test_bench_json_contract(tmp_path, draft_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Name a colour.", "And another one?"]}) + "\n"
                       + json.dumps({"turns": ["def add(a, b):"], "extra": 1}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "blockdraft", "bench", "--prompts", str(prompts),
                           "--methods", "ar,dflash,dflash@4", "--max-new-tokens", "8", "--draft", str(draft_dir),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    methods = report["methods"]
    assert set(methods) == {"ar", "dflash", "dflash@4"}
    for name, r in methods.items():
        assert {"tau", "acceptance_histogram", "tokens_per_second", "speedup_vs_ar", "prompts"} <= set(r)
        assert r["tokens_per_second"] > 0 and r["tau"] >= 1.0
        assert sum(r["acceptance_histogram"]) == pytest.approx(1.0)
        assert len(r["prompts"]) == 2 and len(r["prompts"][0]["token_ids"]) == 2  # both turns ran
    assert methods["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert methods["dflash"]["block_size"] == 16 and methods["dflash@4"]["block_size"] == 4
    # greedy speculative decoding is lossless: the same tokens as ar, turn by turn
    for name in ("dflash", "dflash@4"):
        assert [p["token_ids"] for p in methods[name]["prompts"]] == [p["token_ids"] for p in methods["ar"]["prompts"]]
