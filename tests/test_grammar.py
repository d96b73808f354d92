"""Structured outputs with speculation: lossless under a grammar.

Oracles: plain decoding (`ar`) under the same grammar, token for token (greedy, every method, the
default target in the dtype `auto` picks); the exact masked distribution of a tiny target under a
path-dependent toy grammar (sampling, chi-square); the schema and regex themselves (validity)."""

import itertools
import json
import math
import re

import pytest
import torch

import blockdraft.decode as decode_mod
import blockdraft.grammar as grammar_mod
from blockdraft.engine import Engine
from blockdraft.errors import BlockdraftError
from blockdraft.grammar import GrammarSpec
from blockdraft.proposers import DFlashProposer, DFlashTreeProposer
from blockdraft.sampling import SamplingParams, target_probs

from .test_sampling import PROMPT, V, L, chi_square, sample_counts, tiny  # noqa: F401 (the tiny target fixture)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a fictional person as JSON with name, age and hobbies.",
    "Give me a JSON profile of a cat owner.",
    "Write a JSON record for a chess player.",
]
METHODS = ["dflash", "dflash-cut", "dflash-tree", "eagle3", "lookup"]


@pytest.fixture(scope="module")
def engine():
    return Engine.load()


@pytest.fixture(scope="module")
def ar_json(engine):
    return engine.generate(
        PROMPTS, chat=True, method="ar", max_new_tokens=64, grammar=GrammarSpec("json_schema", SCHEMA)
    )


def check_schema(text: str):
    value = json.loads(text)
    assert set(value) == {"name", "age", "hobbies"} and isinstance(value["age"], int)
    assert all(isinstance(h, str) for h in value["hobbies"])


def test_ar_under_a_schema_writes_valid_json_or_stops_for_length(engine, ar_json):
    for g in ar_json:
        assert g.finish_reason in ("stop", "length")
        if g.finish_reason == "stop":
            check_schema(g.text)
        else:  # cut by max_new_tokens: said so (finish "length"), and every token the grammar's
            matcher = engine.grammar(GrammarSpec("json_schema", SCHEMA)).matcher()
            assert all(matcher.advance(t) for t in g.token_ids)
    assert any(g.finish_reason == "stop" for g in ar_json)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_under_a_schema_gives_ar_tokens(engine, ar_json, method):
    ours = engine.generate(
        PROMPTS, chat=True, method=method, max_new_tokens=64, grammar=GrammarSpec("json_schema", SCHEMA)
    )
    assert [g.token_ids for g in ours] == [g.token_ids for g in ar_json]
    assert [g.finish_reason for g in ours] == [g.finish_reason for g in ar_json]


def test_regex_and_choice_outputs_match_and_equal_ar(engine):
    for spec, check in [
        (GrammarSpec("regex", r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (GrammarSpec("choice", ["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
    ]:
        prompt = "Is the sky blue? Answer, or give a phone number."
        ar = engine.generate(prompt, chat=True, method="ar", max_new_tokens=16, grammar=spec)
        ours = engine.generate(prompt, chat=True, method="dflash", max_new_tokens=16, grammar=spec)
        assert ar.finish_reason == "stop" and check(ar.text), ar.text
        assert ours.token_ids == ar.token_ids


def test_a_grammar_the_drafts_ignore_is_caught_by_the_test(engine, ar_json, monkeypatch):
    """The mutant: every verified position masked by the state after the committed tokens only
    (the drafts before it ignored). Its output leaves the grammar or ar's tokens."""
    right = grammar_mod.chain_masks

    def committed_state_only(matcher, drafts, *args):
        drafts, masks = right(matcher, drafts, *args)
        return drafts, masks[:1] * len(masks)

    monkeypatch.setattr(decode_mod, "chain_masks", committed_state_only)
    try:
        ours = engine.generate(
            PROMPTS, chat=True, method="dflash", max_new_tokens=64, grammar=GrammarSpec("json_schema", SCHEMA)
        )
    except RuntimeError as exc:  # the loop's own check: an emitted token the grammar refuses
        assert "grammar refused" in str(exc)
        return
    assert [g.token_ids for g in ours] != [g.token_ids for g in ar_json]


@pytest.mark.parametrize(
    "spec, why",
    [
        (GrammarSpec("regex", "(a"), "regex cannot be compiled"),
        (GrammarSpec("json_schema", {"type": "nonsense"}), "json schema cannot be compiled"),
        (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
        (GrammarSpec("choice", []), "non-empty list"),
        (GrammarSpec("lark", "start: foo"), "cannot be compiled"),
        (GrammarSpec("regex", "[^\\x00-\\U0010FFFF]"), "matches no text"),
        (GrammarSpec("yaml", "a: b"), "unknown grammar kind"),
    ],
)
def test_bad_grammars_are_one_line_errors(engine, spec, why):
    with pytest.raises(BlockdraftError, match=why) as info:
        engine.generate("Hi", method="ar", max_new_tokens=4, grammar=spec)
    assert "\n" not in str(info.value)


# ---- sampling: the exact masked distribution of a tiny target --------------------------------


class ToyMatcher:
    """A path-dependent toy grammar over the tiny target's 6 tokens: the next token differs from
    the last one and from (number of tokens so far + 1) mod 6."""

    def __init__(self):
        self.path: list[int] = []
        self.grammar = ToyGrammar()

    def allowed(self):
        mask = torch.ones(V, dtype=torch.bool)
        mask[(len(self.path) + 1) % V] = False
        if self.path:
            mask[self.path[-1]] = False
        return mask

    def advance(self, token):
        assert self.allowed()[token], "a token the grammar does not allow was consumed"
        self.path.append(int(token))
        return True

    def rollback(self, n):
        del self.path[len(self.path) - n :]


class ToyGrammar:
    eos = frozenset()  # the tiny target's requests have no stop tokens

    def matcher(self):
        return ToyMatcher()


def toy_distribution(hf, params: SamplingParams) -> dict[tuple, float]:
    one = lambda x: torch.tensor([x])  # noqa: E731
    dist = {}
    for seq in itertools.product(range(V), repeat=L):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(seq[:-1])])).logits[0, len(PROMPT) - 1 :].clone()
        m = ToyMatcher()
        p = 1.0
        for i, t in enumerate(seq):
            mask = m.allowed()
            logits[i, ~mask] = float("-inf")
            probs = target_probs(logits[i : i + 1], one(params.temperature), one(params.top_p), one(params.top_k))
            p *= float(probs[0, t])
            if p == 0:
                break
            m.advance(t)
        dist[seq] = p
    return dist


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampling_under_a_grammar_follows_the_masked_target_distribution(tiny, tree):  # noqa: F811
    hf, target, drafter = tiny
    params = SamplingParams(1.0)
    dist = toy_distribution(hf, params)
    assert max(dist.values()) < 0.6 and sum(v == 0 for v in dist.values()) > 50  # spread, and masked
    proposer = DFlashTreeProposer(drafter, target, top_k=2, tree_nodes=5) if tree else DFlashProposer(drafter, target)
    counts = sample_counts(target, proposer, params, grammar=ToyGrammar())
    assert all(dist[seq] > 0 for seq in counts), "an output the grammar forbids"
    stat, critical = chi_square(dist, counts)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: not the masked target's distribution"
    assert math.isclose(sum(counts.values()), 3000)
