// A DFlash drafter's decode-time work around its block pass, in bf16 (built with native_linear.cpp and
// native_step.cpp by blockdraft/models/native.py; driven by `blockdraft.draft_native.NativeDraft`).
//
// The block pass itself is `llama_forward`: a drafter layer is a Qwen3 decoder layer whose block attends
// to the cached context and to the whole block. What is left is done here:
// - `dflash_context`: the KV injection. New context features [B, C, k*H] (the target's captured layers)
//   are fused (fc, then the hidden norm) and projected by every layer's k/v weights (k norm, rotary at
//   the token's position) into the drafter's cache slots;
// - `markov_greedy`: a DSpark drafter's greedy chain. The block's logits over the draft vocabulary, then
//   position by position the Markov head's correction for the token drafted before it and the argmax.
//
// A drafter only proposes (every token it drafts is verified by the target), so nothing here needs to be
// row-independent; the arithmetic is the eager bf16 drafter's, each operation rounded once to bf16.
#include "native.h"

#include <vector>

namespace {

using bf16 = at::BFloat16;

const bf16* opt(const torch::Tensor& t) { return t.numel() ? t.data_ptr<bf16>() : nullptr; }

void check_bf16(const torch::Tensor& t, const char* what) {
    TORCH_CHECK(!t.numel() || (t.scalar_type() == at::kBFloat16 && t.is_contiguous()), what, ": contiguous bf16");
}

}  // namespace

void dflash_context(torch::Tensor features, torch::Tensor positions, torch::Tensor slots, torch::Tensor k_cache,
                    torch::Tensor v_cache, int64_t row0, torch::Tensor cos, torch::Tensor sin, torch::Tensor fc,
                    torch::Tensor hidden_norm, std::vector<torch::Tensor> kv, double eps_, int64_t hidden) {
    features = features.contiguous();
    positions = positions.contiguous();
    slots = slots.contiguous();
    check_bf16(features, "features");
    check_bf16(fc, "fc");
    check_bf16(hidden_norm, "hidden norm");
    TORCH_CHECK(features.dim() == 3 && positions.dim() == 2 && positions.size(0) == features.size(0) &&
                    positions.size(1) == features.size(1) && slots.sizes().equals(positions.sizes()),
                "features [B, C, F], positions and slots [B, C]");
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.dim() == 5 &&
                    k_cache.is_contiguous() && v_cache.is_contiguous(), "caches: [L, B, KV, S, D] fp32");
    TORCH_CHECK(kv.size() % 3 == 0 && static_cast<int64_t>(kv.size() / 3) <= k_cache.size(0), "kv weights");
    const int64_t B = features.size(0), C = features.size(1), F = features.size(2), R = B * C, H = hidden;
    const int64_t Bc = k_cache.size(1), KV = k_cache.size(2), S = k_cache.size(3), D = k_cache.size(4);
    TORCH_CHECK(row0 + B <= Bc && cos.scalar_type() == at::kFloat && cos.size(1) == D && hidden_norm.numel() == H,
                "cache rows, rotary tables or hidden size");
    const float eps = static_cast<float>(eps_);
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < R; ++i)
        TORCH_CHECK(slot[i] >= 0 && slot[i] < S && pos[i] >= 0 && pos[i] < cos.size(0), "slot or position out of range");

    auto opts = features.options();
    auto raw = torch::empty({R, H}, opts), fused = torch::empty({R, H}, opts), kvrow = torch::empty({R, 2 * KV * D}, opts);
    bf16 *rp = raw.data_ptr<bf16>(), *fp = fused.data_ptr<bf16>(), *kp = kvrow.data_ptr<bf16>();
    blockdraft::product_packed(features.data_ptr<bf16>(), fc.data_ptr<bf16>(), nullptr, rp, R, F, H);
    for (int64_t i = 0; i < R; ++i) blockdraft::rms_norm_row(rp + i * H, hidden_norm.data_ptr<bf16>(), fp + i * H, H, eps);
    const int64_t layer_stride = Bc * KV * S * D;
    for (size_t l = 0; l < kv.size() / 3; ++l) {
        check_bf16(kv[3 * l], "kv weight");
        check_bf16(kv[3 * l + 1], "kv bias");
        check_bf16(kv[3 * l + 2], "k norm");
        blockdraft::product_packed(fp, kv[3 * l].data_ptr<bf16>(), opt(kv[3 * l + 1]), kp, R, H, 2 * KV * D);
        float* kl = k_cache.data_ptr<float>() + l * layer_stride;
        float* vl = v_cache.data_ptr<float>() + l * layer_stride;
        for (int64_t i = 0; i < R; ++i) {
            const int64_t b = i / C;
            for (int64_t h = 0; h < KV; ++h) {
                bf16* k = kp + i * 2 * KV * D + h * D;
                const bf16* v = kp + i * 2 * KV * D + (KV + h) * D;
                blockdraft::rotate(k, opt(kv[3 * l + 2]), cos.data_ptr<float>() + pos[i] * D,
                                   sin.data_ptr<float>() + pos[i] * D, D, eps);
                const int64_t at = (((row0 + b) * KV + h) * S + slot[i]) * D;
                for (int64_t j = 0; j < D; ++j) kl[at + j] = static_cast<float>(k[j]), vl[at + j] = static_cast<float>(v[j]);
            }
        }
    }
}

// Greedy tokens [B, n] (target ids; -1 where a logit was NaN) of a block's final hidden states [B, n, H]:
// base logits = hidden @ head (packed rows of the target's LM head, `vocab_rows` of them: the draft
// vocabulary's or all), then for k = 0..n-1 logits_k = bf16(base_k + w2 @ w1[previous]) and its first
// maximum, which becomes the previous token of position k + 1 (`previous` [B]: the token before the block).
// With `probs`, also each drafted token's softmax probability [B, n] (fp32; else an empty tensor).
std::vector<torch::Tensor> markov_greedy(torch::Tensor hidden, torch::Tensor head, int64_t V, torch::Tensor w1,
                                         torch::Tensor w2, torch::Tensor vocab, torch::Tensor previous, bool probs) {
    hidden = hidden.contiguous();
    previous = previous.contiguous();
    check_bf16(hidden, "hidden");
    check_bf16(head, "head");
    check_bf16(w1, "markov w1");
    check_bf16(w2, "markov w2");
    TORCH_CHECK(hidden.dim() == 3 && w1.dim() == 2 && previous.numel() == hidden.size(0), "hidden [B, n, H], previous [B]");
    TORCH_CHECK(!vocab.numel() || (vocab.scalar_type() == at::kLong && vocab.numel() == V && vocab.is_contiguous()), "vocab");
    const int64_t B = hidden.size(0), n = hidden.size(1), H = hidden.size(2), r = w1.size(1), T = w1.size(0);
    auto opts = hidden.options();
    auto base = torch::empty({B * n, V}, opts), x = torch::empty({B, r}, opts), corr = torch::empty({B, V}, opts);
    auto out = torch::empty({B, n}, opts.dtype(at::kLong));
    auto prob = torch::empty({probs ? B : 0, n}, opts.dtype(at::kFloat));
    bf16 *bp = base.data_ptr<bf16>(), *xp = x.data_ptr<bf16>(), *cp = corr.data_ptr<bf16>();
    const bf16* w1p = w1.data_ptr<bf16>();
    const int64_t* ids = vocab.numel() ? vocab.data_ptr<int64_t>() : nullptr;
    int64_t* o = out.data_ptr<int64_t>();
    blockdraft::product_packed(hidden.data_ptr<bf16>(), head.data_ptr<bf16>(), nullptr, bp, B * n, H, V);
    std::vector<int64_t> prev(previous.data_ptr<int64_t>(), previous.data_ptr<int64_t>() + B);
    for (int64_t k = 0; k < n; ++k) {
        for (int64_t b = 0; b < B; ++b) {
            TORCH_CHECK(prev[b] >= 0 && prev[b] < T, "previous token outside the vocabulary");
            std::copy(w1p + prev[b] * r, w1p + (prev[b] + 1) * r, xp + b * r);
        }
        blockdraft::product_packed(xp, w2.data_ptr<bf16>(), nullptr, cp, B, r, V);
        for (int64_t b = 0; b < B; ++b) {
            const bf16* logits = bp + (b * n + k) * V;
            bf16* row = cp + b * V;
            for (int64_t j = 0; j < V; ++j) row[j] = bf16(static_cast<float>(logits[j]) + static_cast<float>(row[j]));
            const int64_t best = blockdraft::first_max(row, V);
            o[b * n + k] = best < 0 ? -1 : (ids ? ids[best] : best);
            prev[b] = best < 0 ? 0 : o[b * n + k];
            if (probs && best >= 0) {
                const float top = static_cast<float>(row[best]);
                prob.data_ptr<float>()[b * n + k] = 1.0f / blockdraft::exp_sum(row, V, top);
            }
        }
    }
    return {out, prob};
}
