"""Structured outputs: a grammar (JSON schema, any JSON object, regex, choice, Lark / EBNF) that
every generated token must keep satisfiable, with speculation as lossless as without.

The engine is llguidance (MIT; chosen by measurement over xgrammar, which pulls in triton, and
outlines-core: see docs/structured.md). This module is the one place that knows it, behind a
small interface: `compile_grammar` (a spec -> a `Grammar`, or a one-line `BlockdraftError`),
`Grammar.matcher()` (a fresh state), and `Matcher` (`allowed()` the token mask of the state,
`advance(token)`, `rollback(n)`, `accepting`, `stopped`).

How the decode loop uses it (`DecodeLoop`, `block_masks`): the target's distribution at every
verified position is masked by the grammar state after the tokens before that position: the
committed ones, then the drafts on the path to it (a chain is a tree whose nodes hang one below
the other). A draft the state before it does not allow is never accepted (the masked target
cannot pick it), so nothing after it needs a mask; after the verify the matcher is rolled back
to the committed tokens and advanced by the emitted ones. The masked distributions are the ones
plain decoding with the same grammar samples from, so the output equals `ar`'s under the same
grammar token for token (greedy) and in distribution (sampled), whatever the drafts.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import torch

from .errors import BlockdraftError

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain to: `kind` one of KINDS, `source` its text (a JSON schema as a dict or
    string, a regex, a list of choices, a Lark grammar; None for json_object)."""

    kind: str
    source: object = None

    def llguidance(self) -> str:
        """The llguidance grammar text of this spec."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            schema = self.source
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise BlockdraftError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise BlockdraftError("a JSON schema must be a JSON object")
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
            except ValueError as exc:
                raise BlockdraftError(f"the JSON schema cannot be compiled: {_one_line(exc)}") from None
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_DEFAULTS)
        if self.kind == "regex":
            if not isinstance(self.source, str) or not self.source:
                raise BlockdraftError("a regex must be a non-empty string")
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            choices = list(self.source or [])
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise BlockdraftError("choices must be a non-empty list of non-empty strings")
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in choices))
        if self.kind == "lark":
            if not isinstance(self.source, str) or not self.source.strip():
                raise BlockdraftError("a grammar must be a non-empty Lark / EBNF text")
            return LLMatcher.grammar_from_lark(self.source)
        raise BlockdraftError(f"unknown grammar kind {self.kind!r}; choose one of {', '.join(KINDS)}")


# JSON in the target's own style: small models pretty-print it (newlines and indents), and forcing them
# into compact JSON both worsens the answers and leaves the drafters' training distribution. Whitespace
# between tokens is bounded, so a row can never wander in it until max_tokens.
_JSON_DEFAULTS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A]{0,16}"}


def _one_line(exc) -> str:
    return " ".join(str(exc).split())[:300]


@functools.cache
def _tokenizer(tokenizer, vocab_size: int, eos: tuple[int, ...]):
    """llguidance's view of a Hugging Face fast tokenizer (about a second to build: kept)."""
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos) or None)
    except ValueError as exc:
        raise BlockdraftError(f"structured outputs need a fast (Rust) tokenizer: {_one_line(exc)}") from None


class Grammar:
    """A compiled grammar for one tokenizer; `matcher()` gives each request its own state."""

    def __init__(self, spec: GrammarSpec, tokenizer, vocab_size: int, eos: tuple[int, ...]):
        from llguidance import LLMatcher

        self.spec, self.vocab_size = spec, vocab_size
        # stop tokens end a row, never go into a matcher (llguidance does not count a consumed stop
        # token in rollback: rolling one back would undo the token before it)
        self.eos = frozenset(int(t) for t in eos)
        self.lltok = _tokenizer(tokenizer, vocab_size, tuple(eos))
        self.text = spec.llguidance()
        error, messages = LLMatcher.validate_grammar_with_warnings(self.text, self.lltok)
        if error:
            raise BlockdraftError(
                f"the {spec.kind.replace('_', ' ')} cannot be compiled: "
                f"{_one_line(messages[0] if messages else 'invalid')}"
            )
        probe = self.matcher()
        allowed = probe.allowed()
        allowed[list(eos)] = False
        if not allowed.any() and not probe.accepting:  # at most a stop token, and the text not complete
            raise BlockdraftError(f"the {spec.kind.replace('_', ' ')} matches no text")

    def matcher(self) -> Matcher:
        return Matcher(self)


class Matcher:
    """One request's grammar state."""

    def __init__(self, grammar: Grammar):
        from llguidance import LLMatcher

        self.grammar = grammar
        self.m = LLMatcher(grammar.lltok, grammar.text, log_level=0)
        if self.m.is_error():
            raise BlockdraftError(f"grammar: {_one_line(self.m.get_error())}")
        words = (grammar.vocab_size + 31) // 32
        self._bits = torch.empty(words, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """The tokens the state allows next, bool [vocab] (a stop token where the text may end)."""
        bits = self._bits
        self.m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        return ((bits[:, None] >> self._shifts) & 1).bool().view(-1)[: self.grammar.vocab_size]

    def advance(self, token: int) -> bool:
        """Consume one token (False, and the state unusable, if the grammar does not allow it).
        Never a stop token (see `Grammar.eos`)."""
        return self.m.consume_token(int(token))

    def rollback(self, n: int):
        if n and not self.m.rollback(n):
            raise RuntimeError(f"grammar rollback of {n} tokens failed: {self.m.get_error()}")

    @property
    def accepting(self) -> bool:
        """The text so far is complete under the grammar."""
        return self.m.is_accepting()

    @property
    def stopped(self) -> bool:
        """No token but a stop token can follow."""
        return self.m.is_stopped()


def block_masks(matcher: Matcher, tokens: list[int], parents: list[int]) -> list[torch.Tensor | None]:
    """The masks of a verified block of one row: node i's mask is the state after the committed
    tokens (the root, node 0, the pending one, is already consumed) and the drafts on the path
    from the root to node i; None for a node some token on whose path the state before it does
    not allow (it can never be reached: the masked target never picks that token). Parents come
    before their children (a chain: parents[i] = i - 1). The matcher ends where it started."""
    masks: list[torch.Tensor | None] = []
    path: list[int] = []  # nodes consumed beyond the root, in order
    for i, parent in enumerate(parents):
        if i == 0:
            masks.append(matcher.allowed())
            continue
        if masks[parent] is None or not bool(masks[parent][tokens[i]]) or tokens[i] in matcher.grammar.eos:
            masks.append(None)  # unreachable, or a stop token (the row ends there)
            continue
        # the path of node i: its parent's path, then i
        chain = []
        j = parent
        while j > 0:
            chain.append(j)
            j = parents[j]
        chain.reverse()
        keep = 0  # how much of the consumed path node i shares
        while keep < len(path) and keep < len(chain) and path[keep] == chain[keep]:
            keep += 1
        matcher.rollback(len(path) - keep)
        del path[keep:]
        for j in chain[keep:] + [i]:
            matcher.advance(tokens[j])
            path.append(j)
        masks.append(matcher.allowed())
    matcher.rollback(len(path))
    return masks


def chain_masks(
    matcher: Matcher, drafts: list[int], pending: int | None = None, rescore=None
) -> tuple[list[int], list[torch.Tensor | None]]:
    """A chain's drafts made to follow the grammar, and the masks of its verified positions (the
    pending token's, then each draft's). Walking the drafts in order, a draft the state does not
    allow is replaced by the one token the state allows where it allows only one (JSON keys and
    punctuation under a schema: the drafter need not guess what the grammar forces), else by the
    drafter's own best allowed token, `rescore(i, previous token, mask)` (None: it has none), from
    there on for every later draft too (a Markov head's drafts depend on the token before them);
    without one the chain stops being reachable there (None masks: never accepted). Drafts only
    change what is proposed, never what is accepted. The matcher ends where it started."""
    out, masks, consumed = list(drafts), [], 0
    replaced = False
    for i in range(len(out) + 1):
        mask = matcher.allowed()
        masks.append(mask)
        if i == len(out):
            break
        if replaced or not bool(mask[out[i]]):
            only = mask.nonzero()
            pick = int(only[0, 0]) if only.shape[0] == 1 else None
            if pick is None and rescore is not None:
                pick = rescore(i, out[i - 1] if i else pending, mask)
            if pick is None:
                masks += [None] * (len(out) - i)
                break
            replaced = replaced or pick != out[i]
            out[i] = pick
        if out[i] in matcher.grammar.eos:  # the row ends there: nothing after it is accepted
            masks += [None] * (len(out) - i)
            break
        if not matcher.advance(out[i]):
            raise RuntimeError(f"grammar refused an allowed draft token {out[i]}")
        consumed += 1
    matcher.rollback(consumed)
    return out, masks


def apply_masks(logits: torch.Tensor, masks: list[torch.Tensor | None]):
    """Mask row logits [T, V] in place: disallowed tokens get -inf where a node has a mask."""
    for i, mask in enumerate(masks):
        if mask is not None:
            logits[i, : mask.shape[0]].masked_fill_(~mask.to(logits.device), float("-inf"))
            logits[i, mask.shape[0] :] = float("-inf")  # ids past the tokenizer's (padding rows)
