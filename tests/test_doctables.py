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
