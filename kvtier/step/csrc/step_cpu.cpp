// The decode step's small CPU ops around the projections, fused: RMSNorm (one pass per row, rows in parallel) and
// the rotary embedding of q and k (one pass each, bf16). The reference each op is tested against is the model's own
// module or function (tests/step/test_norm.py, tests/step/test_rotary.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary", &rotary, "transformers' apply_rotary_pos_emb on bf16 q and k, its rounding (CPU)", py::arg("q"),
        py::arg("k"), py::arg("cos"), py::arg("sin"), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, transformers' Llama/Qwen rounding (CPU)", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
}
