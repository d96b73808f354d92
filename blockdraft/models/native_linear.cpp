// blockdraft's row-independent bf16 product for CPUs with AVX512-BF16 (built on first use by
// blockdraft/models/native.py). y[r, n] = sum_k x[r, k] w[n, k] (+ b[n]), rounded to bf16 once.
//
// Every output element is one fp32 accumulator of 16 lanes fed by `vdpbf16ps` over k in steps of
// 32, in the same order, then summed across lanes in a fixed order: a row's result never depends
// on how many rows the call has or where the row sits among them, which is what exact speculation
// needs (a token verified in a block gets the logits it gets decoded alone). Rows are grouped by
// four only so a tile of four weight rows is read once per group; threads split the output
// features (torch's own pool), never a sum.
#include "native.h"

#include <cmath>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

namespace {

constexpr int64_t TILE = 4;   // weight rows (output features) per tile
constexpr int GROUP = 4;  // input rows per group

inline __m512bh load_bf16(const at::BFloat16* p, int64_t n) {
    // 32 bf16 values, the ones past n read as zero (a product with a zero adds nothing)
    if (n >= 32) return (__m512bh)_mm512_loadu_si512(p);
    __mmask32 m = n <= 0 ? 0 : (__mmask32)((1ull << n) - 1);
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

// Rows [r0, r0 + NR) by weight rows [n0, n0 + NT): the counts are template arguments so that the
// NR x NT accumulators live in registers (with run-time counts they spill to the stack).
template <int NR, int NT>
inline void block(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* b, at::BFloat16* y,
                  int64_t K, int64_t N, int64_t r0, int64_t n0) {
    __m512 acc[NR][NT];
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {  // whole steps of 32: plain loads
        if (r0 == 0) {  // the weight rows two tiles on, fetched while these are multiplied (DRAM latency)
#pragma GCC unroll 4
            for (int j = 0; j < NT; ++j)
                _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + 2 * NT + j) * K + k), _MM_HINT_T0);
        }
        __m512bh wv[NT];
#pragma GCC unroll 4
        for (int j = 0; j < NT; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + (n0 + j) * K + k);
#pragma GCC unroll 4
        for (int i = 0; i < NR; ++i) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (r0 + i) * K + k);
#pragma GCC unroll 4
            for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    if (k < K) {  // the last partial step, zeros past K
        __m512bh wv[NT];
        for (int j = 0; j < NT; ++j) wv[j] = load_bf16(w + (n0 + j) * K + k, K - k);
        for (int i = 0; i < NR; ++i) {
            const __m512bh xv = load_bf16(x + (r0 + i) * K + k, K - k);
            for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < NR; ++i)
        for (int j = 0; j < NT; ++j) {
            float s = _mm512_reduce_add_ps(acc[i][j]);
            if (b != nullptr) s += static_cast<float>(b[n0 + j]);
            y[(r0 + i) * N + n0 + j] = at::BFloat16(s);
        }
}

template <int NT>
inline void rows(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* b, at::BFloat16* y,
                 int64_t R, int64_t K, int64_t N, int64_t n0) {
    int64_t r0 = 0;
    for (; r0 + GROUP <= R; r0 += GROUP) block<GROUP, NT>(x, w, b, y, K, N, r0, n0);
    switch (R - r0) {
        case 3: block<3, NT>(x, w, b, y, K, N, r0, n0); break;
        case 2: block<2, NT>(x, w, b, y, K, N, r0, n0); break;
        case 1: block<1, NT>(x, w, b, y, K, N, r0, n0); break;
        default: break;
    }
}

// Panels: a weight packed as [ceil(N/32) panels][ceil(K/2) pairs][32 outputs][2 values] (`native.pack`),
// zero-padded, read strictly in address order. For each pair of input values one `vdpbf16ps` multiplies
// the pair, broadcast, by 16 outputs' pairs: every lane is one output's accumulator, summed pair by pair
// in order, so no sum across lanes is needed (the tile kernel above spends one per output: at 16 rows the
// panels run the default target's LM head in 2.6 ms against its 4.9 on a 2-core AMD EPYC) and a row's
// sums never depend on the other rows. NR rows at a time (up to 6: 12 accumulators, 2 weight and 1
// broadcast registers). Other sums than the tile kernel's: one weight runs through one of them.
constexpr int64_t PANEL = 32;
constexpr int PANEL_ROWS = 6;

inline __m512bh pair(const at::BFloat16* p, bool last_odd) {
    int32_t v = 0;
    std::memcpy(&v, p, last_odd ? 2 : 4);  // (the value past an odd K reads as zero)
    return (__m512bh)_mm512_set1_epi32(v);
}

template <int NR>
inline void panel(const at::BFloat16* x, const at::BFloat16* wp, const at::BFloat16* b, at::BFloat16* y, int64_t K,
                  int64_t N, int64_t r0, int64_t n0) {
    __m512 acc[NR][2];
#pragma GCC unroll 6
    for (int i = 0; i < NR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const int64_t whole = K / 2;
    const at::BFloat16* xr = x + r0 * K;
    for (int64_t p = 0; p < whole; ++p) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + p * 2 * PANEL);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + p * 2 * PANEL + PANEL);
#pragma GCC unroll 6
        for (int i = 0; i < NR; ++i) {
            const __m512bh xv = pair(xr + i * K + 2 * p, false);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
        }
    }
    if (K % 2) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + whole * 2 * PANEL);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + whole * 2 * PANEL + PANEL);
        for (int i = 0; i < NR; ++i) {
            const __m512bh xv = pair(xr + i * K + 2 * whole, true);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
        }
    }
    for (int h = 0; h < 2; ++h) {
        const int64_t o = n0 + 16 * h, valid = std::min<int64_t>(16, N - o);
        if (valid <= 0) break;
        const __mmask16 m = blockdraft::lanes(valid);
        const __m512 bias = b == nullptr ? _mm512_setzero_ps() : blockdraft::load16(b + o, m);
        for (int i = 0; i < NR; ++i) {
            const __m512 v = b == nullptr ? acc[i][h] : _mm512_add_ps(acc[i][h], bias);
            _mm256_mask_storeu_epi16(y + (r0 + i) * N + o, m, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

}  // namespace

void blockdraft::product_packed(const at::BFloat16* x, const at::BFloat16* wp, const at::BFloat16* b,
                                at::BFloat16* y, int64_t R, int64_t K, int64_t N) {
    const int64_t panels = (N + PANEL - 1) / PANEL, pairs = (K + 1) / 2;
    at::parallel_for(0, panels, 2, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) {
            const at::BFloat16* w = wp + p * pairs * 2 * PANEL;
            const int64_t n0 = p * PANEL;
            int64_t r0 = 0;
            for (; r0 + PANEL_ROWS <= R; r0 += PANEL_ROWS) panel<PANEL_ROWS>(x, w, b, y, K, N, r0, n0);
            switch (R - r0) {
                case 5: panel<5>(x, w, b, y, K, N, r0, n0); break;
                case 4: panel<4>(x, w, b, y, K, N, r0, n0); break;
                case 3: panel<3>(x, w, b, y, K, N, r0, n0); break;
                case 2: panel<2>(x, w, b, y, K, N, r0, n0); break;
                case 1: panel<1>(x, w, b, y, K, N, r0, n0); break;
                default: break;
            }
        }
    });
}

torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && x.dim() == 2, "bf16 x [R, K]");
    TORCH_CHECK(packed.dim() == 4 && packed.size(0) == (N + PANEL - 1) / PANEL && packed.size(1) == (x.size(1) + 1) / 2 &&
                    packed.size(2) == PANEL && packed.size(3) == 2 && packed.is_contiguous(), "a weight from native.pack");
    x = x.contiguous();
    auto y = torch::empty({x.size(0), N}, x.options());
    torch::Tensor b;
    if (bias.has_value() && bias->defined()) b = bias->to(at::kBFloat16).contiguous();
    blockdraft::product_packed(x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(),
                               b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(),
                               x.size(0), x.size(1), N);
    return y;
}

void blockdraft::product_bf16(const at::BFloat16* xp, const at::BFloat16* wp, const at::BFloat16* bp,
                              at::BFloat16* yp, int64_t R, int64_t K, int64_t N) {
    const int64_t tiles = (N + TILE - 1) / TILE;
    at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t n0 = t * TILE;
            switch (std::min(TILE, N - n0)) {  // the same arithmetic per element whichever path
                case 4: rows<4>(xp, wp, bp, yp, R, K, N, n0); break;
                case 3: rows<3>(xp, wp, bp, yp, R, K, N, n0); break;
                case 2: rows<2>(xp, wp, bp, yp, R, K, N, n0); break;
                default: rows<1>(xp, wp, bp, yp, R, K, N, n0); break;
            }
        }
    });
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 inputs only");
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [R, K] and w [N, K]");
    x = x.contiguous();
    w = w.contiguous();
    const int64_t R = x.size(0), K = x.size(1), N = w.size(0);
    auto y = torch::empty({R, N}, x.options());
    torch::Tensor b;
    if (bias.has_value() && bias->defined()) {
        b = bias->to(at::kBFloat16).contiguous();
        TORCH_CHECK(b.numel() == N, "bias of N elements");
    }
    blockdraft::product_bf16(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                             b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(), R, K, N);
    return y;
}

namespace {

// The first maximum of n values read 16 at a time by load(i, mask) (lanes outside the mask as zero),
// -1 if one is a NaN. Two passes: the maximum, then its first position.
template <typename Load>
int64_t first_max_of(Load load, int64_t n) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = blockdraft::lanes(n - i);
        const __m512 v = load(i, m);
        nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
        best = _mm512_mask_max_ps(best, m, best, v);
    }
    if (nan) return -1;
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = blockdraft::lanes(n - i);
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, load(i, m), top, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    return -1;
}

}  // namespace

int64_t blockdraft::first_max(const at::BFloat16* x, int64_t n) {
    return first_max_of([x](int64_t i, __mmask16 m) { return blockdraft::load16(x + i, m); }, n);
}

// The index of each row's maximum, the first one where several tie (torch.argmax's answer), for
// bf16 or fp32 rows [R, N]; -1 for a row holding a NaN (the caller asks torch for those).
torch::Tensor argmax_rows(torch::Tensor x) {
    TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat), "x: [R, N]");
    x = x.contiguous();
    const int64_t R = x.size(0), N = x.size(1);
    auto out = torch::empty({R}, x.options().dtype(at::kLong));
    int64_t* o = out.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r) {
        if (x.scalar_type() == at::kBFloat16) {
            o[r] = blockdraft::first_max(x.data_ptr<at::BFloat16>() + r * N, N);
        } else {
            const float* row = x.data_ptr<float>() + r * N;
            o[r] = first_max_of([row](int64_t i, __mmask16 m) { return _mm512_maskz_loadu_ps(m, row + i); }, N);
        }
    }
    return out;
}

// Each bf16 row's k largest values (descending; equal values in index order), as ids [R, k] and their
// log-probabilities under the row's softmax [R, k] fp32: (x - max) - log(sum e^(x - max)), as torch's
// log_softmax computes it. A row holding a NaN or an infinity gets id -1 first (the caller asks torch).
std::vector<torch::Tensor> top_logprobs(torch::Tensor x, int64_t k) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && k > 0, "x: [R, N] bf16, k > 0");
    x = x.contiguous();
    const int64_t R = x.size(0), N = x.size(1);
    k = std::min(k, N);
    auto ids = torch::empty({R, k}, x.options().dtype(at::kLong));
    auto logp = torch::empty({R, k}, x.options().dtype(at::kFloat));
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    int64_t* ip = ids.data_ptr<int64_t>();
    float* lp = logp.data_ptr<float>();
    at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
        std::vector<float> val(k);
        std::vector<int64_t> idx(k);
        for (int64_t r = r0; r < r1; ++r) {
            const at::BFloat16* row = xp + r * N;
            __m512 most = _mm512_set1_ps(-INFINITY);
            __mmask16 nan = 0;
            for (int64_t i = 0; i < N; i += 16) {
                const __mmask16 m = blockdraft::lanes(N - i);
                const __m512 v = blockdraft::load16(row + i, m);
                nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
                most = _mm512_mask_max_ps(most, m, most, v);
            }
            const float top = _mm512_reduce_max_ps(most);
            const float log_sum = nan ? NAN : std::log(blockdraft::exp_sum(row, N, top));
            if (nan || !std::isfinite(top) || !std::isfinite(log_sum)) {
                ip[r * k] = -1;
                continue;
            }
            int64_t n = 0;  // values kept so far, val descending (ties in index order)
            for (int64_t i = 0; i < N; i += 16) {
                const __mmask16 m = blockdraft::lanes(N - i);
                const __m512 v = blockdraft::load16(row + i, m);
                __mmask16 hit = n < k ? m : _mm512_mask_cmp_ps_mask(m, v, _mm512_set1_ps(val[k - 1]), _CMP_GT_OQ);
                while (hit) {
                    const int j = __builtin_ctz(hit);
                    hit &= hit - 1;
                    const float y = static_cast<float>(row[i + j]);
                    if (n == k && !(y > val[k - 1])) continue;
                    int64_t p = std::min(n, k - 1);  // where it goes: after every value >= it
                    while (p > 0 && val[p - 1] < y) {
                        val[p] = val[p - 1], idx[p] = idx[p - 1];
                        --p;
                    }
                    val[p] = y, idx[p] = i + j;
                    n = std::min(n + 1, k);
                    if (n == k && hit) hit &= _mm512_mask_cmp_ps_mask(m, v, _mm512_set1_ps(val[k - 1]), _CMP_GT_OQ);
                }
            }
            for (int64_t j = 0; j < k; ++j) ip[r * k + j] = idx[j], lp[r * k + j] = (val[j] - top) - log_sum;
        }
    });
    return {ids, logp};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("top_logprobs", &top_logprobs, "each bf16 row's k largest values' ids and log-probabilities");
    m.def("argmax_rows", &argmax_rows, "each row's first maximum (bf16 / fp32), -1 for a row with a NaN");
    m.def("linear_packed", &linear_packed, "a row-independent bf16 product from a weight packed by native.pack");
    m.def("linear_bf16", &linear_bf16, "row-independent bf16 product (AVX512-BF16)");
    m.def("llama_forward", &llama_forward, "a whole cached forward of a Llama-family target, row-independent");
    m.def("qwen3_5_forward", &qwen3_5_forward, "a whole cached forward of a Qwen3.5 target, row-independent");
    m.def("delta_rule_replay", &delta_rule_replay, "a linear-attention layer's states after the kept tokens of a trace");
    m.def("dflash_context", &dflash_context, "a DFlash drafter's KV injection of new context features");
    m.def("markov_greedy", &markov_greedy, "a DSpark drafter's greedy Markov-head chain over a block");
}
