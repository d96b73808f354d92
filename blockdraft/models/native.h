// blockdraft's native CPU kernels (built on first use by blockdraft/models/native.py).
#pragma once
#include <immintrin.h>
#include <torch/extension.h>

#include <vector>

namespace blockdraft {

// The first min(left, 16) of 16 lanes (a masked tail of a loop in steps of 16).
inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

// 16 bf16 values (the lanes outside m read as zero) as fp32.
inline __m512 load16(const at::BFloat16* p, __mmask16 m = 0xFFFF) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// 16 fp32 values (the lanes outside m left alone) into bf16, rounded to nearest even.
inline void store16(at::BFloat16* p, __m512 v, __mmask16 m = 0xFFFF) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// e^x for 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial (relative error
// ~1e-7), times 2^n. Lane by lane the same arithmetic, so a value's result does not depend on its lane.
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts (Cody-Waite)
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// y[r, n] = sum_k x[r, k] w[n, k] (+ b[n]), rounded to bf16 once; row-independent (native_linear.cpp).
void product_bf16(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* b, at::BFloat16* y,
                  int64_t R, int64_t K, int64_t N);

// The same from a weight packed by `native.pack` in panels: [ceil(N/32)][ceil(K/2)][32][2], zero-padded;
// each output one lane's sum, pair by pair in order (native_linear.cpp): other sums than product_bf16's.
void product_packed(const at::BFloat16* x, const at::BFloat16* wp, const at::BFloat16* b, at::BFloat16* y,
                    int64_t R, int64_t K, int64_t N);

// y = bf16((w + offset) * x / rms(x)) for one row of n values (offset 1: Qwen3.5's norms); the sum of squares
// in one order (native_step.cpp).
void rms_norm_row(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t n, float eps,
                  float offset = 0.f);

// Optional norm (q/k norm, `norm` may be null; offset as rms_norm_row's) and rotary embedding of the first
// `rot` values (0: all) of one head of d values in place (cos / sin: the position's fp32 rows of rot values,
// the sin row carrying the rotation's sign; native_step.cpp).
void rotate(at::BFloat16* x, const at::BFloat16* norm, const float* cos, const float* sin, int64_t d, float eps,
            float offset = 0.f, int64_t rot = 0);

// a = bf16(a + b) and a = bf16(silu(g) * u), n values (native_step.cpp).
void add(at::BFloat16* a, const at::BFloat16* b, int64_t n);
void silu_mul(const at::BFloat16* g, const at::BFloat16* u, at::BFloat16* a, int64_t n);

// Each token's visible cache slots in slot order (token i's: seen[start[i] .. start[i + 1]]): from `visible`
// [B, T, >= S'] where given, else every slot up to its position within `window` (slot = position).
struct Visible {
    std::vector<int64_t> start;
    std::vector<int32_t> seen;
    int64_t most = 0;
};
Visible visible_slots(torch::Tensor visible, const int64_t* pos, int64_t B, int64_t T, int64_t S, int64_t window);

// Attention of R = B x T tokens over their visible slots of one layer's fp32 caches kl / vl [Bc, KV, S, D]
// (batch row b at cache row row0 + b): query head j of token i at q + i * q_row + j * q_step (bf16), the
// heads sharing a KV head taken together; out [R, heads * D] (native_step.cpp).
void attention(const at::BFloat16* q, int64_t q_row, int64_t q_step, const float* kl, const float* vl,
               const Visible& vis, int64_t row0, int64_t T, int64_t R, int64_t heads, int64_t kv_heads, int64_t S,
               int64_t D, at::BFloat16* out);

// The MLP block in place: hidden += down(silu(gate) * up) of the norm (offset as rms_norm_row's) of hidden;
// scratch rows for the norm [R, H], gate/up [R, 2I], activation [R, I] and the output [R, H].
struct Scratch {
    at::BFloat16 *normed, *gu, *act, *tmp;
};
void mlp(at::BFloat16* hidden, const at::BFloat16* norm, float offset, const at::BFloat16* gu_w,
         const at::BFloat16* gu_b, const at::BFloat16* down_w, const at::BFloat16* down_b, int64_t R, int64_t H,
         int64_t I, float eps, Scratch scratch);

// Rows of hidden [R, H] into features [B, T, n x H] at each column block c whose capture[c] is this layer.
void keep_features(const at::BFloat16* hidden, torch::Tensor& features, const std::vector<int64_t>& capture,
                   int64_t layer, int64_t R, int64_t H);

// The final norm (offset as rms_norm_row's) of hidden [B x T, H]: a new [B, T, H] bf16 tensor.
torch::Tensor final_norm(const at::BFloat16* hidden, const torch::Tensor& norm, int64_t B, int64_t T, int64_t H,
                         float eps, float offset);

// The index of the first maximum of n bf16 values, -1 if one is a NaN (native_linear.cpp).
int64_t first_max(const at::BFloat16* x, int64_t n);

// sum_i e^(x[i] - top) over n bf16 values (the softmax's denominator; native_step.cpp).
float exp_sum(const at::BFloat16* x, int64_t n, float top);

}  // namespace blockdraft

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);

std::vector<torch::Tensor> llama_forward(
    torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor visible, int64_t window,
    torch::Tensor k_cache, torch::Tensor v_cache, int64_t row0, torch::Tensor cos, torch::Tensor sin,
    std::vector<torch::Tensor> weights, torch::Tensor final_norm, std::vector<int64_t> capture, int64_t last,
    bool final_hidden, double eps, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate);

void dflash_context(torch::Tensor features, torch::Tensor positions, torch::Tensor slots, torch::Tensor k_cache,
                    torch::Tensor v_cache, int64_t row0, torch::Tensor cos, torch::Tensor sin, torch::Tensor fc,
                    torch::Tensor hidden_norm, std::vector<torch::Tensor> kv, double eps, int64_t hidden);

std::vector<torch::Tensor> markov_greedy(torch::Tensor hidden, torch::Tensor head, int64_t vocab_rows,
                                         torch::Tensor w1, torch::Tensor w2, torch::Tensor vocab, torch::Tensor previous,
                                         bool probs);

std::vector<torch::Tensor> qwen3_5_forward(
    torch::Tensor x, torch::Tensor positions, torch::Tensor visible, torch::Tensor k_cache, torch::Tensor v_cache, int64_t row0,
    torch::Tensor cos, torch::Tensor sin, torch::Tensor conv_state, torch::Tensor rec_state, torch::Tensor inputs,
    torch::Tensor states, torch::Tensor trace, std::vector<torch::Tensor> weights, std::vector<int64_t> linear,
    torch::Tensor final_norm, std::vector<int64_t> capture, int64_t last, bool final_hidden, double eps,
    std::vector<int64_t> sizes);

void delta_rule_replay(torch::Tensor state, torch::Tensor trace, torch::Tensor kept, torch::Tensor fresh,
                       int64_t key_heads, int64_t dk, int64_t dv);
