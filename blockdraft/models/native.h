// blockdraft's native CPU kernels (built on first use by blockdraft/models/native.py).
#pragma once
#include <immintrin.h>
#include <torch/extension.h>

namespace blockdraft {

// The first min(left, 16) of 16 lanes (a masked tail of a loop in steps of 16).
inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

// 16 bf16 values (the lanes outside m read as zero) as fp32.
inline __m512 load16(const at::BFloat16* p, __mmask16 m = 0xFFFF) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// y[r, n] = sum_k x[r, k] w[n, k] (+ b[n]), rounded to bf16 once; row-independent (native_linear.cpp).
void product_bf16(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* b, at::BFloat16* y,
                  int64_t R, int64_t K, int64_t N);

// The same from a weight packed by `native.pack` in panels: [ceil(N/32)][ceil(K/2)][32][2], zero-padded;
// each output one lane's sum, pair by pair in order (native_linear.cpp): other sums than product_bf16's.
void product_packed(const at::BFloat16* x, const at::BFloat16* wp, const at::BFloat16* b, at::BFloat16* y,
                    int64_t R, int64_t K, int64_t N);

// y = bf16(w * x / rms(x)) for one row of n values; the sum of squares in one order (native_step.cpp).
void rms_norm_row(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t n, float eps);

// Optional norm (q/k norm, `norm` may be null) and rotary embedding of one head of d values in place
// (cos / sin: the position's fp32 rows, the sin row carrying the rotation's sign; native_step.cpp).
void rotate(at::BFloat16* x, const at::BFloat16* norm, const float* cos, const float* sin, int64_t d, float eps);

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
