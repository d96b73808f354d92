"""One registry of decoding methods: the CLI, the benchmark and the server list and build methods here.

A method is a name, a one-line summary, the kind of drafter it needs (found by default for the
default target, see `Engine.drafter_for`), its default verified block, and how to build its
proposer. Peer methods (HF transformers' own `generate`, ...) run outside our decode loop and
only in the benchmark. Adding a proposer is one new file plus one `register(...)` line here:

    register(Method("my-drafter", "what it does", build=lambda engine, spec: MyProposer(...)))

`build(engine, spec)` gets the engine (its target, `engine.drafter_for(kind)`) and the
`spec.SpecConfig` being built (e.g. `spec.window`, the draft window).

Method strings in the CLI and the API may carry a block size: `dflash@8`, `lookup@4` (the
verified block: the last committed token and B - 1 drafts). For tree methods the number counts
draft tokens instead: `dflash-tree@32` verifies 32 tree nodes (a block of 33).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

from .errors import BlockdraftError


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    build: Callable | None = None  # (engine, SpecConfig) -> Proposer (None for peers)
    drafter: str | None = None  # the kind of drafter the method needs: "dflash" | "eagle3" | None
    default_block: int | None = None  # verified block when none is given (None: the proposer's default)
    peer: bool = False  # runs outside blockdraft's decode loop (benchmark only)
    speculative: bool = True  # drafts tokens (a block size applies)
    counts_drafts: bool = False  # '@N' gives the draft tokens verified per step (block = N + 1)
    adaptive: bool = False  # the loop's speculation policy sizes each step by measured speed (blockdraft.policy)


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def _ar(engine, spec):
    from .proposers import Proposer

    return Proposer()


def _lookup(engine, spec):
    from .proposers import LookupProposer

    return LookupProposer()


def _dflash(engine, spec):
    from .proposers import DFlashProposer

    return DFlashProposer(engine.drafter_for("dflash"), engine.target, draft_window=spec.window)


def _dflash_tree(engine, spec):
    from .proposers import DFlashTreeProposer

    return DFlashTreeProposer(
        engine.drafter_for("dflash"), engine.target, top_k=TREE_TOP_K, tree_nodes=TREE_NODES, draft_window=spec.window
    )


TREE_TOP_K = 32  # candidates per block position a tree may branch into (measured: wider pays, see README)
TREE_NODES = 16  # draft tokens a tree verifies per step when no @N is given


def _eagle3(engine, spec):
    from .proposers import EagleProposer

    return EagleProposer(engine.drafter_for("eagle3"), engine.target)


register(Method("dflash", "the DFlash drafter: a whole block in one forward pass", _dflash, drafter="dflash"))
register(
    Method(
        "dflash-cut",
        "DFlash chain cut where verifying more stops paying (measured step costs)",
        _dflash,
        drafter="dflash",
        adaptive=True,
    )
)
register(
    Method(
        "dflash-tree",
        f"a tree of DFlash's top-{TREE_TOP_K} tokens per position, @N nodes "
        f"verified in one pass (default {TREE_NODES})",
        _dflash_tree,
        drafter="dflash",
        default_block=TREE_NODES + 1,
        counts_drafts=True,
    )
)
register(Method("ar", "plain autoregressive decoding (no speculation)", _ar, speculative=False))
register(Method("lookup", "prompt lookup: n-gram drafts copied from the context", _lookup, default_block=4))
register(Method("eagle3", "the EAGLE-3-style baseline drafter: a chain, one token per pass", _eagle3, drafter="eagle3"))
register(Method("hf", "HF transformers' own generate on the same weights", peer=True, speculative=False))
register(Method("hf-lookup", "HF transformers' prompt-lookup decoding", peer=True, default_block=11))
register(
    Method(
        "llamacpp", "llama.cpp on a GGUF of the same weights (optional extra: .[peers])", peer=True, speculative=False
    )
)
register(
    Method(
        "llamacpp-q4_1",
        "llama.cpp on the default target's original Q4_1 GGUF, whatever --dtype runs",
        peer=True,
        speculative=False,
    )
)
register(
    Method("llamacpp-lookup", "llama.cpp with its prompt-lookup drafts (B - 1 tokens)", peer=True, default_block=5)
)
register(
    Method(
        "llamacpp-server",
        "llama.cpp's llama-server, plain decoding (`make llama-server`)",
        peer=True,
        speculative=False,
    )
)
register(
    Method(
        "llamacpp-server-q4_1",
        "llama-server on the default target's original Q4_1 GGUF, plain decoding",
        peer=True,
        speculative=False,
    )
)
register(
    Method(
        "llamacpp-dflash",
        "llama-server's own DFlash with our drafter as GGUF (B - 1 drafts per step)",
        peer=True,
        drafter="dflash",
    )
)


def names(include_peers: bool = False) -> list[str]:
    return [m.name for m in METHODS.values() if include_peers or not m.peer]


def parse(text: str, include_peers: bool = False) -> tuple[Method, int | None]:
    """'dflash' | 'dflash@8' | ... -> (Method, block size or None for the default)."""
    base, at, block = text.partition("@")
    method = METHODS.get(base)
    if method is None or (method.peer and not include_peers):
        known = ", ".join(f"{n}[@B]" if METHODS[n].speculative else n for n in names(include_peers))
        raise BlockdraftError(f"unknown method {text!r}; choose one of {known}")
    if not at:
        return method, None
    if not method.speculative:
        raise BlockdraftError(f"{text!r}: {base} drafts nothing, so it takes no block size")
    if method.counts_drafts:
        if not block.isdigit() or int(block) < 1:
            raise BlockdraftError(f"{text!r}: the number of draft tokens after @ must be an integer >= 1")
        return method, int(block) + 1
    if not block.isdigit() or int(block) < 2:
        raise BlockdraftError(f"{text!r}: the block size after @ must be an integer >= 2")
    return method, int(block)


def help_text(include_peers: bool = False) -> str:
    return "; ".join(
        f"{m.name}{('[@N]' if m.counts_drafts else '[@B]') if m.speculative else ''}: {m.summary}"
        for m in METHODS.values()
        if include_peers or not m.peer
    )
