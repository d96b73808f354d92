// A whole cached forward of a Llama-family target in bf16, in one call (built with native_linear.cpp by
// blockdraft/models/native.py; driven by `native.NativeStep`).
//
// Why: the eager forward of a small target is a few thousand operator calls a step, and on a CPU their
// dispatch, not the weights, sets the step's time. Here each layer is eight loops over plain buffers.
//
// Row-independent by construction, like the products: every token's arithmetic is a fixed sequence of
// operations over its own row (norms sum in one order, the products are `product_bf16`'s), and its
// attention visits the cache slots it may see in slot order and nothing else (a masked slot is skipped,
// not added as a zero). A token verified in a block, in a batch or as a tree node therefore gets bit for
// bit what it gets decoded alone, as long as it sees the same keys in the same order: a tree node's
// ancestors sit in increasing slots (a parent comes before its children), so it meets the committed
// context, its ancestors and itself in the order of its own sequence.
//
// Numbers: activations bf16 between operations (as the eager bf16 model), every operation computed in
// fp32 and rounded once; keys and values kept in fp32 in the cache (the engine's CPU cache dtype).
#include "native.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

using bf16 = at::BFloat16;

inline float f(bf16 v) { return static_cast<float>(v); }

const bf16* opt(const torch::Tensor& t) { return t.numel() ? t.data_ptr<bf16>() : nullptr; }

struct Layer {
    const bf16 *ln1, *qkv_w, *qkv_b, *q_norm, *k_norm, *o_w, *o_b, *ln2, *gu_w, *gu_b, *down_w, *down_b;
    int64_t inter;  // the MLP's hidden size
};
constexpr size_t PER_LAYER = 12;

using blockdraft::exp16;
using blockdraft::lanes;
using blockdraft::load16;
using blockdraft::store16;

}  // namespace

// a = bf16(a + b), n values
void blockdraft::add(bf16* a, const bf16* b, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(n - i);
        store16(a + i, _mm512_add_ps(load16(a + i, m), load16(b + i, m)), m);
    }
}

// y = bf16((w + offset) * x / rms(x)) per row; the sum of squares in one order (16 lanes, then across them)
void blockdraft::rms_norm_row(const bf16* x, const bf16* w, bf16* y, int64_t n, float eps, float offset) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = load16(x + i, lanes(n - i));
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps));
    const __m512 shift = _mm512_set1_ps(offset);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(n - i);
        const __m512 scale = _mm512_add_ps(load16(w + i, m), shift);
        store16(y + i, _mm512_mul_ps(scale, _mm512_mul_ps(load16(x + i, m), inv)), m);
    }
}


// q/k norm (Qwen3's; Qwen3.5's scales by 1 + weight: offset 1) and rotary embedding of the first `rot`
// values of one head of d in place (rot 0: all): x[i] * cos[i] + x[(i + rot/2) % rot] * sin[i] (the sin table
// carries the sign of the rotation), rounded once; 16 lanes at a time where rot = d and d/2 is a multiple of
// 16 and there is no offset, else one value at a time (a model always takes the same path)
void blockdraft::rotate(bf16* x, const bf16* norm, const float* cos, const float* sin, int64_t d, float eps,
                        float offset, int64_t rot) {
    if (rot == 0) rot = d;
    if (d % 32 == 0 && d <= 512 && rot == d && offset == 0.f) {
        const int64_t C = d / 16;
        __m512 v[32];
        __m512 ss = _mm512_setzero_ps();
        for (int64_t c = 0; c < C; ++c) {
            v[c] = load16(x + 16 * c);
            ss = _mm512_fmadd_ps(v[c], v[c], ss);
        }
        if (norm != nullptr) {
            const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(d) + eps));
            for (int64_t c = 0; c < C; ++c) {  // bf16(norm * bf16(x * inv)), as the eager RMSNorm rounds
                const __m512 scaled = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_ps(v[c], inv)));
                v[c] = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_ps(load16(norm + 16 * c), scaled)));
            }
        }
        for (int64_t c = 0; c < C; ++c) {
            const __m512 r = _mm512_mul_ps(v[(c + C / 2) % C], _mm512_loadu_ps(sin + 16 * c));
            store16(x + 16 * c, _mm512_fmadd_ps(v[c], _mm512_loadu_ps(cos + 16 * c), r));
        }
        return;
    }
    TORCH_CHECK(d <= 512 && rot <= d && rot % 2 == 0, "head size");
    float v[512];
    for (int64_t i = 0; i < d; ++i) v[i] = f(x[i]);
    if (norm != nullptr) {
        float ss = 0.f;
        for (int64_t i = 0; i < d; ++i) ss += v[i] * v[i];
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
        for (int64_t i = 0; i < d; ++i)  // as the eager norms round: twice (Qwen3's), once (1 + weight)
            v[i] = offset == 0.f ? f(bf16(f(norm[i]) * f(bf16(v[i] * inv)))) : f(bf16((f(norm[i]) + offset) * (v[i] * inv)));
    }
    const int64_t h = rot / 2;
    for (int64_t i = 0; i < rot; ++i) x[i] = bf16(v[i] * cos[i] + v[(i + h) % rot] * sin[i]);
    for (int64_t i = rot; i < d; ++i) x[i] = bf16(v[i]);
}

namespace {

using blockdraft::rotate;


// e^(x[i] - shift) in place for n values, in lanes of 16 (the last partial one masked)
void exp_shifted(float* x, int64_t n, float shift) {
    const __m512 s = _mm512_set1_ps(shift);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(n - i);
        _mm512_mask_storeu_ps(x + i, m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), s)));
    }
}

}  // namespace

float blockdraft::exp_sum(const bf16* x, int64_t n, float top) {
    __m512 acc = _mm512_setzero_ps();
    const __m512 s = _mm512_set1_ps(top);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(n - i);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(load16(x + i, m), s))));
    }
    return _mm512_reduce_add_ps(acc);
}

// a[j] = bf16(silu(g[j]) * u[j]) for n values, 16 lanes at a time (the last partial one masked)
void blockdraft::silu_mul(const bf16* g, const bf16* u, bf16* a, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(n - i);
        const __m512 z = load16(g + i, m), up = load16(u + i, m);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), z));
        store16(a + i, _mm512_mul_ps(_mm512_div_ps(z, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), up), m);
    }
}

namespace {

// Attention of G query heads q [G, D] (fp32) that share one KV head, over the n cache slots `vis` (in that
// order) of k/v [slots, D]: out [G, D] (bf16). Per head: scores (a dot product in one order), softmax
// (max, e^(s - max), their sum in order), the probability-weighted sum of values in order. C = D / 16.
template <int C>
void attend_heads(const float* q, const float* k, const float* v, const int32_t* vis, int64_t n, int64_t G,
                  float scale, float* score, bf16* out) {
    constexpr int64_t D = 16 * C;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {  // up to four heads at a time: each key and value read once for them
        const int64_t heads = std::min<int64_t>(4, G - g0);
        __m512 qv[4][C];
        for (int64_t g = 0; g < heads; ++g)
            for (int c = 0; c < C; ++c) qv[g][c] = _mm512_loadu_ps(q + (g0 + g) * D + 16 * c);
        float top[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
        for (int64_t j = 0; j < n; ++j) {
            const float* kj = k + static_cast<int64_t>(vis[j]) * D;
            __m512 kv[C];
            for (int c = 0; c < C; ++c) kv[c] = _mm512_loadu_ps(kj + 16 * c);
            for (int64_t g = 0; g < heads; ++g) {
                __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
                for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
                const float s = _mm512_reduce_add_ps(acc) * scale;
                score[g * n + j] = s;
                top[g] = std::max(top[g], s);
            }
        }
        float inv[4];
        for (int64_t g = 0; g < heads; ++g) {
            exp_shifted(score + g * n, n, top[g]);
            float sum = 0.f;
            for (int64_t j = 0; j < n; ++j) sum += score[g * n + j];
            inv[g] = n ? 1.0f / sum : 0.f;
        }
        __m512 acc[4][C];
        for (int64_t g = 0; g < heads; ++g)
            for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j) {
            const float* vj = v + static_cast<int64_t>(vis[j]) * D;
            __m512 vv[C];
            for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(vj + 16 * c);
            for (int64_t g = 0; g < heads; ++g) {
                const __m512 p = _mm512_set1_ps(score[g * n + j]);
                for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
            }
        }
        for (int64_t g = 0; g < heads; ++g)
            for (int c = 0; c < C; ++c)
                store16(out + (g0 + g) * D + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
    }
}

void attend(const float* q, const float* k, const float* v, const int32_t* vis, int64_t n, int64_t G, int64_t D,
            float scale, float* score, bf16* out) {
    switch (D / 16) {
        case 4: attend_heads<4>(q, k, v, vis, n, G, scale, score, out); break;
        case 8: attend_heads<8>(q, k, v, vis, n, G, scale, score, out); break;
        case 2: attend_heads<2>(q, k, v, vis, n, G, scale, score, out); break;
        case 1: attend_heads<1>(q, k, v, vis, n, G, scale, score, out); break;
        case 16: attend_heads<16>(q, k, v, vis, n, G, scale, score, out); break;
        default: TORCH_CHECK(false, "head_dim ", D, ": the native step runs 16, 32, 64, 128 and 256");
    }
}

}  // namespace


blockdraft::Visible blockdraft::visible_slots(torch::Tensor visible, const int64_t* pos, int64_t B, int64_t T,
                                              int64_t S, int64_t window) {
    const int64_t R = B * T;
    Visible out;
    out.start.assign(R + 1, 0);
    if (visible.numel()) {
        visible = visible.contiguous();
        TORCH_CHECK(visible.scalar_type() == at::kBool && visible.size(0) == B && visible.size(1) == T, "visible");
        const int64_t V = std::min<int64_t>(visible.size(2), S);
        const bool* vis = visible.data_ptr<bool>();
        for (int64_t i = 0; i < R; ++i) {
            for (int64_t s = 0; s < V; ++s)
                if (vis[i * visible.size(2) + s]) out.seen.push_back(static_cast<int32_t>(s));
            out.start[i + 1] = static_cast<int64_t>(out.seen.size());
        }
    } else {
        for (int64_t i = 0; i < R; ++i) {
            const int64_t first = window > 0 ? std::max<int64_t>(0, pos[i] - window + 1) : 0;
            for (int64_t s = first; s <= pos[i]; ++s) out.seen.push_back(static_cast<int32_t>(s));
            out.start[i + 1] = static_cast<int64_t>(out.seen.size());
        }
    }
    for (int64_t i = 0; i < R; ++i) out.most = std::max(out.most, out.start[i + 1] - out.start[i]);
    return out;
}

void blockdraft::attention(const bf16* q, int64_t q_row, int64_t q_step, const float* kl, const float* vl,
                           const Visible& vis, int64_t row0, int64_t T, int64_t R, int64_t heads, int64_t kv_heads,
                           int64_t S, int64_t D, bf16* out) {
    const int64_t G = heads / kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    // one task per (token, KV head), its G query heads together over the visible slots
    at::parallel_for(0, R * kv_heads, 1, [&](int64_t t0, int64_t t1) {
        std::vector<float> score(std::max<int64_t>(vis.most, 1) * G), qf(G * D);
        for (int64_t task = t0; task < t1; ++task) {
            const int64_t i = task / kv_heads, h = task % kv_heads, b = i / T;
            const int64_t cache_row = ((row0 + b) * kv_heads + h) * S * D;
            for (int64_t g = 0; g < G; ++g)
                for (int64_t j = 0; j < D; ++j) qf[g * D + j] = f(q[i * q_row + (h * G + g) * q_step + j]);
            attend(qf.data(), kl + cache_row, vl + cache_row, vis.seen.data() + vis.start[i],
                   vis.start[i + 1] - vis.start[i], G, D, scale, score.data(), out + i * heads * D + h * G * D);
        }
    });
}

void blockdraft::mlp(bf16* hidden, const bf16* norm, float offset, const bf16* gu_w, const bf16* gu_b,
                     const bf16* down_w, const bf16* down_b, int64_t R, int64_t H, int64_t I, float eps, Scratch s) {
    for (int64_t r = 0; r < R; ++r) rms_norm_row(hidden + r * H, norm, s.normed + r * H, H, eps, offset);
    product_packed(s.normed, gu_w, gu_b, s.gu, R, H, 2 * I);
    for (int64_t i = 0; i < R; ++i) silu_mul(s.gu + i * 2 * I, s.gu + i * 2 * I + I, s.act + i * I, I);
    product_packed(s.act, down_w, down_b, s.tmp, R, I, H);
    add(hidden, s.tmp, R * H);
}

void blockdraft::keep_features(const bf16* hidden, torch::Tensor& features, const std::vector<int64_t>& capture,
                               int64_t layer, int64_t R, int64_t H) {
    for (size_t c = 0; c < capture.size(); ++c) {
        if (capture[c] != layer) continue;
        bf16* fp = features.data_ptr<bf16>();
        const int64_t width = features.size(2);
        for (int64_t i = 0; i < R; ++i) std::copy(hidden + i * H, hidden + (i + 1) * H, fp + i * width + c * H);
    }
}

torch::Tensor blockdraft::final_norm(const bf16* hidden, const torch::Tensor& norm, int64_t B, int64_t T, int64_t H,
                                     float eps, float offset) {
    auto out = torch::empty({B, T, H}, torch::TensorOptions().dtype(at::kBFloat16));
    for (int64_t r = 0; r < B * T; ++r)
        rms_norm_row(hidden + r * H, norm.data_ptr<bf16>(), out.data_ptr<bf16>() + r * H, H, eps, offset);
    return out;
}

std::vector<torch::Tensor> llama_forward(
    torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor visible, int64_t window,
    torch::Tensor k_cache, torch::Tensor v_cache, int64_t row0, torch::Tensor cos, torch::Tensor sin,
    std::vector<torch::Tensor> weights, torch::Tensor final_norm, std::vector<int64_t> capture, int64_t last,
    bool final_hidden, double eps_, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.is_contiguous(), "x: [B, T, H] bf16");
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.dim() == 5 &&
                    k_cache.is_contiguous() && v_cache.is_contiguous(), "caches: [L, B, KV, S, D] fp32");
    TORCH_CHECK(head_dim % 16 == 0 && head_dim <= 512 && heads % kv_heads == 0, "head shape");
    TORCH_CHECK(weights.size() % PER_LAYER == 0 && last < static_cast<int64_t>(weights.size() / PER_LAYER), "weights");
    const int64_t B = x.size(0), T = x.size(1), H = x.size(2), R = B * T, D = head_dim;
    const int64_t S = k_cache.size(3), Bc = k_cache.size(1);
    TORCH_CHECK(k_cache.size(2) == kv_heads && k_cache.size(4) == D && row0 + B <= Bc, "cache shape");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.size(1) == D, "rotary tables: [P, D] fp32");
    const float eps = static_cast<float>(eps_);
    positions = positions.contiguous();
    slots = slots.contiguous();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < R; ++i)
        TORCH_CHECK(slot[i] >= 0 && slot[i] < S && pos[i] >= 0 && pos[i] < cos.size(0), "slot or position out of range");
    // each token's visible slots, in slot order: from `visible` [B, T, >= used], or (empty) every slot up to
    // its own position within the window (slot = position)
    const blockdraft::Visible vis = blockdraft::visible_slots(visible, pos, B, T, S, window);

    const size_t L = weights.size() / PER_LAYER;
    std::vector<Layer> layers(L);
    for (size_t l = 0; l < L; ++l) {
        const torch::Tensor* w = &weights[l * PER_LAYER];
        for (size_t j = 0; j < PER_LAYER; ++j)
            TORCH_CHECK(!w[j].numel() || (w[j].scalar_type() == at::kBFloat16 && w[j].is_contiguous()), "bf16 weights");
        layers[l] = {opt(w[0]), opt(w[1]), opt(w[2]), opt(w[3]), opt(w[4]), opt(w[5]), opt(w[6]), opt(w[7]),
                     opt(w[8]), opt(w[9]), opt(w[10]), opt(w[11]), intermediate};
    }
    const int64_t NQ = heads * D, NQKV = (heads + 2 * kv_heads) * D;
    int64_t inter = 0;
    for (const auto& l : layers) inter = std::max(inter, l.inter);

    auto opts = x.options();
    auto hidden = x.clone();
    auto normed = torch::empty({R, H}, opts), tmp = torch::empty({R, H}, opts);
    auto qkv = torch::empty({R, NQKV}, opts), attn = torch::empty({R, NQ}, opts);
    auto gu = torch::empty({R, 2 * inter}, opts), act = torch::empty({R, inter}, opts);
    torch::Tensor features;
    if (!capture.empty()) features = torch::empty({B, T, static_cast<int64_t>(capture.size()) * H}, opts);
    bf16 *hp = hidden.data_ptr<bf16>(), *np = normed.data_ptr<bf16>(), *tp = tmp.data_ptr<bf16>();
    bf16 *qp = qkv.data_ptr<bf16>(), *ap = attn.data_ptr<bf16>();
    const blockdraft::Scratch scratch{np, gu.data_ptr<bf16>(), act.data_ptr<bf16>(), tp};
    float* kc = k_cache.data_ptr<float>();
    float* vc = v_cache.data_ptr<float>();
    const float* cosp = cos.data_ptr<float>();
    const float* sinp = sin.data_ptr<float>();
    const int64_t layer_stride = Bc * kv_heads * S * D;

    for (int64_t l = 0; l <= last; ++l) {
        const Layer& w = layers[l];
        float* kl = kc + l * layer_stride;
        float* vl = vc + l * layer_stride;
        for (int64_t r = 0; r < R; ++r) blockdraft::rms_norm_row(hp + r * H, w.ln1, np + r * H, H, eps);
        blockdraft::product_packed(np, w.qkv_w, w.qkv_b, qp, R, H, NQKV);
        // rotary (and q/k norms), then this call's keys and values into their cache slots
        for (int64_t i = 0; i < R; ++i) {
            const int64_t b = i / T;
            bf16* row = qp + i * NQKV;
            const float* c = cosp + pos[i] * D;
            const float* s = sinp + pos[i] * D;
            for (int64_t h = 0; h < heads; ++h) rotate(row + h * D, w.q_norm, c, s, D, eps);
            for (int64_t h = 0; h < kv_heads; ++h) {
                bf16* k = row + (heads + h) * D;
                const bf16* v = row + (heads + kv_heads + h) * D;
                rotate(k, w.k_norm, c, s, D, eps);
                float* kd = kl + (((row0 + b) * kv_heads + h) * S + slot[i]) * D;
                float* vd = vl + (((row0 + b) * kv_heads + h) * S + slot[i]) * D;
                for (int64_t j = 0; j < D; ++j) kd[j] = f(k[j]), vd[j] = f(v[j]);
            }
        }
        blockdraft::attention(qp, NQKV, D, kl, vl, vis, row0, T, R, heads, kv_heads, S, D, ap);
        blockdraft::product_packed(ap, w.o_w, w.o_b, tp, R, NQ, H);
        blockdraft::add(hp, tp, R * H);
        blockdraft::mlp(hp, w.ln2, 0.f, w.gu_w, w.gu_b, w.down_w, w.down_b, R, H, w.inter, eps, scratch);
        blockdraft::keep_features(hp, features, capture, l, R, H);
    }
    return {final_hidden ? blockdraft::final_norm(hp, final_norm, B, T, H, eps, 0.f) : torch::Tensor(), features};
}
