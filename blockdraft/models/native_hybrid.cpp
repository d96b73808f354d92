// A whole cached forward of a Qwen3.5 target (linear attention + gated full attention) in bf16, in one call
// (built with the other kernels by blockdraft/models/native.py; driven by `native_step.NativeHybridStep`).
//
// The layers are `models/qwen3_5.py`'s, the same arithmetic in fewer roundings: every operation computed in
// fp32 and rounded once to bf16 where the eager bf16 forward keeps a bf16 activation.
//
// Row-independent by construction, as `llama_forward`: a token's arithmetic is a fixed sequence over its own
// row, the attention layers visit the slots it sees in slot order, and a linear-attention layer runs its
// recurrence token by token, each token's state from the one before it in its own row. A token verified in a
// block therefore gets bit for bit what it gets decoded alone. A prefill (every row from position 0) runs the
// same token-by-token recurrence and keeps only the final state; any other forward keeps the state after
// each token, for `HybridCache.commit` to pick at the accepted length.
#include "native.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

using bf16 = at::BFloat16;
using blockdraft::lanes;
using blockdraft::load16;
using blockdraft::store16;

inline float f(bf16 v) { return static_cast<float>(v); }

const bf16* opt(const torch::Tensor& t) { return t.numel() ? t.data_ptr<bf16>() : nullptr; }

// a layer's tensors in the order `NativeHybridStep.weights` gives them (empty: absent)
struct Layer {
    const bf16 *ln1, *mix_w, *mix_b, *a, *b, *c, *d, *out_w, *out_b, *ln2, *gu_w, *down_w;
    // full attention: mix = packed qkv (query and gate per head, then keys, values), a / b = q / k norms
    // linear attention: mix = packed in_proj (conv input q k v, z, b, a), a = conv weight [K, C] (taps first),
    //                   b = dt_bias [Hv], c = A_log [Hv], d = the output norm [dv]
};
constexpr size_t PER_LAYER = 12;

int64_t L_linear(const std::vector<int64_t>& linear) {
    int64_t n = 0;
    for (auto l : linear) n += l != 0;
    return n;
}

float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// sum of squares of n fp32 values in one order (16 lanes, then across them)
float squares(const float* x, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(lanes(n - i), x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

struct Linear {  // a linear-attention layer's sizes
    int64_t kh, vh, dk, dv, K, C, Z;  // key heads, value heads, their sizes, conv taps, conv channels, z width
};

// One token of the gated delta rule for one value head, S [dk, dv] fp32 in place: S <- e^g S;
// delta = beta (v - S^T k); S <- S + k delta^T; and, given q, o = S^T q. The state's arithmetic does not
// depend on q: a replay without it (`delta_rule_replay`) gives the forward's states bit for bit.
void delta_step(float* S, const float* k, const float* v, float g, float beta, int64_t dk, int64_t dv,
                const float* q, float* o) {
    const int64_t C = (dv + 15) / 16;
    const __m512 decay = _mm512_set1_ps(std::exp(g));
    __m512 acc[32], out[32];
    for (int64_t c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps(), out[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < dk; ++i) {  // S <- e^g S and S^T k, row by row in order
        float* row = S + i * dv;
        const __m512 ki = _mm512_set1_ps(k[i]);
        for (int64_t c = 0; c < C; ++c) {
            const __mmask16 m = lanes(dv - 16 * c);
            const __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + 16 * c), decay);
            _mm512_mask_storeu_ps(row + 16 * c, m, s);
            acc[c] = _mm512_fmadd_ps(ki, s, acc[c]);
        }
    }
    const __m512 b = _mm512_set1_ps(beta);
    for (int64_t c = 0; c < C; ++c)  // delta, in place of S^T k
        acc[c] = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes(dv - 16 * c), v + 16 * c), acc[c]), b);
    for (int64_t i = 0; i < dk; ++i) {  // S <- S + k delta^T (and S^T q), row by row in order
        float* row = S + i * dv;
        const __m512 ki = _mm512_set1_ps(k[i]);
        for (int64_t c = 0; c < C; ++c) {
            const __mmask16 m = lanes(dv - 16 * c);
            const __m512 s = _mm512_fmadd_ps(ki, acc[c], _mm512_maskz_loadu_ps(m, row + 16 * c));
            _mm512_mask_storeu_ps(row + 16 * c, m, s);
            if (q) out[c] = _mm512_fmadd_ps(_mm512_set1_ps(q[i]), s, out[c]);
        }
    }
    if (q)
        for (int64_t c = 0; c < C; ++c) _mm512_mask_storeu_ps(o + 16 * c, lanes(dv - 16 * c), out[c]);
}

// One linear-attention layer over R = B x T tokens: in place of the mixer's output, tmp [R, H] = out_proj(...)
// of normed [R, H]. conv / state: the layer's committed states [Bc, K-1, C] / [Bc, Hv, dk, dv] (row row0 + b;
// zeros for rows that start at position 0). What `HybridCache.pending` keeps: the conv inputs [B, K-1+T, C],
// and either (a prefill) the final states [B, Hv, dk, dv] or (trace) each token's k, v, g and beta
// [B, T, Kd + Vd + 2 Hv], from which `delta_rule_replay` makes the state after any of them.
void linear_attention(const Layer& w, const Linear& s, const bf16* normed, bf16* tmp, int64_t B, int64_t T,
                      int64_t H, const int64_t* pos, int64_t row0, const bf16* conv, const float* state,
                      bf16* inputs, float* final_states, float* trace, bf16* proj, float eps) {
    const int64_t R = B * T, P = s.C + s.Z + 2 * s.vh, K1 = s.K - 1, Kd = s.kh * s.dk;
    blockdraft::product_packed(normed, w.mix_w, nullptr, proj, R, H, P);
    // conv inputs: the committed K-1 (zeros at position 0), then this call's
    for (int64_t b = 0; b < B; ++b) {
        bf16* in = inputs + b * (K1 + T) * s.C;
        if (pos[b * T] == 0) std::fill(in, in + K1 * s.C, bf16(0.f));
        else std::copy(conv + (row0 + b) * K1 * s.C, conv + (row0 + b + 1) * K1 * s.C, in);
        for (int64_t t = 0; t < T; ++t) std::copy(proj + (b * T + t) * P, proj + (b * T + t) * P + s.C, in + (K1 + t) * s.C);
    }
    // per token: silu(the causal convolution, tap by tap in order), rounded to bf16 as the eager activation;
    // q and k l2-normed (q scaled by dk^-1/2); beta = sigmoid(b); g = -e^A_log softplus(a + dt_bias)
    std::vector<float> qkv(R * s.C), g(R * s.vh), beta(R * s.vh);
    at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0; i < r1; ++i) {
            const int64_t b = i / T, t = i % T;
            const bf16* in = inputs + (b * (K1 + T) + t) * s.C;
            float* y = qkv.data() + i * s.C;
            for (int64_t c = 0; c < s.C; c += 16) {
                const __mmask16 m = lanes(s.C - c);
                __m512 acc = _mm512_mul_ps(load16(in + c, m), load16(w.a + c, m));
                for (int64_t j = 1; j < s.K; ++j)
                    acc = _mm512_fmadd_ps(load16(in + j * s.C + c, m), load16(w.a + j * s.C + c, m), acc);
                const __m512 e = blockdraft::exp16(_mm512_sub_ps(_mm512_setzero_ps(), acc));
                const __m512 act = _mm512_div_ps(acc, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
                _mm512_mask_storeu_ps(y + c, m, _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(act)));
            }
            for (int64_t h = 0; h < 2 * s.kh; ++h) {  // q heads, then k heads
                float* x = y + h * s.dk;
                const float inv = 1.0f / std::sqrt(squares(x, s.dk) + 1e-6f);
                const float scale = h < s.kh ? inv / std::sqrt(static_cast<float>(s.dk)) : inv;
                for (int64_t j = 0; j < s.dk; ++j) x[j] *= scale;
            }
            const bf16* extra = proj + i * P + s.C + s.Z;
            for (int64_t h = 0; h < s.vh; ++h) {
                beta[i * s.vh + h] = 1.0f / (1.0f + std::exp(-f(extra[h])));
                g[i * s.vh + h] = -std::exp(f(w.c[h])) * softplus(f(extra[s.vh + h]) + f(w.b[h]));
            }
            if (trace) {
                float* tr = trace + i * (s.C - Kd + 2 * s.vh);
                std::copy(y + Kd, y + s.C, tr);
                std::copy(g.data() + i * s.vh, g.data() + (i + 1) * s.vh, tr + s.C - Kd);
                std::copy(beta.data() + i * s.vh, beta.data() + (i + 1) * s.vh, tr + s.C - Kd + s.vh);
            }
        }
    });
    // the recurrence: one task per (batch row, value head), its tokens in order
    const int64_t group = s.vh / s.kh, hs = s.dk * s.dv;
    std::vector<float> o(R * s.vh * s.dv);
    at::parallel_for(0, B * s.vh, 1, [&](int64_t t0, int64_t t1) {
        std::vector<float> S(hs);
        for (int64_t task = t0; task < t1; ++task) {
            const int64_t b = task / s.vh, h = task % s.vh, kh = h / group;
            if (pos[b * T] == 0) std::fill(S.begin(), S.end(), 0.f);
            else std::copy(state + ((row0 + b) * s.vh + h) * hs, state + ((row0 + b) * s.vh + h + 1) * hs, S.begin());
            for (int64_t t = 0; t < T; ++t) {
                const int64_t i = b * T + t;
                const float* y = qkv.data() + i * s.C;
                delta_step(S.data(), y + Kd + kh * s.dk, y + 2 * Kd + h * s.dv, g[i * s.vh + h], beta[i * s.vh + h],
                           s.dk, s.dv, y + kh * s.dk, o.data() + (i * s.vh + h) * s.dv);
            }
            if (final_states) std::copy(S.begin(), S.end(), final_states + (b * s.vh + h) * hs);
        }
    });
    // per head: bf16(o), its norm, times silu(z); then out_proj
    std::vector<bf16> gated(R * s.vh * s.dv);
    for (int64_t i = 0; i < R; ++i)
        for (int64_t h = 0; h < s.vh; ++h) {
            const int64_t at = (i * s.vh + h) * s.dv;
            float* x = o.data() + at;
            for (int64_t j = 0; j < s.dv; ++j) x[j] = f(bf16(x[j]));
            const float inv = 1.0f / std::sqrt(squares(x, s.dv) / static_cast<float>(s.dv) + eps);
            const bf16* z = proj + i * P + s.C + h * s.dv;
            for (int64_t j = 0; j < s.dv; ++j) {
                const float zj = f(z[j]);
                gated[at + j] = bf16(f(w.d[j]) * (x[j] * inv) * (zj / (1.0f + std::exp(-zj))));
            }
        }
    blockdraft::product_packed(gated.data(), w.out_w, nullptr, tmp, R, s.vh * s.dv, H);
}

}  // namespace

std::vector<torch::Tensor> qwen3_5_forward(
    torch::Tensor x, torch::Tensor positions, torch::Tensor visible, torch::Tensor k_cache, torch::Tensor v_cache, int64_t row0,
    torch::Tensor cos, torch::Tensor sin, torch::Tensor conv_state, torch::Tensor rec_state, torch::Tensor inputs,
    torch::Tensor states, torch::Tensor trace, std::vector<torch::Tensor> weights, std::vector<int64_t> linear, torch::Tensor final_norm,
    std::vector<int64_t> capture, int64_t last, bool final_hidden, double eps_, std::vector<int64_t> sizes) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.is_contiguous(), "x: [B, T, H] bf16");
    TORCH_CHECK(sizes.size() == 11, "sizes: heads, kv_heads, head_dim, rotary_dim, intermediate, key heads, "
                "value heads, key dim, value dim, conv taps, window");
    const int64_t heads = sizes[0], kv_heads = sizes[1], D = sizes[2], rot = sizes[3], I = sizes[4];
    const Linear s{sizes[5], sizes[6], sizes[7], sizes[8], sizes[9], 2 * sizes[5] * sizes[7] + sizes[6] * sizes[8],
                   sizes[6] * sizes[8]};
    const int64_t window = sizes[10];
    const int64_t B = x.size(0), T = x.size(1), H = x.size(2), R = B * T;
    const int64_t L = static_cast<int64_t>(linear.size());
    TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * static_cast<int64_t>(PER_LAYER) && last < L, "weights");
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.dim() == 5 &&
                    k_cache.is_contiguous() && v_cache.is_contiguous(), "attention caches: [La, B, KV, S, D] fp32");
    const int64_t S = k_cache.size(3), Bc = k_cache.size(1);
    TORCH_CHECK(k_cache.size(2) == kv_heads && k_cache.size(4) == D && row0 + B <= Bc, "attention cache shape");
    TORCH_CHECK(conv_state.scalar_type() == at::kBFloat16 && conv_state.is_contiguous() && conv_state.size(1) == Bc &&
                    conv_state.size(2) == s.K - 1 && conv_state.size(3) == s.C, "conv states: [Ll, B, K-1, C] bf16");
    TORCH_CHECK(rec_state.scalar_type() == at::kFloat && rec_state.is_contiguous() && rec_state.size(1) == Bc,
                "recurrent states: [Ll, B, Hv, dk, dv] fp32");
    TORCH_CHECK(inputs.scalar_type() == at::kBFloat16 && inputs.is_contiguous() && inputs.size(1) == B &&
                    inputs.size(2) == s.K - 1 + T, "pending inputs: [Ll, B, K-1+T, C] bf16");
    const bool prefill = states.numel() > 0;  // else trace
    TORCH_CHECK(prefill != (trace.numel() > 0), "pending: final states (a prefill) or a trace");
    if (prefill) {
        TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() && states.size(1) == B &&
                        states.numel() == L_linear(linear) * B * s.vh * s.dk * s.dv, "final states: [Ll, B, Hv, dk, dv] fp32");
    } else {
        TORCH_CHECK(trace.scalar_type() == at::kFloat && trace.is_contiguous() && trace.size(1) == B && trace.size(2) == T &&
                        trace.size(3) == s.C - s.kh * s.dk + 2 * s.vh, "trace: [Ll, B, T, Kd + Vd + 2 Hv] fp32");
    }
    TORCH_CHECK(heads % kv_heads == 0 && D % 16 == 0 && D <= 512 && rot % 2 == 0 && rot <= D && s.vh % s.kh == 0 &&
                    s.dv <= 512, "head shapes");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.size(1) == rot, "rotary tables: [P, rotary_dim] fp32");
    const float eps = static_cast<float>(eps_);
    positions = positions.contiguous();
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t i = 0; i < R; ++i) TORCH_CHECK(pos[i] >= 0 && pos[i] < S && pos[i] < cos.size(0), "position out of range");
    if (prefill)
        for (int64_t b = 0; b < B; ++b) TORCH_CHECK(pos[b * T] == 0, "a forward that keeps only final states is a prefill");
    const blockdraft::Visible vis = blockdraft::visible_slots(visible, pos, B, T, S, window);

    std::vector<Layer> layers(L);
    for (int64_t l = 0; l < L; ++l) {
        const torch::Tensor* w = &weights[l * PER_LAYER];
        for (size_t j = 0; j < PER_LAYER; ++j)
            TORCH_CHECK(!w[j].numel() || (w[j].scalar_type() == at::kBFloat16 && w[j].is_contiguous()), "bf16 weights");
        layers[l] = {opt(w[0]), opt(w[1]), opt(w[2]), opt(w[3]), opt(w[4]), opt(w[5]),
                     opt(w[6]), opt(w[7]), opt(w[8]), opt(w[9]), opt(w[10]), opt(w[11])};
    }
    const int64_t NQ = heads * D, NQKV = (2 * heads + 2 * kv_heads) * D, P = s.C + s.Z + 2 * s.vh;

    auto opts = x.options();
    auto hidden = x.clone();
    auto normed = torch::empty({R, H}, opts), tmp = torch::empty({R, H}, opts);
    auto mix = torch::empty({R, std::max(NQKV, P)}, opts), attn = torch::empty({R, NQ}, opts);
    auto gu = torch::empty({R, 2 * I}, opts), act = torch::empty({R, I}, opts);
    torch::Tensor features;
    if (!capture.empty()) features = torch::empty({B, T, static_cast<int64_t>(capture.size()) * H}, opts);
    bf16 *hp = hidden.data_ptr<bf16>(), *np = normed.data_ptr<bf16>(), *tp = tmp.data_ptr<bf16>();
    bf16 *mp = mix.data_ptr<bf16>(), *ap = attn.data_ptr<bf16>();
    const blockdraft::Scratch scratch{np, gu.data_ptr<bf16>(), act.data_ptr<bf16>(), tp};
    const float* cosp = cos.data_ptr<float>();
    const float* sinp = sin.data_ptr<float>();
    const int64_t kv_stride = Bc * kv_heads * S * D, hs = s.vh * s.dk * s.dv;
    int64_t full = 0, lin = 0;  // the layer's index among those of its kind

    for (int64_t l = 0; l <= last; ++l) {
        const Layer& w = layers[l];
        for (int64_t r = 0; r < R; ++r) blockdraft::rms_norm_row(hp + r * H, w.ln1, np + r * H, H, eps, 1.f);
        if (linear[l]) {
            linear_attention(w, s, np, tp, B, T, H, pos, row0,
                             conv_state.data_ptr<bf16>() + lin * Bc * (s.K - 1) * s.C,
                             rec_state.data_ptr<float>() + lin * Bc * hs, inputs.data_ptr<bf16>() + lin * B * (s.K - 1 + T) * s.C,
                             prefill ? states.data_ptr<float>() + lin * B * hs : nullptr,
                             prefill ? nullptr : trace.data_ptr<float>() + lin * B * T * trace.size(3), mp, eps);
            ++lin;
        } else {
            float* kl = k_cache.data_ptr<float>() + full * kv_stride;
            float* vl = v_cache.data_ptr<float>() + full * kv_stride;
            blockdraft::product_packed(np, w.mix_w, w.mix_b, mp, R, H, NQKV);
            for (int64_t i = 0; i < R; ++i) {  // q / k norms and rotary, keys and values into their slots
                const int64_t b = i / T;
                bf16* row = mp + i * NQKV;
                const float* c = cosp + pos[i] * rot;
                const float* sn = sinp + pos[i] * rot;
                for (int64_t h = 0; h < heads; ++h) blockdraft::rotate(row + 2 * h * D, w.a, c, sn, D, eps, 1.f, rot);
                for (int64_t h = 0; h < kv_heads; ++h) {
                    bf16* k = row + (2 * heads + h) * D;
                    const bf16* v = row + (2 * heads + kv_heads + h) * D;
                    blockdraft::rotate(k, w.b, c, sn, D, eps, 1.f, rot);
                    float* kd = kl + (((row0 + b) * kv_heads + h) * S + pos[i]) * D;
                    float* vd = vl + (((row0 + b) * kv_heads + h) * S + pos[i]) * D;
                    for (int64_t j = 0; j < D; ++j) kd[j] = f(k[j]), vd[j] = f(v[j]);
                }
            }
            blockdraft::attention(mp, NQKV, 2 * D, kl, vl, vis, row0, T, R, heads, kv_heads, S, D, ap);
            for (int64_t i = 0; i < R; ++i)  // the output gate: sigmoid(gate) per head
                for (int64_t h = 0; h < heads; ++h) {
                    bf16* out = ap + i * NQ + h * D;
                    const bf16* gate = mp + i * NQKV + (2 * h + 1) * D;
                    for (int64_t j = 0; j < D; ++j) out[j] = bf16(f(out[j]) / (1.0f + std::exp(-f(gate[j]))));
                }
            blockdraft::product_packed(ap, w.out_w, w.out_b, tp, R, NQ, H);
            ++full;
        }
        blockdraft::add(hp, tp, R * H);
        blockdraft::mlp(hp, w.ln2, 1.f, w.gu_w, nullptr, w.down_w, nullptr, R, H, I, eps, scratch);
        blockdraft::keep_features(hp, features, capture, l, R, H);
    }
    return {final_hidden ? blockdraft::final_norm(hp, final_norm, B, T, H, eps, 1.f) : torch::Tensor(), features};
}

void delta_rule_replay(torch::Tensor state, torch::Tensor trace, torch::Tensor kept, torch::Tensor fresh,
                       int64_t key_heads, int64_t dk, int64_t dv) {
    TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4, "state: [B, Hv, dk, dv]");
    TORCH_CHECK(trace.scalar_type() == at::kFloat && trace.is_contiguous() && trace.dim() == 3, "trace: [B, T, W]");
    const int64_t B = state.size(0), vh = state.size(1), T = trace.size(1), W = trace.size(2), Kd = key_heads * dk;
    TORCH_CHECK(state.size(2) == dk && state.size(3) == dv && trace.size(0) == B && W == Kd + vh * dv + 2 * vh &&
                    vh % key_heads == 0 && dv <= 512, "shapes");
    kept = kept.to(at::kLong).contiguous();
    fresh = fresh.to(at::kBool).contiguous();
    const int64_t* n = kept.data_ptr<int64_t>();
    const bool* zero = fresh.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(n[b] >= 0 && n[b] <= T, "kept tokens out of range");
    const int64_t group = vh / key_heads, hs = dk * dv;
    float* sp = state.data_ptr<float>();
    const float* tp = trace.data_ptr<float>();
    at::parallel_for(0, B * vh, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t task = t0; task < t1; ++task) {
            const int64_t b = task / vh, h = task % vh;
            if (n[b] == 0) continue;  // nothing kept: the committed state stays
            float* S = sp + task * hs;
            if (zero[b]) std::fill(S, S + hs, 0.f);
            for (int64_t t = 0; t < n[b]; ++t) {
                const float* tr = tp + (b * T + t) * W;
                delta_step(S, tr + (h / group) * dk, tr + Kd + h * dv, tr[Kd + vh * dv + h], tr[Kd + vh * dv + vh + h],
                           dk, dv, nullptr, nullptr);
            }
        }
    });
}
