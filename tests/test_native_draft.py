"""The native bf16 draft pass (`draft_native`) against the eager drafter: the KV injection and the
block pass are as close to the fp32 eager drafter as the eager bf16 drafter is (whole and windowed
draft contexts, a batch row picked by a slice), the greedy Markov chain gives the eager chain's
tokens, and the shipped drafter drafts the same tokens either way on real prompts."""

import pytest
import torch

from blockdraft.draft import DFlashDrafter, DraftConfig
from blockdraft.draft_native import unsupported, use_native_draft
from blockdraft.models import native, native_step
from blockdraft.models.config import TargetConfig

pytestmark = pytest.mark.skipif(not native.available(), reason="the native pass needs a CPU with AVX512-BF16")

TARGET = TargetConfig.from_dict(
    {
        "model_type": "qwen3",
        "vocab_size": 300,
        "hidden_size": 128,
        "intermediate_size": 160,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 256,
    }
)


def drafters(markov_rank=16, draft_vocab=None):
    """(fp32 reference, eager bf16, native bf16) copies of one random 2-layer drafter with
    non-trivial norms and a Markov head."""
    cfg = DraftConfig.for_target(TARGET, num_layers=2, block_size=4, mask_token_id=1, markov_rank=markov_rank)
    if draft_vocab:
        cfg = DraftConfig.from_dict({**cfg.to_dict(), "blockdraft": {"draft_vocab_size": draft_vocab}})
    torch.manual_seed(2)
    ref = DFlashDrafter(cfg).eval()
    ref.reset_parameters(std=0.08)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.startswith("markov_head."):  # large enough to change the chain's tokens
                p.normal_(0.0, 1.0)
    if draft_vocab:
        ref.set_draft_vocab(torch.randperm(TARGET.vocab_size)[:draft_vocab])
    eager = DFlashDrafter(cfg).eval()
    eager.load_state_dict(ref.state_dict())
    eager = eager.bfloat16()
    fast = DFlashDrafter(cfg).eval()
    fast.load_state_dict(ref.state_dict())
    fast = fast.bfloat16()
    assert use_native_draft(fast) == "native" and eager.native is None
    return ref, eager, fast


def passes(drafter, window, rows):
    """Two rows of different lengths, as a batch holds them: context at positions 0..9 (row 1
    commits 7 of them, the rest is junk written past its length) and blocks anchored at 10 and 7;
    then three more context tokens and blocks anchored at 13 and 10. The blocks' hidden states of
    `rows` and their cached keys."""
    gen = torch.Generator().manual_seed(4)
    feats = torch.randn(2, 13, 2 * TARGET.hidden_size, generator=gen)
    junk = torch.randn(2, 13, 2 * TARGET.hidden_size, generator=gen)
    noise = torch.randn(2, 4, TARGET.hidden_size, generator=gen)
    dtype = drafter.norm.weight.dtype
    cache = drafter.new_cache(2, 32, window)
    out = []
    pick = list(range(2))[rows]
    for positions, anchors in (([list(range(10))] * 2, [10, 7]), ([[10, 11, 12], [7, 8, 9]], [13, 10])):
        positions, valid = torch.tensor(positions)[pick], torch.tensor(anchors)[pick]
        rows_ix = torch.tensor(pick)[:, None]
        ctx = torch.where((positions < valid[:, None])[..., None], feats[rows_ix, positions], junk[rows_ix, positions])
        drafter.write_context(cache, ctx.to(dtype), positions, rows, valid)
        block = valid[:, None] + torch.arange(4)
        out.append(drafter(noise[rows].to(dtype), block, cache=cache, rows=rows))
    keys = cache.k[:, rows, :, : cache.block_slot if window else 13]
    if not window:  # (row 1's slots 10..12 were never committed: junk either way)
        keys = keys[:, :, :, :10]
    return out, keys


def error(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("window", [None, 6], ids=["whole-context", "window-6"])
@pytest.mark.parametrize("rows", [slice(None), slice(1, 2)], ids=["batch", "second-row"])
def test_the_native_pass_is_as_close_to_fp32_as_the_eager_bf16_drafter(window, rows):
    ref, eager, fast = drafters()
    with torch.inference_mode():
        (r_out, r_keys), (e_out, e_keys), (f_out, f_keys) = (passes(d, window, rows) for d in (ref, eager, fast))
    assert fast.new_cache(1, 8).k.dtype == torch.float32
    for r, e, f in zip(r_out + [r_keys], e_out + [e_keys], f_out + [f_keys], strict=True):
        assert f.shape == r.shape
        assert error(f, r) <= max(2 * error(e, r), 4e-3), (error(f, r), error(e, r))


@pytest.mark.parametrize("draft_vocab", [None, 40], ids=["whole-vocabulary", "draft-vocabulary"])
def test_the_native_markov_chain_is_the_eager_chain(draft_vocab):
    """The greedy chain (head rows, each position corrected by the token drafted before it, the
    first maximum) gives the eager bf16 chain's tokens, bit for bit the same arithmetic."""
    _, eager, fast = drafters(markov_rank=16, draft_vocab=draft_vocab)
    gen = torch.Generator().manual_seed(6)
    head = (torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=gen) * 0.3).bfloat16()
    hidden = torch.randn(3, 5, TARGET.hidden_size, generator=gen).bfloat16()
    previous = torch.tensor([0, 7, 299])
    with torch.inference_mode():
        want = eager.draft_tokens(hidden, head, previous)
        got = fast.native.greedy(hidden, head, previous)
        assert torch.equal(got, want) and torch.equal(fast.draft_tokens(hidden, head, previous), want)
        # with each drafted token's probability (the adaptive policy's input): the eager softmax's
        (tokens, probs), (e_tokens, e_probs) = (d.draft_candidates(hidden, head, 1, previous) for d in (fast, eager))
        assert torch.equal(tokens, e_tokens) and probs.dtype == e_probs.dtype == torch.float32
        torch.testing.assert_close(probs, e_probs, rtol=1e-5, atol=1e-6)
        assert 0.02 < float(probs.min()) < float(probs.max()) < 1.0
        # the correction matters here: without the Markov head other tokens come out
        assert not torch.equal(eager.to_target_ids(native.argmax(eager.draft_logits(hidden, head))), want)


def test_the_native_pass_is_off_where_it_does_not_apply(monkeypatch):
    ref, _, _ = drafters()
    assert unsupported(ref) == "bf16 weights on a CPU only"
    windowed = DFlashDrafter(
        DraftConfig.for_target(TARGET, num_layers=2, block_size=4, mask_token_id=1, sliding_window=8)
    ).bfloat16()
    assert unsupported(windowed) == "sliding-window layers"
    monkeypatch.setenv(native_step.ENV, "0")
    assert use_native_draft(ref.bfloat16()) == f"eager: {native_step.ENV}=0" and ref.native is None


def test_the_shipped_drafter_drafts_the_same_natively_and_eagerly(smol_dir, chat_ids):
    """On the default target in bf16, the shipped drafter's drafts at every round of 4 chat prompts
    agree between the native and the eager pass at >= 90 % of positions (both run from the same
    target features; they differ only by roundings), and what the target emits is `ar`'s."""
    from blockdraft import Engine

    engine = Engine.load(dtype=torch.bfloat16)
    drafter = engine.drafter
    assert drafter.native is not None and engine.precision()["draft"] == "native"
    native_pass = drafter.native
    seen = {"same": 0, "all": 0}
    original = DFlashDrafter.draft_tokens

    def both(self, hidden, head, previous=None):
        fused = original(self, hidden, head, previous)
        self.native = None
        try:  # the eager pass on the same context: the cache holds what the native writes made
            block = self._last_block
            eager_hidden = DFlashDrafter.forward(self, *block[:2], cache=block[2], rows=block[3])
            eager = original(self, eager_hidden[:, -hidden.shape[1] :], head, previous)
        finally:
            self.native = native_pass
        seen["same"] += int((fused == eager).sum())
        seen["all"] += fused.numel()
        return fused

    forward = DFlashDrafter.forward

    def remember(self, noise, positions, *args, cache=None, rows=slice(None), **kw):
        if cache is not None:
            self._last_block = (noise, positions, cache, rows)
        return forward(self, noise, positions, *args, cache=cache, rows=rows, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DFlashDrafter, "draft_tokens", both)
        mp.setattr(DFlashDrafter, "forward", remember)
        prompts = chat_ids[:4]
        got = [g.token_ids for g in engine.generate(prompts, method="dflash", max_new_tokens=32)]
    ar = [g.token_ids for g in engine.generate(prompts, method="ar", max_new_tokens=32)]
    assert got == ar
    assert seen["all"] > 60 and seen["same"] >= 0.9 * seen["all"], seen
