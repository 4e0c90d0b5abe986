// The decode step's CPU ops outside the attention: RMSNorm (one pass per row, rows in parallel; also with the
// residual add before it), the rotary embedding of q and k (one pass each, bf16), a gated MLP's SiLU x product (one
// pass, bf16), and on CPUs with AMX the bf16 projections themselves (weights packed once into AMX tiles). The
// reference each op is tested against is the model's own module or function, and for the projections a float64
// product (tests/step/test_norm.py, test_rotary.py, test_mlp.py, test_linear.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "kvtier_amx.h"  // KVTIER_AMX: the AMX projections below

namespace {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }

// One row of RMSNorm as transformers' Llama/Qwen modules compute it: the row widened to float32, its mean square
// (float32), x * rsqrt(ms + eps) in float32 rounded to the input dtype, then times the weight in the input dtype
// (a bf16 x bf16 product rounded once). Only the sum's order differs from torch's reduction.
template <typename T>
void norm_row(const T* x, const T* w, T* y, int64_t D, float eps) {
  float acc[16] = {0};
  int64_t j = 0;
  for (; j + 16 <= D; j += 16)
    for (int l = 0; l < 16; ++l) {
      const float v = to_f(x[j + l]);
      acc[l] += v * v;
    }
  float ss = 0.f;
  for (int l = 0; l < 16; ++l) ss += acc[l];
  for (; j < D; ++j) {
    const float v = to_f(x[j]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (j = 0; j < D; ++j) {
    const T h = static_cast<T>(to_f(x[j]) * r);
    y[j] = static_cast<T>(to_f(w[j]) * to_f(h));
  }
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rms_norm: CPU tensors");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm: x and weight of one dtype, float32 or bfloat16");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1) && w.is_contiguous(),
              "rms_norm: weight (D,) contiguous for x (..., D)");
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t D = x.size(-1), R = D ? xc.numel() / D : 0;
  const float e = static_cast<float>(eps);
  auto rows = [&](const auto* xp, const auto* wp, auto* yp) {
    // grain: a row is ~D multiply-adds; below ~16 rows one thread wakes the other for nothing
    at::parallel_for(0, R, 16, [&](int64_t b, int64_t end) {
      for (int64_t r = b; r < end; ++r) norm_row(xp + r * D, wp, yp + r * D, D, e);
    });
  };
  if (x.scalar_type() == at::kBFloat16)
    rows(xc.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>());
  else
    rows(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>());
  return y;
}

// A residual add and the next RMSNorm in one pass per row: s = x + y rounded to the dtype as torch's add rounds it
// (float32 sum, round to nearest even), then h = norm_row(s) on the rounded row: exactly rms_norm(x + y). x and y
// (..., D) of one shape and dtype; returns (s, h), both contiguous.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu() && w.device().is_cpu(), "add_rms_norm: CPU tensors");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && y.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "add_rms_norm: x, y and weight of one dtype, float32 or bfloat16");
  TORCH_CHECK(x.dim() >= 1 && x.sizes() == y.sizes() && w.dim() == 1 && w.size(0) == x.size(-1) && w.is_contiguous(),
              "add_rms_norm: x and y (..., D) of one shape, weight (D,) contiguous");
  auto xc = x.contiguous(), yc = y.contiguous();
  auto s = torch::empty_like(xc), h = torch::empty_like(xc);
  const int64_t D = x.size(-1), R = D ? xc.numel() / D : 0;
  const float e = static_cast<float>(eps);
  auto rows = [&](const auto* xp, const auto* yp, const auto* wp, auto* sp, auto* hp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    at::parallel_for(0, R, 16, [&](int64_t b, int64_t end) {  // grain: as rms_norm's
      for (int64_t r = b; r < end; ++r) {
        const T* xr = xp + r * D;
        const T* yr = yp + r * D;
        T* sr = sp + r * D;
        for (int64_t j = 0; j < D; ++j) sr[j] = static_cast<T>(to_f(xr[j]) + to_f(yr[j]));
        norm_row(sr, wp, hp + r * D, D, e);
      }
    });
  };
  if (x.scalar_type() == at::kBFloat16)
    rows(xc.data_ptr<c10::BFloat16>(), yc.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(),
         s.data_ptr<c10::BFloat16>(), h.data_ptr<c10::BFloat16>());
  else
    rows(xc.data_ptr<float>(), yc.data_ptr<float>(), w.data_ptr<float>(), s.data_ptr<float>(), h.data_ptr<float>());
  return {s, h};
}

// transformers' apply_rotary_pos_emb on one bf16 tensor x (B, H, N, D), last dim contiguous (its other strides any:
// a column slice of a fused q/k/v product too), with cos/sin (1 or B, N, D):
// x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]), each of the three eager
// ops rounded to bf16 as torch rounds it (float32 arithmetic, round to nearest even); the negation is exact.
torch::Tensor rotary_one(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  using bf16 = c10::BFloat16;
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2), D = x.size(3), half = D / 2;
  // torch lays an elementwise result out in x's dimension order: (B, N, H, D) in memory when x's heads are the
  // inner dim (the per-head view of a projection's output, or of a column slice of a fused q/k/v product)
  auto out = x.stride(1) <= x.stride(2) ? torch::empty({B, N, H, D}, x.options()).transpose(1, 2)
                                        : torch::empty({B, H, N, D}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = sin.data_ptr<bf16>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  // a batch of rows at one position each shares cos/sin (1, N, D): its batch stride is 0
  const int64_t cs0 = cos.size(0) == 1 ? 0 : cos.stride(0), ss0 = sin.size(0) == 1 ? 0 : sin.stride(0);
  const int64_t cs = cos.stride(1), ss = sin.stride(1);
  at::parallel_for(0, B * H * N, 64, [&](int64_t b0, int64_t e) {
    for (int64_t r = b0; r < e; ++r) {
      const int64_t b = r / (H * N), h = r / N % H, n = r % N;
      const bf16* xr = xp + b * xs0 + h * xs1 + n * xs2;
      bf16* orow = op + b * os0 + h * os1 + n * os2;
      const bf16* c = cp + b * cs0 + n * cs;
      const bf16* s = sp + b * ss0 + n * ss;
      for (int64_t d = 0; d < D; ++d) {
        const float rot = d < half ? -static_cast<float>(xr[d + half]) : static_cast<float>(xr[d - half]);
        const bf16 a = static_cast<bf16>(static_cast<float>(xr[d]) * static_cast<float>(c[d]));
        const bf16 m = static_cast<bf16>(rot * static_cast<float>(s[d]));
        orow[d] = static_cast<bf16>(static_cast<float>(a) + static_cast<float>(m));
      }
    }
  });
  return out;
}

std::vector<torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  for (const auto* t : {&q, &k})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 4 &&
                    t->size(0) == q.size(0) && t->stride(3) == 1 && t->size(3) % 2 == 0 &&
                    t->size(2) == q.size(2) && t->size(3) == q.size(3),
                "rotary: q and k (B, H, N, D) bfloat16 on the CPU, last dim contiguous, D even, one B, N and D");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 3 &&
                    (t->size(0) == 1 || t->size(0) == q.size(0)) && t->size(1) == q.size(2) &&
                    t->size(2) == q.size(3) && t->stride(2) == 1,
                "rotary: cos and sin (1 or B, N, D) bfloat16 on the CPU, last dim contiguous");
  return {rotary_one(q, cos, sin), rotary_one(k, cos, sin)};
}

// A gated MLP's act(gate) * up for bf16 SiLU as torch's two eager ops compute it: silu(g) rounded to bf16, then the
// product of two bf16 values in float32 (exact: 8-bit significands) rounded to nearest even once. silu(g) is read
// from `table` (65536 float32: torch's own bf16 silu of every bit pattern, widened; kvtier/step/mlp.py builds it and
// checks that torch's vector and scalar paths agree on every finite value), so the result is torch's whatever ISA
// torch dispatched to. g and u (..., W) bf16 of one shape, last dim contiguous, rows of any uniform stride (the two
// column halves of one fused gate/up product); returns (..., W) contiguous. NaN products come back as a NaN (its
// payload may differ from torch's).
torch::Tensor silu_mul(torch::Tensor g, torch::Tensor u, torch::Tensor table) {
  TORCH_CHECK(g.device().is_cpu() && u.device().is_cpu() && g.scalar_type() == at::kBFloat16 &&
                  u.scalar_type() == at::kBFloat16 && g.dim() >= 1 && g.sizes() == u.sizes() && g.stride(-1) == 1 &&
                  u.stride(-1) == 1,
              "silu_mul: gate and up (..., W) bfloat16 on the CPU, one shape, last dim contiguous");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.numel() == 65536 && table.is_contiguous(),
              "silu_mul: table (65536,) float32 contiguous");
  const int64_t W = g.size(-1), R = W ? g.numel() / W : 0;
  auto out = torch::empty(g.sizes(), g.options());
  if (R == 0) return out;
  const auto g2 = g.view({R, W}), u2 = u.view({R, W});  // fails (clearly) when the rows are not uniform
  const int64_t gs = g2.stride(0), us = u2.stride(0);
  const uint16_t* gp = reinterpret_cast<const uint16_t*>(g2.data_ptr<c10::BFloat16>());
  const c10::BFloat16* up = u2.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const float* tab = table.data_ptr<float>();
  // grain: ~16K elements a chunk; fewer would wake the other thread for less work than its wake-up costs
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / W), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const uint16_t* gr = gp + r * gs;
      const c10::BFloat16* ur = up + r * us;
      c10::BFloat16* orow = op + r * W;
      int64_t j = 0;
#ifdef __AVX512F__
      const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), qnan = _mm512_set1_epi32(0x7fc0);
      for (; j + 16 <= W; j += 16) {
        const __m512i gi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gr + j)));
        const __m512 s = _mm512_i32gather_ps(gi, tab, 4);
        const __m512i ui = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ur + j)));
        const __m512 p = _mm512_mul_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(ui, 16)));
        // round to nearest even as c10::BFloat16(float) does (not VCVTNEPS2BF16: it flushes subnormals)
        const __m512i pb = _mm512_castps_si512(p);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(pb, 16), one);
        __m512i rb = _mm512_srli_epi32(_mm512_add_epi32(pb, _mm512_add_epi32(lsb, bias)), 16);
        rb = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(p, p, _CMP_ORD_Q), qnan, rb);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + j), _mm512_cvtepi32_epi16(rb));
      }
#endif
      for (; j < W; ++j) orow[j] = static_cast<c10::BFloat16>(tab[gr[j]] * static_cast<float>(ur[j]));
    }
  });
  return out;
}

#ifdef KVTIER_AMX
namespace {

// Tiles (kvtier_amx::configure): tmm0..3 four 16 x 16 float32 sums (two 16-row chunks of x by two 16-column
// blocks of the weight); tmm4, tmm5 the x chunks' 32-wide K slices; tmm6, tmm7 the two weight tiles of a K slice.

// 16 float32 sums plus the bias, rounded to bf16 as c10::BFloat16(float) rounds (to nearest even; NaN stays NaN)
inline void store_bf16x16(const float* c, const float* bias, uint16_t* out) {
  __m512 v = _mm512_loadu_ps(c);
  if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0x7fc0), r);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}

}  // namespace
#endif

bool amx_linear_available() {
#ifdef KVTIER_AMX
  return kvtier_amx::permitted();
#else
  return false;
#endif
}

// w (N, K) bf16, N and K multiples of 32 -> (N * K,) bf16 in AMX tile order: for each block of 32 output columns,
// for each 32-wide slice of K, two 16 x 32 tiles (the block's columns 0-15, then 16-31) in the pair-interleaved
// layout TDPBF16PS reads: tile row p, element 2n + e = w[n, 32 kb + 2 p + e]. The whole weight is then one
// sequential stream in the order amx_linear reads it.
torch::Tensor amx_pack(torch::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(0) % 32 == 0 &&
                  w.size(1) % 32 == 0,
              "amx_pack: weight (N, K) bfloat16 on the CPU, N and K multiples of 32");
  const int64_t N = w.size(0), K = w.size(1), KB = K / 32;
  auto wc = w.contiguous();
  auto out = torch::empty({N * K}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  at::parallel_for(0, N / 32, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb)
        for (int half = 0; half < 2; ++half) {
          uint16_t* t = dst + ((nb * KB + kb) * 2 + half) * 512;
          for (int p = 0; p < 16; ++p)
            for (int n = 0; n < 16; ++n)
              for (int e = 0; e < 2; ++e)
                t[p * 32 + 2 * n + e] = src[(nb * 32 + half * 16 + n) * K + kb * 32 + 2 * p + e];
        }
  });
  return out;
}

// x (..., K) bf16 times the weight packed by amx_pack (N outputs), plus bias (N,) bf16 or an empty tensor: (..., N)
// bf16. Float32 sums of the TDPBF16PS products in K order, one 32-wide slice after another, then the bias added in
// float32 and the sum rounded once to bf16 (nearest even). Threads split the output columns (blocks of 32); a
// thread takes its columns in panels whose weights (~512 KiB) stay in L2 while every 32-row chunk of x passes over
// them, so the weight is read from memory once at any row count. Rows past a multiple of 16 are computed on a
// zero-padded copy of the last chunk.
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias) {
#ifdef KVTIER_AMX
  TORCH_CHECK(kvtier_amx::permitted(), "amx_linear: this process may not use AMX tiles");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) % 32 == 0 &&
                  N % 32 == 0 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.numel() == N * x.size(-1),
              "amx_linear: x (..., K) bfloat16 on the CPU and a weight packed by amx_pack for (N, K), N and K "
              "multiples of 32");
  TORCH_CHECK(!bias.defined() || bias.numel() == 0 ||
                  (bias.scalar_type() == at::kBFloat16 && bias.numel() == N && bias.is_contiguous()),
              "amx_linear: bias (N,) bfloat16 contiguous, or empty");
  const int64_t K = x.size(-1), KB = K / 32, M = x.numel() / K;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = torch::empty(sizes, x.options());
  if (M == 0) return out;
  auto xc = x.contiguous();
  const uint16_t* a = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  std::vector<float> biasf;
  if (bias.defined() && bias.numel()) {
    const uint16_t* bp = reinterpret_cast<const uint16_t*>(bias.data_ptr<c10::BFloat16>());
    biasf.resize(N);
    for (int64_t n = 0; n < N; ++n) {
      const uint32_t bits = uint32_t(bp[n]) << 16;
      std::memcpy(&biasf[n], &bits, 4);
    }
  }
  const float* bf = biasf.empty() ? nullptr : biasf.data();
  // the last chunk of 16 rows, zero-padded where M is not a multiple of 16 (a tile reads 16 rows)
  const int64_t M16 = (M + 15) / 16 * 16, full = M / 16 * 16;
  std::vector<uint16_t> tail;
  if (M16 != M) {
    tail.assign(16 * K, 0);
    std::memcpy(tail.data(), a + full * K, (M - full) * K * 2);
  }
  auto rows = [&](int64_t m) { return m < full ? a + m * K : tail.data() + (m - full) * K; };
  const int64_t panel = std::max<int64_t>(1, (512 * 1024) / (KB * 2048));
  at::parallel_for(0, N / 32, 1, [&](int64_t nb0, int64_t nb1) {
    kvtier_amx::configure();
    alignas(64) float c[4][256];
    for (int64_t p0 = nb0; p0 < nb1; p0 += panel) {
      const int64_t p1 = std::min(nb1, p0 + panel);
      for (int64_t m0 = 0; m0 < M16; m0 += 32) {
        const bool two = m0 + 16 < M16;
        const uint16_t* a0 = rows(m0);
        const uint16_t* a1 = two ? rows(m0 + 16) : a0;
        for (int64_t nb = p0; nb < p1; ++nb) {
          const uint16_t* wb = wp + nb * KB * 1024;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t kb = 0; kb < KB; ++kb) {
            const uint16_t* t = wb + kb * 1024;
            _tile_loadd(4, a0 + kb * 32, K * 2);
            _tile_loadd(6, t, 64);
            _tile_loadd(7, t + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
              _tile_loadd(5, a1 + kb * 32, K * 2);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
          if (two) {
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
          }
          for (int blk = 0; blk < (two ? 4 : 2); ++blk) {
            const int64_t mb = m0 + (blk >> 1) * 16, n0 = nb * 32 + (blk & 1) * 16;
            for (int64_t r = 0; r < 16 && mb + r < M; ++r)
              store_bf16x16(c[blk] + r * 16, bf ? bf + n0 : nullptr, op + (mb + r) * N + n0);
          }
        }
      }
    }
    _tile_release();  // leave the tiles as found: unconfigured
  });
  return out;
#else
  TORCH_CHECK(false, "amx_linear: this build has no AMX (the CPU or the compiler lacks AMX-BF16)");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary", &rotary, "transformers' apply_rotary_pos_emb on bf16 q and k, its rounding (CPU)", py::arg("q"),
        py::arg("k"), py::arg("cos"), py::arg("sin"), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, transformers' Llama/Qwen rounding (CPU)", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "x + y and RMSNorm of the sum in one pass, torch's rounding of each (CPU)",
        py::arg("x"), py::arg("y"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("amx_linear_available", &amx_linear_available, "whether amx_linear runs here (AMX build and permission)");
  m.def("amx_pack", &amx_pack, "a bf16 weight (N, K) in AMX tile order for amx_linear (CPU)", py::arg("weight"),
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_linear", &amx_linear, "x (..., K) times an amx_pack'ed bf16 weight, plus bias (AMX, CPU)", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "a gated MLP's silu(gate) * up in bf16, torch's two ops' rounding (CPU)",
        py::arg("gate"), py::arg("up"), py::arg("table"), py::call_guard<py::gil_scoped_release>());
}
