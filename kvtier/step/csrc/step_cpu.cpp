// The decode step's small CPU ops around the projections, fused: RMSNorm (one pass per row, rows in parallel; also
// with the residual add before it), the rotary embedding of q and k (one pass each, bf16) and a gated MLP's SiLU x
// product (one pass, bf16). The reference each op is tested against is the model's own module or function
// (tests/step/test_norm.py, tests/step/test_rotary.py, tests/step/test_mlp.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

// transformers' apply_rotary_pos_emb on one bf16 tensor x (1, H, N, D), last dim contiguous (its other strides any:
// a column slice of a fused q/k/v product too), with cos/sin (1, N, D):
// x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]), each of the three eager
// ops rounded to bf16 as torch rounds it (float32 arithmetic, round to nearest even); the negation is exact.
torch::Tensor rotary_one(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  using bf16 = c10::BFloat16;
  const int64_t H = x.size(1), N = x.size(2), D = x.size(3), half = D / 2;
  // torch lays an elementwise result out in x's dimension order: (1, N, H, D) in memory when x's heads are the
  // inner dim (the per-head view of a projection's output, or of a column slice of a fused q/k/v product)
  auto out = x.stride(1) <= x.stride(2) ? torch::empty({1, N, H, D}, x.options()).transpose(1, 2)
                                        : torch::empty({1, H, N, D}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = sin.data_ptr<bf16>();
  const int64_t xs1 = x.stride(1), xs2 = x.stride(2), os1 = out.stride(1), os2 = out.stride(2);
  const int64_t cs = cos.stride(1), ss = sin.stride(1);
  at::parallel_for(0, H * N, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t h = r / N, n = r % N;
      const bf16* xr = xp + h * xs1 + n * xs2;
      bf16* orow = op + h * os1 + n * os2;
      const bf16* c = cp + n * cs;
      const bf16* s = sp + n * ss;
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
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 4 && t->size(0) == 1 &&
                    t->stride(3) == 1 && t->size(3) % 2 == 0 && t->size(2) == q.size(2) && t->size(3) == q.size(3),
                "rotary: q and k (1, H, N, D) bfloat16 on the CPU, last dim contiguous, D even, one N and D");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->size(0) == 1 &&
                    t->size(1) == q.size(2) && t->size(2) == q.size(3) && t->stride(2) == 1,
                "rotary: cos and sin (1, N, D) bfloat16 on the CPU, last dim contiguous");
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary", &rotary, "transformers' apply_rotary_pos_emb on bf16 q and k, its rounding (CPU)", py::arg("q"),
        py::arg("k"), py::arg("cos"), py::arg("sin"), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, transformers' Llama/Qwen rounding (CPU)", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "x + y and RMSNorm of the sum in one pass, torch's rounding of each (CPU)",
        py::arg("x"), py::arg("y"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "a gated MLP's silu(gate) * up in bf16, torch's two ops' rounding (CPU)",
        py::arg("gate"), py::arg("up"), py::arg("table"), py::call_guard<py::gil_scoped_release>());
}
