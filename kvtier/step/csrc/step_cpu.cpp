// The decode step's small CPU ops around the projections, fused: RMSNorm (one pass per row, rows in parallel).
// The reference each op is tested against is the model's own module (tests/step/test_norm.py).
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, transformers' Llama/Qwen rounding (CPU)", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
}
