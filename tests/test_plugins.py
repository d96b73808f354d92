"""Plug-ins: a new decoding method is one proposer class and one `register` line (generate, the
adaptive policy and the server's scheduler find it in the registry; this test's toy proposer
drafts the last token again and again); a new target family is one model class and one
`register` line (a toy Llama with its own checkpoint names). The toy drafter kind is in
test_drafters.py."""

import pytest
import torch

from blockdraft import methods
from blockdraft.engine import Engine
from blockdraft.models.transformer import Transformer
from blockdraft.proposers import Draft, Proposer


class RepeatProposer(Proposer):
    """Drafts n copies of each row's last committed token (a toy: right only on repetitions)."""

    name = "repeat"
    max_block_size = 6

    def propose(self, last_tokens, positions, n, rows=slice(None), probs=False):
        return Draft(last_tokens[:, None].expand(-1, n).clone())


@pytest.fixture
def repeat_method():
    method = methods.register(
        methods.Method("repeat", "drafts the last token again", lambda engine, spec: RepeatProposer())
    )
    methods.register(
        methods.Method(
            "repeat-adaptive", "the same, sized by measured speed", lambda engine, spec: RepeatProposer(), adaptive=True
        )
    )
    yield method
    del methods.METHODS["repeat"], methods.METHODS["repeat-adaptive"]


def test_a_toy_proposer_generates_and_serves_through_the_registry(smol, tokenizer, chat_ids, repeat_method):
    from blockdraft.serve.scheduler import Scheduler

    from .test_serve import serve_in_process

    engine = Engine(smol, tokenizer)
    prompts = [chat_ids[0], chat_ids[3]]
    want = [g.token_ids for g in engine.generate(prompts, method="ar", max_new_tokens=24)]
    assert "repeat" in methods.names() and "repeat[@B]" in methods.help_text()
    for name in ("repeat@4", "repeat-adaptive"):
        gens = engine.generate(prompts, method=name, max_new_tokens=24)
        assert [g.token_ids for g in gens] == want, name
        assert all(g.method == name.split("@")[0] for g in gens)
    assert gens[0].block_size == 6  # no @B: the proposer's largest block
    with torch.inference_mode():
        sched = Scheduler(engine, method="repeat", max_batch=2, max_queue=2, max_model_len=256)
    handles = serve_in_process(sched, [engine.make_row(p, 24) for p in prompts], timeout=300)
    assert [h.state.output_ids for h in handles] == want


class RenamedLlama(Transformer):
    """A toy family: a Llama whose checkpoint calls its layers `blocks.N` instead of `model.layers.N`."""

    @staticmethod
    def from_hf_weights(weights):
        return Transformer.from_hf_weights({k.replace("blocks.", "model.layers."): v for k, v in weights.items()})


def test_a_toy_target_family_loads_through_the_registry(tmp_path):
    """One model class and one `register` line: `load_target` builds the toy family from its own
    config and checkpoint names, and its logits are HF's for the same weights."""
    import json

    from safetensors.torch import load_file, save_file

    from blockdraft.models import families, load_target

    from .conftest import save_tiny_hf

    hf = save_tiny_hf("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "renamed_llama"}))
    weights = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    save_file({k.replace("model.layers.", "blocks."): v for k, v in weights.items()}, str(tmp_path / "w.safetensors"))
    families.register(families.Family("renamed_llama", f"{__name__}:RenamedLlama"))
    try:
        ours = load_target(tmp_path)
    finally:
        del families.FAMILIES["renamed_llama"]
    assert type(ours) is RenamedLlama and ours.config.model_type == "renamed_llama"
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[0]
        h, _ = ours(ids, torch.arange(ids.shape[1])[None])
    torch.testing.assert_close(ours.logits(h)[0], ref, atol=1e-4, rtol=1e-4)
