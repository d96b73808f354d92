"""Our target model code computes what HF transformers' own implementation computes."""

import pytest
import torch

from blockdraft.errors import BlockdraftError
from blockdraft.models import load_target

from .conftest import save_tiny_hf

ARCHS = {
    "llama": {},
    "llama-bias-rope3": {
        "attention_bias": True,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 8},
}


def _hf_logits_and_hidden(hf, ids):
    with torch.no_grad():
        out = hf(torch.tensor(ids)[None], output_hidden_states=True)
    return out.logits[0], out.hidden_states


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_hf_for_each_architecture(arch, tmp_path):
    model_type = arch.split("-")[0]
    hf = save_tiny_hf(model_type, tmp_path, **ARCHS[arch])
    ours = load_target(tmp_path)
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (20,)).tolist()
    ref, hidden = _hf_logits_and_hidden(hf, ids)
    cache = ours.new_cache(1, 64)
    with torch.no_grad():
        # prefill in two chunks through the cache, capturing two layers
        h1, f1 = ours(torch.tensor([ids[:13]]), torch.arange(13)[None], cache, capture=(0, 2))
        h2, f2 = ours(torch.tensor([ids[13:]]), torch.arange(13, 20)[None], cache, capture=(0, 2))
        # and without a cache, all at once (training and scoring)
        h3, f3 = ours(torch.tensor([ids]), torch.arange(20)[None], capture=(0, 2))
    torch.testing.assert_close(ours.logits(h3)[0], ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(f3[0, :, 64:], hidden[3][0], atol=1e-4, rtol=1e-4)
    logits = ours.logits(torch.cat([h1, h2], 1))[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    feats = torch.cat([f1, f2], 1)[0]
    torch.testing.assert_close(feats[:, :64], hidden[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(feats[:, 64:], hidden[3][0], atol=1e-4, rtol=1e-4)


def test_batch_rows_with_different_lengths_match_single_runs(tmp_path):
    hf = save_tiny_hf("qwen3", tmp_path)
    ours = load_target(tmp_path)
    torch.manual_seed(2)
    seqs = [torch.randint(0, 97, (n,)).tolist() for n in (5, 11, 8)]
    cache = ours.new_cache(3, 32)
    width = 11
    tokens = torch.zeros(3, width, dtype=torch.long)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = torch.tensor(s)
    with torch.no_grad():
        ours(tokens, torch.arange(width).expand(3, -1), cache)
        # then one more token per row, each at its own position
        nxt = torch.tensor([[3], [4], [5]])
        pos = torch.tensor([[len(s)] for s in seqs])
        h, _ = ours(nxt, pos, cache)
    for b, s in enumerate(seqs):
        ref, _ = _hf_logits_and_hidden(hf, s + [int(nxt[b])])
        torch.testing.assert_close(ours.logits(h[b, 0]), ref[-1], atol=1e-4, rtol=1e-4)


def test_rollback_is_free_stale_slots_are_never_seen(tmp_path):
    hf = save_tiny_hf("llama", tmp_path)
    ours = load_target(tmp_path)
    ids = list(range(10, 22))
    cache = ours.new_cache(1, 64)
    with torch.no_grad():
        ours(torch.tensor([ids[:8]]), torch.arange(8)[None], cache)
        # a rejected block writes junk at positions 8..13; the sequence stays at length 8
        ours(torch.tensor([[1, 2, 3, 4, 5, 6]]), torch.arange(8, 14)[None], cache)
        h, _ = ours(torch.tensor([ids[8:]]), torch.arange(8, 12)[None], cache)
    ref, _ = _hf_logits_and_hidden(hf, ids)
    torch.testing.assert_close(ours.logits(h[0]), ref[8:], atol=1e-4, rtol=1e-4)


def test_smollm2_logits_match_hf(smol, hf_smol, tokenizer):
    ids = tokenizer("The three primary colours are red, yellow and").input_ids
    ref, hidden = _hf_logits_and_hidden(hf_smol, ids)
    with torch.no_grad():
        h, f = smol(torch.tensor([ids]), torch.arange(len(ids))[None], smol.new_cache(1, 64), capture=(1, 14))
    torch.testing.assert_close(smol.logits(h)[0], ref, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(f[0, :, 576:], hidden[15][0], atol=2e-4, rtol=1e-4)


def test_unsupported_or_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(BlockdraftError, match="not found"):
        load_target(tmp_path / "nope")
    with pytest.raises(BlockdraftError, match="no config.json"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(BlockdraftError, match="unsupported architecture 'gpt2'"):
        load_target(tmp_path)


def test_cache_slots_apart_from_positions_with_an_explicit_mask(tmp_path):
    """The target interface a tree verify needs: tokens written into arbitrary cache slots,
    seen through an explicit mask, give the same logits as the default layout (slot =
    position); and two siblings at one position in different slots do not see each other."""
    save_tiny_hf("llama", tmp_path)
    ours = load_target(tmp_path)
    ids = list(range(10, 30))
    with torch.no_grad():
        ref, _ = ours(torch.tensor([ids]), torch.arange(20)[None], ours.new_cache(1, 64))
        cache = ours.new_cache(1, 64)
        ours(torch.tensor([ids[:12]]), torch.arange(12)[None], cache)  # slots 0..11 = positions 0..11
        # positions 12..19 go to slots 40..47 in reverse order; the mask says which slot holds what
        slots = torch.arange(47, 39, -1)[None]
        slot_pos = torch.full((64,), 10**6)
        slot_pos[:12] = torch.arange(12)
        slot_pos[slots[0]] = torch.arange(12, 20)
        pos = torch.arange(12, 20)[None]
        mask = slot_pos[None, None, None, :48] <= pos[:, None, :, None]
        h, _ = ours(torch.tensor([ids[12:]]), pos, cache, slots=slots, mask=mask)
        torch.testing.assert_close(ours.logits(h), ours.logits(ref[:, 12:]), atol=1e-5, rtol=1e-5)
        # siblings: two candidates for position 12 in slots 50 and 51, each seeing the context only
        sib = torch.tensor([[ids[12], 3]])
        sib_slots = torch.tensor([[50, 51]])
        sib_mask = torch.zeros(1, 1, 2, 52, dtype=torch.bool)
        sib_mask[..., :12] = True
        sib_mask[0, 0, 0, 50] = sib_mask[0, 0, 1, 51] = True
        hs, _ = ours(sib, torch.tensor([[12, 12]]), cache, slots=sib_slots, mask=sib_mask)
        torch.testing.assert_close(ours.logits(hs[:, :1]), ours.logits(ref[:, 12:13]), atol=1e-5, rtol=1e-5)


def test_in_place_row_permutation_equals_indexing():
    """permute_rows_ (the caches' reorder, in place by cycles) gives exactly t[:, order] for
    random permutations (fixed points, one long cycle, the identity) along any dimension."""
    from blockdraft.models.layers import permute_rows_

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 9):
        for order in (torch.randperm(n, generator=g), torch.arange(n), torch.roll(torch.arange(n), 1)):
            for dim in (0, 1, 2):
                shape = [3, 4, 2]
                shape[dim] = n
                t = torch.randn(*shape, generator=g)
                expect = t.index_select(dim, order)
                assert torch.equal(permute_rows_(t, order, dim), expect) and torch.equal(t, expect)


def test_bf16_weights_attend_in_fp32_on_cpu_and_stay_as_close_as_hf_bf16(tmp_path):
    """bf16 weights on CPU: the products run in bf16, attention and the KV cache in fp32
    (`attention_dtype`: a CPU's bf16 attention kernels are slower than its fp32 ones); the
    logits through the cache (a prefill, then one token at a time) and without it are as close
    to the fp32 reference as HF's own bf16 forward is, and the hidden state stays bf16."""
    import copy

    from blockdraft.models.layers import attention_dtype

    assert attention_dtype(torch.bfloat16, "cpu") == torch.float32
    assert attention_dtype(torch.bfloat16, "cuda") == torch.bfloat16
    assert attention_dtype(torch.float32, "cpu") == torch.float32
    hf = save_tiny_hf("llama", tmp_path)
    ours = load_target(tmp_path, dtype=torch.bfloat16)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    seq = torch.randint(1, 97, (1, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref, theirs = hf(seq).logits[0], hf16(seq).logits[0].float()
        cache = ours.new_cache(1, 64)
        assert cache.k.dtype == cache.v.dtype == torch.float32
        h, _ = ours(seq[:, :40], torch.arange(40)[None], cache)
        rows = [ours.logits(h[0]).float()]
        for p in range(40, 48):
            h, _ = ours(seq[:, p : p + 1], torch.tensor([[p]]), cache)
            rows.append(ours.logits(h[0]).float())
        no_cache, _ = ours(seq, torch.arange(48)[None], None)
    assert h.dtype == torch.bfloat16
    err, hf_err = (torch.cat(rows) - ref).abs().max(), (theirs - ref).abs().max()
    assert err <= 1.25 * hf_err, (float(err), float(hf_err))  # both mostly the weights' bf16 rounding
    assert ((ours.logits(no_cache[0]).float() - ref).abs().max()) <= 1.25 * hf_err


@pytest.mark.parametrize("heads,kv_heads,t", [(9, 3, 1), (9, 3, 6), (8, 1, 4), (4, 4, 3)])
def test_kv_grouped_attention_is_grouped_query_attention(heads, kv_heads, t):
    """The CUDA path folds each KV head's query heads into its query length: against an explicit
    reference (every KV head copied to its query heads, masked softmax), with no mask, a
    per-row mask and a mask shared by the rows; a per-head mask is refused."""
    from blockdraft.models.layers import attend_kv_grouped

    torch.manual_seed(heads * 10 + t)
    b, s, d = 3, 11, 8
    q, k, v = torch.randn(b, heads, t, d), torch.randn(b, kv_heads, s, d), torch.randn(b, kv_heads, s, d)
    kk, vv = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    for mask in (None, torch.rand(b, 1, t, s) > 0.4, torch.rand(1, 1, t, s) > 0.4):
        scores = q @ kk.transpose(-1, -2) / d**0.5
        if mask is not None:
            mask[..., 0] = True
            scores = scores.masked_fill(~mask, float("-inf"))
        want = torch.softmax(scores, dim=-1) @ vv
        assert torch.allclose(attend_kv_grouped(q, k, v, mask), want, atol=1e-5)
    if heads != kv_heads:
        with pytest.raises(BlockdraftError, match="per-head"):
            attend_kv_grouped(q, k, v, torch.ones(b, heads, t, s, dtype=torch.bool))
