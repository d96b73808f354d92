"""The drafter-kind registry: the trainer, the engine and the methods find a kind there, so a
new kind plugs in with one module and one `register` line (this test's toy kind)."""

import pytest

from blockdraft import drafters, methods
from blockdraft.draft import DFlashDrafter
from blockdraft.errors import BlockdraftError
from blockdraft.proposers import DFlashProposer

from .test_train import tiny_config, tiny_corpus  # noqa: F401  (the fixture)


class ToyDrafter(DFlashDrafter):
    """A stand-in kind: a DFlash backbone under another name."""

    kind = "toy"


@pytest.fixture
def toy_kind():
    dflash = drafters.kind("dflash")

    def load(folder, device=None, dtype=None):
        d = dflash.load(folder, device, dtype)
        d.__class__ = ToyDrafter
        return d

    def build(target_config, cfg, vocab):
        d = dflash.build(target_config, cfg, vocab)
        d.__class__ = ToyDrafter
        return d

    kind = drafters.register(
        drafters.DrafterKind(
            "toy",
            "toy drafter",
            "DFlashDraftModel",
            "--toy",
            "drafter",
            load,
            build,
            dflash.init_layers,
            dflash.train_hidden,
            lambda d, t: DFlashProposer(d, t),
            describe=lambda d: "a toy",
        )
    )
    method = methods.register(
        methods.Method(
            "toy", "the toy kind", lambda e, spec: DFlashProposer(e.drafter_for("toy"), e.target), drafter="toy"
        )
    )
    yield kind
    del drafters.KINDS["toy"], methods.METHODS["toy"]
    assert method


def test_a_toy_drafter_kind_trains_and_drafts_through_the_registries(tiny_corpus, tmp_path, toy_kind):  # noqa: F811
    from blockdraft.batcher import generate_steps
    from blockdraft.proposers import Proposer
    from blockdraft.sequences import Request
    from blockdraft.train.trainer import Trainer

    root, target, prompts, answers = tiny_corpus
    trainer = Trainer(tiny_config(root, tmp_path / "toy", arch="toy", max_steps=3))
    assert isinstance(trainer.drafter, ToyDrafter) and trainer.kind is toy_kind
    trainer.run()
    drafter = toy_kind.load(tmp_path / "toy" / "drafter")
    assert drafters.kind_of(drafter) is toy_kind
    states, plain = [], []
    list(generate_steps(target, toy_kind.proposer(drafter, target), [Request(p, 16) for p in prompts[:3]], 4, states))
    list(generate_steps(target, Proposer(), [Request(p, 16) for p in prompts[:3]], 1, plain))
    assert [s.output_ids for s in states] == [s.output_ids for s in plain]  # lossless, whatever it drafts
    with pytest.raises(BlockdraftError, match="unknown drafter kind 'nope'; choose one of dflash, eagle3, toy"):
        drafters.kind("nope")
