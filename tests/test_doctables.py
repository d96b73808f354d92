"""The generated docs tables: a results file -> the table between a page's markers (and its plot)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import doctable  # noqa: E402
import training_ab_table  # noqa: E402


def epoch_row(arch, epochs, tau, acc3):
    return {
        "run": f"epochs/{arch}/{epochs}",
        "kind": "epochs",
        "arch": arch,
        "epochs": epochs,
        "samples": 2000,
        "steps": 500 * epochs,
        "minutes": 1.25,
        "tau": tau,
        "tau_blocks": tau + 0.3,
        "val_acc": [0.6, 0.4, acc3],
        "cpu": "Test CPU",
        "threads": 2,
    }


def test_a_results_file_becomes_the_table_between_the_pages_markers_and_its_plot(tmp_path):
    results = tmp_path / "experiments.jsonl"
    rows = [
        epoch_row("dflash", 1, 1.4003, 0.1307),
        epoch_row("dspark", 1, 1.5419, 0.2951),
        {"run": "recipe/base", "kind": "recipe", "tau": 1.07},
    ]  # a kind these tables do not show
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- training-ab -->\nold table\n<!-- training-ab -->\nafter\n")
    plot = tmp_path / "curve.png"
    assert (
        doctable.main(
            training_ab_table.__doc__,
            "training-ab",
            lambda a: training_ab_table.table(a.results),
            [str(results), "--doc", str(page), "--plot", str(plot)],
            plot=lambda a, out: training_ab_table.plot_epochs(a.results, out),
            results=(None, "results"),
        )
        == 0
    )
    text = page.read_text()
    assert text.startswith("before\n<!-- training-ab -->\n**epochs**") and text.endswith(
        "<!-- training-ab -->\nafter\n"
    )
    assert "old table" not in text and "recipe/base" not in text
    assert (
        "| epochs/dflash/1 | dflash, 1 epoch(s) of 2000 samples | 500 | 1.2 | 1.400 | 1.700 | 0.600 | 0.400 | "
        "0.131 | Test CPU, 2 |"
    ) in text
    assert "| epochs/dspark/1 | dspark, 1 epoch(s) of 2000 samples |" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_page_without_its_two_markers_is_refused(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- headline -->\nonly one marker\n")
    with pytest.raises(SystemExit, match="two <!-- headline --> markers"):
        doctable.write_between(page, "headline", "| table |")
    assert page.read_text() == "<!-- headline -->\nonly one marker\n"


def test_the_branches_table_names_each_branchs_change(tmp_path):
    """benchmarks/branches_table.py: the change is read against the settings most branches share
    (a decay, another peak rate, a wider vocabulary, none), the taus and mean losses as recorded."""
    import branches_table

    def rec(step, **kw):
        r = dict(run="runs/wide16", from_step=step, steps=400, decay=False, draft_vocab=8192, lr=3e-4)
        r.update(tau_before=2.5, tau_after=2.6, seconds_per_step=1.0, mean_loss=12.5)
        r["eval"] = {"prompts": 32, "max_new_tokens": 96, "block": 16}
        return {**r, **kw}

    rows = [
        rec(100, decay=True),
        rec(200),
        rec(200, lr=6e-4, tau_after=2.4),
        rec(300, draft_vocab=16384, added_rows="m"),
    ]
    results = tmp_path / "branches.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = branches_table.table(results).splitlines()
    assert [line.split(" | ")[3] for line in lines[2:6]] == [
        "learning rate 0.0003 -> 0",
        "none (the control)",
        "learning rate 0.0006 (the run's 0.0003)",
        "draft vocabulary 16,384, added rows at m",
    ]
    assert lines[4].split(" | ")[4:7] == ["2.500", "2.400", "12.500"]
