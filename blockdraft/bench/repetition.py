"""How much of an answer repeats itself, and τ outside the repeats.

A small target decoding greedily often loops (the same lines, again and again), and any
drafter (prompt lookup above all) predicts a loop easily, so loops raise τ without saying
anything about the drafts elsewhere. The benchmark reports, per method, the share of output
tokens that repeat and τ over the verify steps that commit none of them.

A token repeats when the `REPEAT_NGRAM` tokens ending at it occurred, in that order, earlier
in the same answer (so an answer of fewer tokens never repeats, and common idioms shorter than
that do not count).
"""

from __future__ import annotations

REPEAT_NGRAM = 16


def repeated_mask(ids: list[int], n: int = REPEAT_NGRAM) -> list[bool]:
    """For each token of an answer: do the `n` tokens ending at it occur earlier in it?"""
    seen, mask = set(), []
    for i in range(len(ids)):
        gram = tuple(ids[i + 1 - n : i + 1]) if i + 1 >= n else None
        mask.append(gram is not None and gram in seen)
        if gram is not None:
            seen.add(gram)
    return mask


def steps_outside_repeats(ids: list[int], lengths: list[int], n: int = REPEAT_NGRAM) -> list[int]:
    """The acceptance lengths of the verify steps that commit no repeated token. The first
    output token comes from the prefill; step j then commits the `lengths[j]` tokens after
    those of the steps before it (the last step's may be cut by the token limit or a stop)."""
    return _steps_outside(repeated_mask(ids, n), lengths)


def _steps_outside(mask: list[bool], lengths: list[int]) -> list[int]:
    """`steps_outside_repeats` from an answer's `repeated_mask`."""
    kept, start = [], 1
    for a in lengths:
        if not any(mask[start : start + a]):
            kept.append(a)
        start += a
    return kept


def repetition_stats(outputs: list[tuple[list[int], list[int]]], n: int = REPEAT_NGRAM) -> dict:
    """Over (output ids, acceptance lengths) pairs of one method: the share of output tokens
    that repeat, τ over the steps that commit no repeated token and the share of steps that
    are such (both None when the method reports no acceptance lengths)."""
    masks = [repeated_mask(ids, n) for ids, _ in outputs]
    tokens = sum(len(mask) for mask in masks)
    repeated = sum(sum(mask) for mask in masks)
    steps = sum(len(lengths) for _, lengths in outputs)
    fresh = [a for mask, (_, lengths) in zip(masks, outputs, strict=False) for a in _steps_outside(mask, lengths)]
    return {
        "ngram": n,
        "repeated_share": repeated / tokens if tokens else 0.0,
        "tau_outside_repeats": sum(fresh) / len(fresh) if fresh else None,
        "steps_outside_repeats_share": len(fresh) / steps if steps else None,
    }


def table(results_dir: str, n: int = REPEAT_NGRAM) -> str:
    """A markdown table of a `blockdraft bench --out DIR` folder's repetition, per dataset and
    method, recomputed from its results.json files (τ outside repeats needs results made
    since the benchmark kept each prompt's acceptance lengths)."""
    import json
    from pathlib import Path

    lines = [
        f"| dataset | method | output tokens | repeated (runs of {n}) | τ | τ outside repeats "
        "| steps outside repeats |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in sorted(Path(results_dir).glob("*/results.json")):
        rep = json.loads(path.read_text())
        for name, r in rep["methods"].items():
            outputs = [
                (ids, lengths)
                for q in r["prompts"]
                for ids, lengths in zip(
                    q["token_ids"], q.get("acceptance_lengths") or [[]] * len(q["token_ids"]), strict=False
                )
            ]
            x = repetition_stats(outputs, n)
            tau = "-" if r.get("tau") is None else f"{r['tau']:.2f}"
            outside = "-" if x["tau_outside_repeats"] is None else f"{x['tau_outside_repeats']:.2f}"
            steps = "-" if x["tau_outside_repeats"] is None else f"{100 * x['steps_outside_repeats_share']:.0f}%"
            lines.append(
                f"| {rep['dataset']} | {name} | {sum(len(i) for i, _ in outputs)} | "
                f"{100 * x['repeated_share']:.1f}% | {tau} | {outside} | {steps} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m blockdraft.bench.repetition BENCH_OUT_DIR")
    print(table(sys.argv[1]))
