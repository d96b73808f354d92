"""How to speculate, resolved and validated once.

A `SpecConfig` is what a user asks for: a method (`blockdraft.methods`), optionally with a
block (`dflash@8`; for trees the node budget, `dflash-tree@32`), and fixed or adaptive
speculation. `build(engine)` resolves it against the engine's drafters into a `Speculation`:
the proposer, the verified block (`decode.resolve_block`, the one place a block size is chosen
and checked) and the policy mode. Generate, the benchmark, the server and regeneration all
start from one. One word for the size throughout: the *block*, the tokens one step verifies
(the last committed token and its drafts; for a tree, its nodes plus the root). The draft
window (`--draft-window`: how many committed tokens a DFlash drafter attends to) is part of it.

How the drafters' weights are stored (`--draft-weights`: float or int8 copies) is the engine's,
not a speculation setting: it decides how each drafter is loaded, once, and every method and
request then shares that one copy (`Engine.load`).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import methods
from .decode import resolve_block
from .proposers import Proposer, check_window


@dataclass(frozen=True)
class Speculation:
    method: str  # the registered method's name
    proposer: Proposer
    block: int  # verified tokens per step at most (1: no speculation)
    adaptive: bool  # the loop's policy sizes each step by measured speed


@dataclass(frozen=True)
class SpecConfig:
    method: str = "dflash"  # a registered method, optionally with @B (@N draft nodes for trees)
    block: int | None = None  # overrides the @B; None: the method's default, else the trained size
    adaptive: bool | None = None  # None: the method's own (dflash-cut: adaptive)
    clamp: bool = False  # a block above the drafter's trained size is lowered to it (the server's --block-size)
    # DFlash drafters see the last W committed tokens ("auto": as trained; 0/None: all)
    window: int | str | None = "auto"

    def __post_init__(self):
        methods.parse(self.method)  # an unknown method or a bad @B fails here, before anything loads
        check_window(self.window)

    @classmethod
    def of(cls, method: str | SpecConfig, block: int | None = None) -> SpecConfig:
        """A method string (with `block` overriding its @B) or a SpecConfig as it is."""
        if isinstance(method, SpecConfig):
            if block is not None and block != method.block:
                raise ValueError("give the block inside the SpecConfig, not beside it")
            return method
        return cls(method, block)

    def build(self, engine, proposer: Proposer | None = None) -> Speculation:
        """The proposer (a fresh one for the method, or the one given), its block and mode."""
        spec, at = methods.parse(self.method)
        name = spec.name
        if proposer is None:
            proposer = spec.build(engine, self)
        else:
            name, at = proposer.name, None
        block = resolve_block(proposer, self.block or at, clamp=self.clamp)
        return Speculation(name, proposer, block, spec.adaptive if self.adaptive is None else self.adaptive)
