// Fused decode attention over several KV regions on the CPU, with the cumulative score update.
//
// One call per layer and decode step replaces ~50 small eager ops (partials, log-sum-exp merge, weight folds):
// for every (row b, kv-head h) the g query heads of the group attend the union of the regions as one softmax
// (float32 statistics), the normalised output is written, and each kept key's merged weight summed over the
// group's query heads is added, summed over kv-heads in a fixed order, to scores[b, pos[b, j]] (float64).
// Masked columns (bias -inf) never reach the output or the scores: their K/V may be stale or uninitialised (a K
// slot inside a block of 4 is read and its logit replaced by -inf; a masked V slot is never read).
// Attention sinks (gpt-oss): an optional logit per query head that joins the softmax's maximum and denominator and
// brings no value (the eager path's sink_partial).
// A region marked "staged" is host memory that the step streams (t1_attention="stream"): each (b, h) block of its
// K, then of its V, is copied chunk by chunk (~8 KiB) into a buffer of the worker thread just before that chunk is
// read, and read from there, the next chunk's source prefetched meanwhile. The same bytes move every step as with a
// whole-layer staging copy, but the device-side buffer is one chunk per thread (it stays in cache) instead of a
// layer's T1, and the copy overlaps the arithmetic. Same floats as reading the region in place.
// Logits of bfloat16 K with a bf16-exact query go through AMX tiles where the build has AMX-BF16 (16 keys x every
// query head of the group per tile product), else VDPBF16PS (AVX512-BF16), else float32; K and V rows are
// prefetched a block ahead (the tile loads and value tiles otherwise wait on memory: 32 rows x 512 tokens x 24
// layers bf16, 2-core AMX Xeon, 22.6 -> 18.7 ms by prefetching, 17.6 ms with AMX logits).
// The eager reference is kvtier.attention.merge (partial, merge, add_weights); tests compare the two.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define KVTIER_DPBF16 1
#endif
#include "kvtier_amx.h"  // KVTIER_AMX: logits by AMX tiles
#ifdef KVTIER_AMX
#include <mutex>
#endif
#include <cstring>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A row of D values as float32: the pointer itself for float, else converted into tmp.
template <typename T>
inline const float* as_float(const T* src, float* tmp, int64_t D);

template <>
inline const float* as_float<float>(const float* src, float*, int64_t) { return src; }

template <>
inline const float* as_float<c10::BFloat16>(const c10::BFloat16* src, float* tmp, int64_t D) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t d = 0; d < D; ++d) tmp[d] = bf16_to_float(s[d]);
  return tmp;
}

// 16 independent lanes so that the compiler vectorises without reassociating one running sum.
inline float dot(const float* a, const float* b, int64_t D) {
  float acc[16] = {0.f};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16)
    for (int u = 0; u < 16; ++u) acc[u] += a[d + u] * b[d + u];
  float s = 0.f;
  for (int u = 0; u < 16; ++u) s += acc[u];
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

// GCC/clang vector extensions: 16 floats, lowered to whatever the -march target has (one zmm, two ymm, ...).
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
// Loads and stores through an unaligned, may_alias vector type rather than memcpy: GCC expands a 64-byte memcpy
// by the tuning's -mmove-max, which is 256 bits for Ice Lake / Rocket Lake cores (-march=native on some Xeon VMs
// reports Rocket Lake); every ld16/st16 then bounced through the stack as two ymm halves and the kernel ran ~10x
// slower than with -mtune=generic (measured, benchmarks/results/cpu_xeon_amx_2026-12-02/).
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));

inline v16 ld16(const float* p) { return *reinterpret_cast<const v16u*>(p); }

inline void st16(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }

typedef float v4u __attribute__((vector_size(16), aligned(4), may_alias));

inline v4 ld4(const float* p) { return *reinterpret_cast<const v4u*>(p); }

inline void st4(float* p, v4 x) { *reinterpret_cast<v4u*>(p) = x; }
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// 16 consecutive values of a K/V row as float32 (bfloat16 widened exactly: its bits are a float's top half)
inline v16 row16(const float* p) { return ld16(p); }
inline v16 row16(const c10::BFloat16* p) {
  return (v16)(__builtin_convertvector(*reinterpret_cast<const u16x16*>(p), u32x16) << 16);
}

// Ask for n rows of D values, rs elements apart, to be brought into cache.
template <typename T>
inline void prefetch_rows(const T* p, int64_t rs, int64_t n, int64_t D) {
  for (int64_t i = 0; i < n; ++i) {
    const char* row = reinterpret_cast<const char*>(p + i * rs);
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(row + b);
  }
}

// Pass 3 for one tile of keys [j0, j1) and G <= 8 query heads (G a constant, so their accumulators stay in
// registers): o[gi] += e[gi, j] * v[j], chunk by chunk of 16, each V chunk loaded once for all G heads. Keys in
// order, one fused multiply-add each: the same sums as key-by-key. Masked keys are skipped, never read.
template <int G, typename T>
void values_tile(const float* e, int64_t ld, const T* vb, int64_t vs, const float* bias, int64_t j0, int64_t j1,
                 int64_t D, float* o) {
  prefetch_rows(vb + j1 * vs, vs, j1 - j0, D);  // the next tile's rows, while this one is summed
  for (int64_t c = 0; c < D; c += 16) {
    v16 acc[G];
    for (int gi = 0; gi < G; ++gi) acc[gi] = ld16(o + gi * D + c);
    for (int64_t j = j0; j < j1; ++j) {
      if (bias[j] == kNegInf) continue;
      const v16 w = row16(vb + j * vs + c);
      for (int gi = 0; gi < G; ++gi) acc[gi] += e[gi * ld + j] * w;
    }
    for (int gi = 0; gi < G; ++gi) st16(o + gi * D + c, acc[gi]);
  }
}

template <typename T>
void values_tile_any(int G, const float* e, int64_t ld, const T* vb, int64_t vs, const float* bias, int64_t j0,
                     int64_t j1, int64_t D, float* o) {
  switch (G) {
    case 1: return values_tile<1>(e, ld, vb, vs, bias, j0, j1, D, o);
    case 2: return values_tile<2>(e, ld, vb, vs, bias, j0, j1, D, o);
    case 3: return values_tile<3>(e, ld, vb, vs, bias, j0, j1, D, o);
    case 4: return values_tile<4>(e, ld, vb, vs, bias, j0, j1, D, o);
    case 5: return values_tile<5>(e, ld, vb, vs, bias, j0, j1, D, o);
    case 6: return values_tile<6>(e, ld, vb, vs, bias, j0, j1, D, o);
    case 7: return values_tile<7>(e, ld, vb, vs, bias, j0, j1, D, o);
    default: return values_tile<8>(e, ld, vb, vs, bias, j0, j1, D, o);
  }
}

constexpr int64_t kValueTile = 64;  // keys per tile: 64 V rows stay in L1 while each 16-wide chunk is summed

// the four sums of four 16-lane accumulators, in one shuffle tree (cheaper than four horizontal sums)
inline v4 hsum4(v16 a, v16 b, v16 c, v16 d) {
  const v8 a8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 b8 = __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 c8 = __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 d8 = __builtin_shufflevector(d, d, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(d, d, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 ab = __builtin_shufflevector(a8, b8, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a8, b8, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8 cd = __builtin_shufflevector(c8, d8, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(c8, d8, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8 x = __builtin_shufflevector(ab, cd, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(ab, cd, 2, 3, 10, 11, 6, 7, 14, 15);
  const v4 r = __builtin_shufflevector(x, x, 0, 2, 4, 6) + __builtin_shufflevector(x, x, 1, 3, 5, 7);  // a c b d
  return __builtin_shufflevector(r, r, 0, 2, 1, 3);
}

#ifdef __AVX512F__
// 16 keys' logits at a time where there are 32 vector registers: the 16 accumulators' sums by a transpose
// tree (30 two-source shuffles and 15 adds for 16 dots; hsum4 costs ~5 operations a dot). Each step adds the
// two halves of every key's partial sums, keeping keys in order.
#define KVTIER_KEYS16 1
inline v16 halve8(v16 a, v16 b) {  // keys a, b (16 partials each) -> [a(8) b(8)]
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline v16 halve4(v16 a, v16 b) {  // [k0(8) k1(8)], [k2(8) k3(8)] -> [k0(4) k1(4) k2(4) k3(4)]
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
inline v16 halve2(v16 a, v16 b) {  // 4 keys x 4 partials twice -> 8 keys x 2
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
inline v16 halve1(v16 a, v16 b) {  // 8 keys x 2 partials twice -> the 16 sums
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
inline v16 hsum16(const v16* a) {
  v16 p[8], q[4];
  for (int i = 0; i < 8; ++i) p[i] = halve8(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 4; ++i) q[i] = halve4(p[2 * i], p[2 * i + 1]);
  return halve1(halve2(q[0], q[1]), halve2(q[2], q[3]));
}
#endif

inline float sum(const float* a, int64_t n) {
  float acc[16] = {0.f};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int u = 0; u < 16; ++u) acc[u] += a[j + u];
  float s = 0.f;
  for (int u = 0; u < 16; ++u) s += acc[u];
  for (; j < n; ++j) s += a[j];
  return s;
}

// exp(x) for x <= 0 (x = s - max); exactly 0 below -87 (and for -inf). Range reduction x = n ln2 + r and a
// degree-6 polynomial for exp(r) on |r| <= ln2/2 (relative error ~2e-7); branch-free so loops vectorise.
inline float exp_nonpos(float x) {
  const float xc = x < -87.f ? -87.f : x;
  // n = round(xc / ln2) by the 1.5 * 2^23 trick: pure arithmetic (a floor() call keeps GCC from vectorising),
  // and n's integer sits in f's low mantissa bits
  const float f = xc * 1.44269504088896341f + 12582912.f;
  const float n = f - 12582912.f;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  int32_t fi;
  std::memcpy(&fi, &f, sizeof fi);
  const int32_t bits = (fi - 0x4B400000 + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : y * scale;
}

// q rows as bfloat16 (truncated) into qb; true when that is exact, i.e. q came from a bfloat16 model, so the
// bf16 dot product below computes the same products as the float32 one (bf16 x bf16 is exact in float32).
inline bool q_as_bf16(const float* q, uint16_t* qb, int64_t n) {
  uint32_t lost = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, q + i, sizeof bits);
    qb[i] = static_cast<uint16_t>(bits >> 16);
    lost |= bits & 0xFFFFu;
  }
  return lost == 0;
}

#ifdef KVTIER_DPBF16
// Four keys' dot products with one query head, bf16 pairs multiplied and accumulated in float32 by VDPBF16PS
// (two products per lane and instruction, no conversion of K): D a multiple of 32.
inline v4 dots4_bf16(const uint16_t* qg, const uint16_t* k0, const uint16_t* k1, const uint16_t* k2,
                     const uint16_t* k3, int64_t D) {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps(), c = _mm512_setzero_ps(), d = _mm512_setzero_ps();
  for (int64_t t = 0; t < D; t += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + t);
    a = _mm512_dpbf16_ps(a, qv, (__m512bh)_mm512_loadu_si512(k0 + t));
    b = _mm512_dpbf16_ps(b, qv, (__m512bh)_mm512_loadu_si512(k1 + t));
    c = _mm512_dpbf16_ps(c, qv, (__m512bh)_mm512_loadu_si512(k2 + t));
    d = _mm512_dpbf16_ps(d, qv, (__m512bh)_mm512_loadu_si512(k3 + t));
  }
  return hsum4((v16)a, (v16)b, (v16)c, (v16)d);
}
#endif

#ifdef KVTIER_AMX
// Logits by AMX tiles (Sapphire Rapids and later): 16 keys at a time, S^T (16 keys x heads) = K (16 x D, read in
// place: K's rows are the tile's rows) x Q^T (D x heads, in the pair-interleaved layout TDPBF16PS takes, built once
// per (row, kv-head)). Products of bf16 pairs are exact in float32; the sums are float32 in the tile's order.
// Tiles: tmm0 the 16 x 16 float32 result, tmm1 one 32-wide slice of K, tmm2.. the D / 32 slices of Q^T.
constexpr int64_t kAmxMaxD = 192;  // six Q^T slices in tmm2..tmm7
constexpr int64_t kAmxMaxG = 16;   // query heads per kv-head: the result's 16 columns

std::atomic<bool> g_amx_enabled{true};  // a switch for tests and A/B timing (set_amx)

inline void amx_load_q(int slice, const uint16_t* p) {  // tile numbers are immediates
  switch (slice) {
    case 0: _tile_loadd(2, p, 64); break;
    case 1: _tile_loadd(3, p, 64); break;
    case 2: _tile_loadd(4, p, 64); break;
    case 3: _tile_loadd(5, p, 64); break;
    case 4: _tile_loadd(6, p, 64); break;
    default: _tile_loadd(7, p, 64); break;
  }
}

inline void amx_dot_slice(int slice) {
  switch (slice) {
    case 0: _tile_dpbf16ps(0, 1, 2); break;
    case 1: _tile_dpbf16ps(0, 1, 3); break;
    case 2: _tile_dpbf16ps(0, 1, 4); break;
    case 3: _tile_dpbf16ps(0, 1, 5); break;
    case 4: _tile_dpbf16ps(0, 1, 6); break;
    default: _tile_dpbf16ps(0, 1, 7); break;
  }
}

// q (g x D bf16 bits) as the D / 32 slices of Q^T, pair-interleaved: slice c, row p, column n = q[n, 32c + 2p + e]
// at element 2n + e; columns n >= g are 0. Then loaded into tmm2...
inline void amx_set_query(const uint16_t* qb, int64_t g, int64_t D, uint16_t* qt) {
  const int64_t slices = D / 32;
  std::fill(qt, qt + slices * 512, uint16_t{0});
  for (int64_t c = 0; c < slices; ++c)
    for (int64_t p = 0; p < 16; ++p)
      for (int64_t n = 0; n < g; ++n)
        for (int e = 0; e < 2; ++e) qt[c * 512 + p * 32 + 2 * n + e] = qb[n * D + 32 * c + 2 * p + e];
  for (int64_t c = 0; c < slices; ++c) amx_load_q(static_cast<int>(c), qt + c * 512);
}

// 16 keys' dot products with every query head: out[u * 16 + n] (key u, head n), keys rs elements apart.
inline void amx_dots16(const uint16_t* k, int64_t rs, int64_t D, float* out) {
  _tile_zero(0);
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(1, k + 32 * c, rs * 2);
    amx_dot_slice(static_cast<int>(c));
  }
  _tile_stored(0, out, 64);
}
#endif

struct Region {
  const void* k;
  const void* v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;  // element strides of (B, H, C) (the last dim is contiguous)
  const float* bias;
  int64_t bs0;  // bias row stride
  const int64_t* pos;
  int64_t ps0;
  int64_t C;
  double* scores;  // accumulator of this region's positions (B, N + 1), row stride ss0
  int64_t ss0;
  int64_t width;  // its N + 1 columns: every position is checked against it
  bool staged;    // copied block by block into the thread's staging buffer before it is read (see the top)
};

// Staging accounting, read from Python. The time: nanoseconds the workers spent copying staged blocks, summed over
// the workers of each call and kept per *calling* thread (read and reset by that thread), so that caches decoding
// in different threads do not take one another's time. The bytes held by the workers' staging buffers are the
// process's (the pool is shared; they only grow).
thread_local int64_t t_caller_stage_ns = 0;
std::atomic<int64_t> g_stage_buffer_bytes{0};

// Rows of a staged region copied at a time: ~8 KiB of K or V, in whole value tiles (hence whole 16-key blocks), at
// least one tile. The chunk and the next one's prefetched source both stay in L1: 4 batches x 8192 tokens x 24
// layers bf16, T1 70%, 2-core AMX Xeon: 1.17x the in-place call with 32 KiB chunks, 1.08x with 8 or 16 KiB.
inline int64_t staged_rows(int64_t D, size_t elem) {
  const int64_t rows = (int64_t{8} << 10) / (D * static_cast<int64_t>(elem)) / kValueTile * kValueTile;
  return rows > kValueTile ? rows : kValueTile;
}

// The copies' clock: the time-stamp counter where there is one (a steady_clock read per chunk, two per 8 KiB, was
// ~4% of the streamed call above), else steady_clock's nanoseconds. A call converts its ticks to nanoseconds by
// the ticks and nanoseconds that pass across the whole call (run): no calibration, and 1:1 where ticks are ns.
inline int64_t stage_ticks() {
#if defined(__x86_64__)
  return static_cast<int64_t>(__rdtsc());
#else
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
#endif
}

// A chunk of a staged region's (b, h) block of K or V, C rows of D values at row stride rs, copied into the thread's
// staging buffer; returns the copy, rows D apart. The time, in stage_ticks, goes to ticks.
template <typename T>
const T* stage_block(const T* src, int64_t rs, int64_t C, int64_t D, std::vector<float>& buf, int64_t& ticks) {
  const int64_t t0 = stage_ticks();
  const size_t need = (static_cast<size_t>(C * D) * sizeof(T) + sizeof(float) - 1) / sizeof(float);
  if (buf.size() < need) {
    g_stage_buffer_bytes += static_cast<int64_t>((need - buf.size()) * sizeof(float));
    buf.resize(need);
  }
  T* dst = reinterpret_cast<T*>(buf.data());
  if (rs == D) {
    std::memcpy(dst, src, static_cast<size_t>(C * D) * sizeof(T));
  } else {
    for (int64_t j = 0; j < C; ++j) std::memcpy(dst + j * D, src + j * rs, static_cast<size_t>(D) * sizeof(T));
  }
  ticks += stage_ticks() - t0;
  return dst;
}

// Rows of region r a pass takes at a time: a staged region's chunk, else the whole region (at least 1).
inline int64_t chunk_rows(const Region& r, int64_t D, size_t elem) {
  return r.staged ? staged_rows(D, elem) : (r.C > 0 ? r.C : 1);
}

// Rows [c0, c0 + n) of a region's (b, h) block of K or V (src, rows rs apart): read in place, or (staged) from
// the thread's staging copy, rows D apart, with the next chunk's source to prefetch (none after the last chunk).
template <typename T>
struct Chunk {
  const T* p;
  int64_t rs;
  const T* next;
  int64_t n;
};

template <typename T>
Chunk<T> chunk_at(const T* src, int64_t rs, const Region& r, int64_t c0, int64_t step, int64_t D,
                  std::vector<float>& buf, int64_t& ticks) {
  const int64_t n = r.C - c0 < step ? r.C - c0 : step;
  const T* p = src + c0 * rs;
  if (!r.staged) return {p, rs, nullptr, n};
  return {stage_block(p, rs, n, D, buf, ticks), D, c0 + n < r.C ? p + n * rs : nullptr, n};
}

// Whether the 16 keys at bias are all masked; if so, their logits (g rows of s, ld apart) are set to -inf.
inline bool masked16(const float* bias, float* s, int64_t g, int64_t ld) {
  bool any = false;
  for (int u = 0; u < 16; ++u) any |= bias[u] != kNegInf;
  if (any) return false;
  for (int64_t gi = 0; gi < g; ++gi)
    for (int u = 0; u < 16; ++u) s[gi * ld + u] = kNegInf;
  return true;
}

// One key's logits for the g query heads (stride ld in s), the running max updated.
inline void logits_one_key(const float* qh, const float* kr, float bias, float scaling, int64_t g, int64_t D,
                           float* s, int64_t ld, float* m) {
  for (int64_t gi = 0; gi < g; ++gi) {
    const float x = dot(qh + gi * D, kr, D) * scaling + bias;
    s[gi * ld] = x;
    m[gi] = x > m[gi] ? x : m[gi];
  }
}

// o[gi] += e[gi] * v for one key, e read with stride ld from s.
inline void add_one_value(const float* e, int64_t ld, const float* vr, int64_t g, int64_t D, float* o) {
  for (int64_t gi = 0; gi < g; ++gi) {
    const float eg = e[gi * ld];
    float* og = o + gi * D;
    for (int64_t d = 0; d < D; ++d) og[d] += eg * vr[d];
  }
}

// The (b, h) pairs [begin, end). q and out (B, H, g, D) contiguous, float32 or bfloat16 (QO): the query is widened
// and the output rounded here, per head, rather than by two tensor conversions per layer around the call.
// A function of its own, every size passed by value and each Region copied into a local: the vector stores below
// may alias anything, and a size read through the lambda's captured references (or a Region in memory) would be
// reloaded after each of them.
template <typename T, typename QO>
void run_rows(int64_t begin, int64_t end, const QO* q, QO* out, float* w, const std::vector<Region>& regs,
              int64_t H, int64_t g, int64_t D, int64_t Ctot, float scaling, bool want_scores,
              std::atomic<int64_t>& call_stage_ticks, const float* sinks) {
  thread_local std::vector<float> s_buf, tmp_buf, o_buf, m_buf, l_buf, qf_buf;
  thread_local std::vector<uint16_t> qb_buf;
  thread_local std::vector<float> stage_buf;  // a staged region's block (K, then V): reused, kept between calls
  int64_t copy_ticks = 0;
  thread_local std::vector<v4> m4_buf;
  m4_buf.resize(static_cast<size_t>(g));
  v4* m4 = m4_buf.data();
  thread_local std::vector<v16> m16_buf;
  m16_buf.resize(static_cast<size_t>(g));
  v16* m16 = m16_buf.data();
  s_buf.resize(static_cast<size_t>(g * Ctot));
  qb_buf.resize(static_cast<size_t>(g * D));
  tmp_buf.resize(static_cast<size_t>(4 * D));
  o_buf.resize(static_cast<size_t>(g * D));
  m_buf.resize(static_cast<size_t>(g));
  l_buf.resize(static_cast<size_t>(g));
  qf_buf.resize(static_cast<size_t>(g * D));
#ifdef KVTIER_AMX
  alignas(64) float amx_out[256];
  alignas(64) uint16_t amx_qt[kAmxMaxD / 32 * 512];
  const bool amx_shape = std::is_same<T, c10::BFloat16>::value && D % 32 == 0 && D <= kAmxMaxD && g <= kAmxMaxG &&
                         g_amx_enabled.load(std::memory_order_relaxed) && kvtier_amx::permitted();
  bool amx_configured = false;
#endif
  float* s = s_buf.data();
  float* tmp = tmp_buf.data();
  float* o = o_buf.data();
  float* m = m_buf.data();
  float* l = l_buf.data();
  uint16_t* qb = qb_buf.data();
  for (int64_t t = begin; t < end; ++t) {
    const int64_t b = t / H, h = t % H;
    const float* qh = as_float<QO>(q + t * g * D, qf_buf.data(), g * D);  // q is (B, H, g, D) contiguous
    for (int64_t gi = 0; gi < g; ++gi) m[gi] = kNegInf;
    for (int64_t gi = 0; gi < g; ++gi) m4[gi] = v4{kNegInf, kNegInf, kNegInf, kNegInf};  // the blocks' maxima
    for (int64_t gi = 0; gi < g; ++gi) m16[gi] = v16{} + kNegInf;
    bool bf16_dots = false;
#ifdef KVTIER_DPBF16
    if (std::is_same<T, c10::BFloat16>::value && D % 32 == 0) bf16_dots = q_as_bf16(qh, qb, g * D);
#endif
#ifdef KVTIER_AMX
    const bool amx = amx_shape && bf16_dots;
    if (amx) {
      if (!amx_configured) {  // per call of this function: another library may have released the tiles since
        kvtier_amx::configure();
        amx_configured = true;
      }
      amx_set_query(qb, g, D, amx_qt);
    }
#endif
    // The last region's closed columns (a buffer's capacity past its last open slot, up to a third of a
    // growing cache) are not visited: that region stops at the 16-key block holding its last open column, so
    // every open key keeps its block and path, and the sums below keep their lanes (only where the open
    // columns all fall in sum()'s 16-lane part either way: the same floats as over the whole buffer).
    const Region& tail = regs.back();
    const float* tb = tail.bias + b * tail.bs0;
    int64_t open_end = tail.C;
    while (open_end > 0 && tb[open_end - 1] == kNegInf) --open_end;
    int64_t tail_c = (open_end + 15) / 16 * 16;
    int64_t n_live = Ctot - tail.C + tail_c;  // columns visited: s and w hold them; the rest weigh 0
    if (tail_c >= tail.C || n_live / 16 * 16 < Ctot - tail.C + open_end) {
      tail_c = tail.C;
      n_live = Ctot;
    }
    const auto region = [&regs, tail_c](size_t ri) {  // a local copy, the last one cut to its live columns
      Region r = regs[ri];
      if (ri + 1 == regs.size()) r.C = tail_c;
      return r;
    };
    // pass 1: logits, running max. Blocks of 4 keys share each query load (D a multiple of 16); a masked
    // column's logit is computed from whatever its slot holds and then replaced by -inf.
    int64_t off = 0;
    for (size_t ri = 0; ri < regs.size(); ++ri) {
      const Region r = region(ri);
      const T* src = static_cast<const T*>(r.k) + b * r.ks0 + h * r.ks1;
      // a staged region goes chunk by chunk (staged_rows): each chunk copied just before it is read, the next
      // chunk's source prefetched while this one is computed (so the copy reads cache, not memory); chunks are
      // whole 16-key blocks, so every key keeps its block, its lanes and its path: the floats do not change
      const int64_t step = chunk_rows(r, D, sizeof(T));
      for (int64_t c0 = 0; c0 < r.C; c0 += step) {
        const Chunk<T> c = chunk_at(src, r.ks2, r, c0, step, D, stage_buf, copy_ticks);
        const T* kb = c.p;
        const int64_t ks2 = c.rs, n = c.n;
        // in place: the next block (two blocks ahead, or none, was slower: 32 rows x 384 keys x 24 layers, bf16,
        // 2-core AMX Xeon, cold: 17.7 / 18.7 vs 16.4-16.6 ms); staged: the next chunk's source, its row j with this
        // chunk's block j
        const T* pf = r.staged ? c.next : kb + 16 * ks2;
        const int64_t pfs = r.staged ? r.ks2 : ks2;
        // in place: this block's V rows too, read by pass 3 after the exponentials; asked for now, they come from
        // memory beside the K stream instead of after it (18.3 -> 17.2 ms in the measure above, with K two ahead)
        const T* pv = r.staged ? nullptr : static_cast<const T*>(r.v) + b * r.vs0 + h * r.vs1 + c0 * r.vs2;
        const float* bias = r.bias + b * r.bs0 + c0;
        const int64_t o0 = off + c0;
        int64_t j = 0;
#ifdef KVTIER_AMX
        if (amx) {
          for (; j + 16 <= n; j += 16) {
            if (masked16(bias + j, s + o0 + j, g, Ctot)) continue;
            // the tile loads stall on memory without this: the next block (prefetches never fault past the end)
            if (pf) prefetch_rows(pf + j * pfs, pfs, 16, D);
            if (pv) prefetch_rows(pv + j * r.vs2, r.vs2, 16, D);
            amx_dots16(reinterpret_cast<const uint16_t*>(kb + j * ks2), ks2, D, amx_out);
            const v16 b16 = ld16(bias + j);
            const __m512i rows16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                      _mm512_set1_epi32(16));
            for (int64_t gi = 0; gi < g; ++gi) {
              // head gi's 16 logits: column gi of the result (key u at row u)
              const v16 col = (v16)_mm512_i32gather_ps(rows16, amx_out + gi, 4);
              const v16 x = b16 == kNegInf ? b16 : col * scaling + b16;  // a masked slot's dot may be NaN
              st16(s + gi * Ctot + o0 + j, x);
              m16[gi] = x > m16[gi] ? x : m16[gi];
            }
          }
        }
#endif
#ifdef KVTIER_KEYS16
        // blocks of 16 keys (float32 K, or bf16 K with bf16 dots): one query load serves 16 keys, one hsum16
        // gives 16 logits. A float32 query over bf16 K goes by 4 (its K rows are widened into tmp).
        if (D % 16 == 0 && (std::is_same<T, float>::value || bf16_dots)) {
          for (; j + 16 <= n; j += 16) {
            if (masked16(bias + j, s + o0 + j, g, Ctot)) continue;
            const T* kj = kb + j * ks2;
            if (pf) prefetch_rows(pf + j * pfs, pfs, 16, D);
            if (pv) prefetch_rows(pv + j * r.vs2, r.vs2, 16, D);
            for (int64_t gi = 0; gi < g; ++gi) {
              v16 acc[16] = {};
#ifdef KVTIER_DPBF16
              if (bf16_dots) {
                const uint16_t* qg = qb + gi * D;
                const uint16_t* k16 = reinterpret_cast<const uint16_t*>(kj);
                for (int64_t t2 = 0; t2 < D; t2 += 32) {
                  const __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + t2);
                  for (int u = 0; u < 16; ++u)
                    acc[u] = (v16)_mm512_dpbf16_ps((__m512)acc[u], qv,
                                                   (__m512bh)_mm512_loadu_si512(k16 + u * ks2 + t2));
                }
              } else
#endif
              {
                const float* qg = qh + gi * D;
                const float* kf = reinterpret_cast<const float*>(kj);
                for (int64_t t4 = 0; t4 < D; t4 += 16) {
                  const v16 qv = ld16(qg + t4);
                  for (int u = 0; u < 16; ++u) acc[u] += qv * ld16(kf + u * ks2 + t4);
                }
              }
              const v16 dots = hsum16(acc);
              const v16 b16 = ld16(bias + j);
              const v16 x = b16 == kNegInf ? b16 : dots * scaling + b16;  // a masked slot's dot may be NaN
              st16(s + gi * Ctot + o0 + j, x);
              m16[gi] = x > m16[gi] ? x : m16[gi];
            }
          }
        }
#endif
        if (D % 16 == 0) {
          for (; j + 4 <= n; j += 4) {
            if (r.staged && pf && j % 16 == 0) prefetch_rows(pf + j * pfs, pfs, 16, D);
            if (bias[j] == kNegInf && bias[j + 1] == kNegInf && bias[j + 2] == kNegInf && bias[j + 3] == kNegInf) {
              for (int64_t gi = 0; gi < g; ++gi)
                for (int u = 0; u < 4; ++u) s[gi * Ctot + o0 + j + u] = kNegInf;
              continue;
            }
            const float* k0 = nullptr;
            const float* k1 = nullptr;
            const float* k2 = nullptr;
            const float* k3 = nullptr;
            if (!bf16_dots) {
              k0 = as_float<T>(kb + j * ks2, tmp, D);
              k1 = as_float<T>(kb + (j + 1) * ks2, tmp + D, D);
              k2 = as_float<T>(kb + (j + 2) * ks2, tmp + 2 * D, D);
              k3 = as_float<T>(kb + (j + 3) * ks2, tmp + 3 * D, D);
            }
            for (int64_t gi = 0; gi < g; ++gi) {
              v4 dots;
#ifdef KVTIER_DPBF16
              if (bf16_dots) {
                const uint16_t* kj = reinterpret_cast<const uint16_t*>(kb + j * ks2);
                dots = dots4_bf16(qb + gi * D, kj, kj + ks2, kj + 2 * ks2, kj + 3 * ks2, D);
              } else
#endif
              {
                const float* qg = qh + gi * D;
                v16 a = {}, c1 = {}, c2 = {}, c3 = {};
                for (int64_t t4 = 0; t4 < D; t4 += 16) {
                  const v16 qv = ld16(qg + t4);
                  a += qv * ld16(k0 + t4);
                  c1 += qv * ld16(k1 + t4);
                  c2 += qv * ld16(k2 + t4);
                  c3 += qv * ld16(k3 + t4);
                }
                dots = hsum4(a, c1, c2, c3);
              }
              const v4 b4 = ld4(bias + j);
              const v4 x = b4 == kNegInf ? b4 : dots * scaling + b4;  // a masked slot's dot may be NaN
              st4(s + gi * Ctot + o0 + j, x);
              m4[gi] = x > m4[gi] ? x : m4[gi];
            }
          }
        }
        for (; j < n; ++j) {
          const float bj = bias[j];
          if (bj == kNegInf) {
            for (int64_t gi = 0; gi < g; ++gi) s[gi * Ctot + o0 + j] = kNegInf;
            continue;
          }
          logits_one_key(qh, as_float<T>(kb + j * ks2, tmp, D), bj, scaling, g, D, s + o0 + j, Ctot, m);
        }
      }
      off += r.C;
    }
    for (int64_t gi = 0; gi < g; ++gi) {
      for (int u = 0; u < 4; ++u) m[gi] = m4[gi][u] > m[gi] ? m4[gi][u] : m[gi];
      for (int u = 0; u < 16; ++u) m[gi] = m16[gi][u] > m[gi] ? m16[gi][u] : m[gi];
      if (sinks) m[gi] = sinks[h * g + gi] > m[gi] ? sinks[h * g + gi] : m[gi];  // the sink's logit competes too
    }
    // pass 2: exp(s - m) in place, sums (a row without any key gets weights 0 and output 0, never NaN)
    for (int64_t gi = 0; gi < g; ++gi) {
      float* sg = s + gi * Ctot;
      const float mg = m[gi] == kNegInf ? 0.f : m[gi];
      for (int64_t j = 0; j < n_live; ++j) sg[j] = exp_nonpos(sg[j] - mg);  // no reduction here: vectorises
      l[gi] = sum(sg, n_live);
      if (sinks) l[gi] += exp_nonpos(sinks[h * g + gi] - mg);  // a logit with no value: the denominator only
    }
    // pass 3: values, tile by tile of keys and 8 query heads at a time (values_tile); with D not a multiple
    // of 16, key by key. Masked keys are never read (their slots may hold anything).
    std::fill(o, o + g * D, 0.f);
    off = 0;
    for (size_t ri = 0; ri < regs.size(); ++ri) {
      const Region r = region(ri);
      const T* src = static_cast<const T*>(r.v) + b * r.vs0 + h * r.vs1;
      // chunk by chunk as in pass 1 (whole value tiles; keys are summed in order either way)
      const int64_t step = chunk_rows(r, D, sizeof(T));
      for (int64_t c0 = 0; c0 < r.C; c0 += step) {
        const Chunk<T> c = chunk_at(src, r.vs2, r, c0, step, D, stage_buf, copy_ticks);
        const T* vb = c.p;
        const T* pf = c.next;
        const int64_t vs2 = c.rs, n = c.n;
        const float* bias = r.bias + b * r.bs0 + c0;
        const float* e = s + off + c0;
        if (D % 16 == 0) {
          for (int64_t j0 = 0; j0 < n; j0 += kValueTile) {
            const int64_t j1 = j0 + kValueTile < n ? j0 + kValueTile : n;
            if (pf) prefetch_rows(pf + j0 * r.vs2, r.vs2, j1 - j0, D);
            for (int64_t g0 = 0; g0 < g; g0 += 8)
              values_tile_any<T>(static_cast<int>(g - g0 < 8 ? g - g0 : 8), e + g0 * Ctot, Ctot, vb, vs2, bias, j0,
                                 j1, D, o + g0 * D);
          }
        } else {
          for (int64_t j = 0; j < n; ++j) {
            if (bias[j] == kNegInf) continue;
            add_one_value(e + j, Ctot, as_float<T>(vb + j * vs2, tmp, D), g, D, o);
          }
        }
      }
      off += r.C;
    }
    QO* oh = out + t * g * D;
    for (int64_t gi = 0; gi < g; ++gi) {
      const float inv = l[gi] > 0.f ? 1.f / l[gi] : 0.f;
      for (int64_t d = 0; d < D; ++d) oh[gi * D + d] = static_cast<QO>(o[gi * D + d] * inv);
    }
    if (want_scores) {
      // merged weight of each key summed over the group's query heads: w[b, h, j] (B, H, Ctot)
      float* wh = w + t * Ctot;
      std::fill(wh, wh + Ctot, 0.f);
      for (int64_t gi = 0; gi < g; ++gi) {
        const float inv = l[gi] > 0.f ? 1.f / l[gi] : 0.f;
        const float* sg = s + gi * Ctot;
        for (int64_t j = 0; j < n_live; ++j) wh[j] += sg[j] * inv;
      }
    }
  }
#ifdef KVTIER_AMX
  if (amx_configured) _tile_release();  // leave the tiles as found: unconfigured
#endif
  if (copy_ticks) call_stage_ticks += copy_ticks;
}

// Row b's merged weights (H, Ctot at w, that row's) added to its regions' accumulators, columns [j0, j1): each kept
// column's kv-heads summed in order (float64), times scale, added at its position. Any split of a row's columns,
// or of the rows, gives the same floats: within a row the live columns hold distinct positions (a token lives in
// one place), so each accumulator cell gets at most one add per call.
void fold_row(const float* w, const std::vector<Region>& regs, int64_t b, int64_t H, int64_t Ctot, double scale,
              int64_t j0, int64_t j1) {
  int64_t off = 0;
  for (const Region& r : regs) {
    const int64_t lo = std::max(j0, off) - off, hi = std::min(j1, off + r.C) - off;
    const float* bias = r.bias + b * r.bs0;
    const int64_t* pos = r.pos + b * r.ps0;
    double* sc = r.scores + b * r.ss0;
    const float* wr = w + off;
    int64_t j = lo;
#if defined(__AVX512F__) && defined(__AVX512CD__) && defined(__AVX512VL__)
    // 8 columns at a time: the same operations per column as the loop below (kv-heads summed in order, one fused
    // multiply-add into the cell), gathered and scattered; a block whose kept positions repeat (never, in a
    // cache) goes column by column. 4 rows x 8192 tokens x 24 layers bf16, 2-core AMX Xeon: the fold was ~7% of
    // the call column by column, ~3% so.
    const __m512d vscale = _mm512_set1_pd(scale);
    const __m512i vwidth = _mm512_set1_epi64(r.width), vzero = _mm512_setzero_si512();
    const __m512i viota = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
    for (; j + 8 <= hi; j += 8) {
      const __mmask8 keep = _mm256_cmp_ps_mask(_mm256_loadu_ps(bias + j), _mm256_set1_ps(kNegInf), _CMP_NEQ_UQ);
      if (!keep) continue;
      const __m512i p = _mm512_loadu_si512(pos + j);
      const __mmask8 bad = _mm512_mask_cmplt_epi64_mask(keep, p, vzero) | _mm512_mask_cmpge_epi64_mask(keep, p, vwidth);
      const __m512i dup = _mm512_maskz_conflict_epi64(keep, p);  // per kept lane: the earlier lanes it equals
      if (bad || _mm512_mask_test_epi64_mask(keep, dup, _mm512_set1_epi64(keep))) break;  // the loop below says why
      __m512d acc = _mm512_setzero_pd();
      for (int64_t h = 0; h < H; ++h) acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_loadu_ps(wr + h * Ctot + j)));
      const int64_t p0 = pos[j];
      if (_mm512_cmpeq_epi64_mask(p, _mm512_add_epi64(_mm512_set1_epi64(p0), viota)) == 0xff) {
        // consecutive positions (a buffer in token order: the full cache, the recent tail): no gather
        double* c = sc + p0;
        _mm512_mask_storeu_pd(c, keep, _mm512_fmadd_pd(vscale, acc, _mm512_maskz_loadu_pd(keep, c)));
      } else {
        const __m512d old = _mm512_mask_i64gather_pd(_mm512_setzero_pd(), keep, p, sc, 8);
        _mm512_mask_i64scatter_pd(sc, keep, p, _mm512_fmadd_pd(vscale, acc, old), 8);
      }
    }
#endif
    for (; j < hi; ++j) {
      if (bias[j] == kNegInf) continue;
      double acc = 0.0;
      for (int64_t h = 0; h < H; ++h) acc += static_cast<double>(wr[h * Ctot + j]);
      TORCH_CHECK(pos[j] >= 0 && pos[j] < r.width, "score position ", pos[j], " outside [0, ", r.width, ")");
      sc[pos[j]] = std::fma(scale, acc, sc[pos[j]]);
    }
    off += r.C;
  }
}

// Every row's weights w (B, H, Ctot) folded: split over (row, column), not rows alone (at batch 1 a split by rows
// leaves every thread but one idle). The grain keeps a short call (one small row of a rows call) on the calling
// thread.
void fold_scores(const float* w, const std::vector<Region>& regs, int64_t B, int64_t H, int64_t Ctot, double scale) {
  constexpr int64_t kFoldGrain = 2048;
  at::parallel_for(0, B * Ctot, kFoldGrain, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end;) {
      const int64_t b = idx / Ctot, j0 = idx % Ctot;
      const int64_t j1 = std::min(Ctot, j0 + (end - idx));  // this chunk's columns of row b: [j0, j1)
      fold_row(w + b * H * Ctot, regs, b, H, Ctot, scale, j0, j1);
      idx += j1 - j0;
    }
  });
}

template <typename T, typename QO>
void run(const QO* q, QO* out, float* w, const std::vector<Region>& regs, int64_t B, int64_t H, int64_t g,
         int64_t D, int64_t Ctot, float scaling, bool want_scores, const float* sinks) {
  std::atomic<int64_t> call_stage_ticks{0};
  bool staged = false;
  for (const Region& r : regs) staged |= r.staged;
  const auto c0 = staged ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  const int64_t k0 = staged ? stage_ticks() : 0;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    run_rows<T, QO>(begin, end, q, out, w, regs, H, g, D, Ctot, scaling, want_scores, call_stage_ticks, sinks);
  });
  const int64_t ticks = call_stage_ticks.load();
  if (ticks > 0) {  // the workers' ticks in nanoseconds, at the rate the call saw
    const int64_t dk = stage_ticks() - k0;
    const double dns = static_cast<double>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - c0).count());
    t_caller_stage_ns += dk > 0 ? static_cast<int64_t>(static_cast<double>(ticks) * dns / static_cast<double>(dk))
                                : 0;  // run() executes on the caller's thread
  }
}

// The regions of one call: ks/vs (B, H, C_r, D) of dtype kv_type, biases (B, 1, 1, C_r) float32, poss (B, C_r)
// int64, scores (B, N + 1) float64 per region (or none), staged flags (or none), checked and described; returns
// their total column count. `what` prefixes the errors ("region ", or "row i region ").
int64_t build_regions(const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs,
                      const std::vector<torch::Tensor>& biases, const std::vector<torch::Tensor>& poss,
                      const std::vector<torch::Tensor>& scores, const std::vector<bool>& staged, int64_t B, int64_t H,
                      int64_t D, at::ScalarType kv_type, const std::string& what, std::vector<Region>& regs) {
  const size_t R = ks.size();
  TORCH_CHECK(R >= 1 && vs.size() == R && biases.size() == R && poss.size() == R, what, "lists: one k, v, bias, pos each");
  const bool want_scores = !scores.empty();
  TORCH_CHECK(!want_scores || scores.size() == R, what, "scores: one accumulator per region, or none");
  TORCH_CHECK(staged.empty() || staged.size() == R, what, "staged: one flag per region, or none");
  int64_t Ctot = 0;
  for (size_t i = 0; i < R; ++i) {
    const auto &k = ks[i], &v = vs[i], &bias = biases[i], &pos = poss[i];
    TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.size(0) == B && k.size(1) == H && k.size(3) == D,
                what, i, ": k/v must be (B, H, C, D) matching q");
    TORCH_CHECK(k.scalar_type() == kv_type && v.scalar_type() == kv_type, what, i, ": one k/v dtype");
    TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, what, i, ": k/v last dim must be contiguous");
    const int64_t C = k.size(2);
    TORCH_CHECK(bias.dim() == 4 && bias.size(0) == B && bias.size(3) == C && bias.scalar_type() == at::kFloat &&
                    bias.stride(3) == 1, what, i, ": bias must be (B, 1, 1, C) float32");
    TORCH_CHECK(pos.dim() == 2 && pos.size(0) == B && pos.size(1) == C && pos.scalar_type() == at::kLong &&
                    pos.stride(1) == 1, what, i, ": pos must be (B, C) int64");
    Region r{k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
             v.stride(2), bias.data_ptr<float>(), bias.stride(0), pos.data_ptr<int64_t>(), pos.stride(0), C,
             nullptr, 0, 0, !staged.empty() && staged[i]};
    if (want_scores) {
      const auto& sc = scores[i];
      TORCH_CHECK(sc.dim() == 2 && sc.size(0) == B && sc.scalar_type() == at::kDouble && sc.stride(1) == 1,
                  what, i, ": scores must be (B, N + 1) float64");
      r.scores = sc.data_ptr<double>();
      r.ss0 = sc.stride(0);
      r.width = sc.size(1);
    }
    regs.push_back(r);
    Ctot += C;
  }
  return Ctot;
}

// The sinks argument: an empty tensor (none), or one float32 logit per query head (H * g, kv-head major).
const float* sink_ptr(const torch::Tensor& sinks, int64_t H, int64_t g) {
  if (!sinks.defined() || sinks.numel() == 0) return nullptr;
  TORCH_CHECK(sinks.dim() == 1 && sinks.size(0) == H * g && sinks.scalar_type() == at::kFloat && sinks.is_contiguous(),
              "sinks: (H * g,) float32 contiguous, one logit per query head, or empty");
  return sinks.data_ptr<float>();
}

// Calls f(kv_tag, q_ptr, out_ptr) with the K/V element type (a value of it: float{} or bf16{}) and q's and the
// output's pointers typed as they are: the four (K/V, query) dtype pairs the kernel is built for.
template <typename F>
void by_dtypes(at::ScalarType kv_type, torch::Tensor& q, torch::Tensor& out, F f) {
  using bf16 = c10::BFloat16;
  const bool q16 = q.scalar_type() == at::kBFloat16;
  if (kv_type == at::kFloat && !q16)
    f(float{}, q.data_ptr<float>(), out.data_ptr<float>());
  else if (kv_type == at::kFloat)
    f(float{}, q.data_ptr<bf16>(), out.data_ptr<bf16>());
  else if (!q16)
    f(bf16{}, q.data_ptr<float>(), out.data_ptr<float>());
  else
    f(bf16{}, q.data_ptr<bf16>(), out.data_ptr<bf16>());
}

}  // namespace

// q (B, H, g, D) float32 or bfloat16 contiguous; ks/vs (B, H, C_r, D) float32 or bfloat16 (same for all), last dim contiguous;
// biases (B, 1, 1, C_r) float32 (0 kept, -inf masked); poss (B, C_r) int64; scores: one (B, N + 1) float64
// accumulator per region (or an empty list: no scores); staged: one flag per region (or none), those regions are
// read through the staging buffer. Returns the normalised output (B, H, g, D) in q's dtype (float32 statistics
// and sums throughout; a bfloat16 output is rounded once, to nearest even).
torch::Tensor fused_decode(torch::Tensor q, std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs,
                           std::vector<torch::Tensor> biases, std::vector<torch::Tensor> poss,
                           std::vector<torch::Tensor> scores, double score_scale, double scaling,
                           std::vector<bool> staged, torch::Tensor sinks) {
  TORCH_CHECK(q.dim() == 4 && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) && q.is_contiguous(),
              "q: (B, H, g, D) float32 or bfloat16 contiguous");
  const int64_t B = q.size(0), H = q.size(1), g = q.size(2), D = q.size(3);
  TORCH_CHECK(!ks.empty(), "one k, v, bias, pos per region");
  const bool want_scores = !scores.empty();
  const auto kv_type = ks[0].scalar_type();
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16, "k/v: float32 or bfloat16");
  std::vector<Region> regs;
  const int64_t Ctot = build_regions(ks, vs, biases, poss, scores, staged, B, H, D, kv_type, "region ", regs);
  const float* sp = sink_ptr(sinks, H, g);
  auto out = torch::empty({B, H, g, D}, q.options());
  // the merged weights (B, H, Ctot): a buffer of the calling thread, kept between calls (no per-step allocation)
  thread_local std::vector<float> w_buf;
  if (want_scores) w_buf.resize(static_cast<size_t>(B * H * Ctot));
  float* wp = want_scores ? w_buf.data() : nullptr;
  const float sc = static_cast<float>(scaling);
  by_dtypes(kv_type, q, out, [&](auto kv_tag, auto* qp, auto* op) {
    using QO = std::remove_pointer_t<decltype(qp)>;
    run<decltype(kv_tag), QO>(qp, op, wp, regs, B, H, g, D, Ctot, sc, want_scores, sp);
  });
  if (want_scores) fold_scores(wp, regs, B, H, Ctot, score_scale);
  return out;
}

// Many one-row caches in one call (a continuous-batching step): row i (of R) attends its own regions ks[i]/vs[i]
// (1, H, C, D each) under biases[i] with positions poss[i], and adds its merged weights, times score_scales[i], to
// scores[i] (one accumulator per region, or an empty list: no scores). q (R, H, g, D) contiguous. Every (row,
// kv-head) pair is one work item of a single parallel loop, computed by the code fused_decode runs for that row
// alone (run_rows on its (0, h) pair), and each row's scores are folded as fused_decode folds a batch of 1: the same
// floats as R calls of batch 1, without R dispatches. No region may be staged (the staging time is per call).
torch::Tensor fused_decode_rows(torch::Tensor q, std::vector<std::vector<torch::Tensor>> ks,
                                std::vector<std::vector<torch::Tensor>> vs,
                                std::vector<std::vector<torch::Tensor>> biases,
                                std::vector<std::vector<torch::Tensor>> poss,
                                std::vector<std::vector<torch::Tensor>> scores, std::vector<double> score_scales,
                                double scaling, torch::Tensor sinks) {
  TORCH_CHECK(q.dim() == 4 && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) && q.is_contiguous(),
              "q: (R, H, g, D) float32 or bfloat16 contiguous");
  const int64_t R = q.size(0), H = q.size(1), g = q.size(2), D = q.size(3);
  const size_t n = static_cast<size_t>(R);
  TORCH_CHECK(ks.size() == n && vs.size() == n && biases.size() == n && poss.size() == n && scores.size() == n &&
                  score_scales.size() == n, "one list of k, v, bias, pos, scores and one score scale per row of q");
  TORCH_CHECK(!ks[0].empty(), "row 0: lists: one k, v, bias, pos each");
  const auto kv_type = ks[0][0].scalar_type();
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16, "k/v: float32 or bfloat16");
  std::vector<std::vector<Region>> regs(n);
  std::vector<int64_t> ctot(n), w_off(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    ctot[i] = build_regions(ks[i], vs[i], biases[i], poss[i], scores[i], {}, 1, H, D, kv_type,
                            "row " + std::to_string(i) + " region ", regs[i]);
    w_off[i + 1] = w_off[i] + (scores[i].empty() ? 0 : H * ctot[i]);
  }
  const float* sp = sink_ptr(sinks, H, g);  // the same model layer for every row: one set of sinks
  auto out = torch::empty({R, H, g, D}, q.options());
  thread_local std::vector<float> w_buf;  // every row's merged weights (H, Ctot_i), end to end
  w_buf.resize(static_cast<size_t>(w_off[n]));
  float* const wp = w_buf.data();  // the caller's buffer: the name w_buf in a worker would be the worker's own
  const float sc = static_cast<float>(scaling);
  std::atomic<int64_t> copy_ticks{0};  // no region is staged: stays 0
  by_dtypes(kv_type, q, out, [&](auto kv_tag, auto* qp, auto* op) {
    using T = decltype(kv_tag);
    using QO = std::remove_pointer_t<decltype(qp)>;
    at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t i = t / H, h = t % H;
        const bool want = !scores[i].empty();
        run_rows<T, QO>(h, h + 1, qp + i * H * g * D, op + i * H * g * D, want ? wp + w_off[i] : nullptr,
                        regs[i], H, g, D, ctot[i], sc, want, copy_ticks, sp);
      }
    });
  });
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {  // rows apart; inside one, fused_decode's order
    for (int64_t i = begin; i < end; ++i)
      if (!scores[i].empty()) fold_scores(wp + w_off[i], regs[i], 1, H, ctot[i], score_scales[i]);
  });
  return out;
}

// The step's new token of R one-row caches written into their buffers in one call: row i's token is column
// idx[i] of k/v (H, M, D) and goes to column cols[i] of dst_ks[i]/dst_vs[i] (1, H, C_i, D). Replaces 2R slice
// + copy_ pairs a layer (each ~2-5 us of dispatch for 256 bytes).
void append_rows(torch::Tensor k, torch::Tensor v, std::vector<int64_t> idx, std::vector<torch::Tensor> dst_ks,
                 std::vector<torch::Tensor> dst_vs, std::vector<int64_t> cols) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k/v: (H, M, D) with the last dim contiguous");
  const int64_t H = k.size(0), M = k.size(1), D = k.size(2);
  const size_t R = idx.size();
  TORCH_CHECK(dst_ks.size() == R && dst_vs.size() == R && cols.size() == R, "one index, k, v, column per row");
  const size_t el = k.element_size();
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  for (size_t i = 0; i < R; ++i) {
    const auto &dk = dst_ks[i], &dv = dst_vs[i];
    TORCH_CHECK(dk.dim() == 4 && dv.sizes() == dk.sizes() && dk.size(0) == 1 && dk.size(1) == H && dk.size(3) == D &&
                    dk.stride(3) == 1 && dv.stride(3) == 1, "row ", i, ": destination must be (1, H, C, D) matching k");
    TORCH_CHECK(dk.scalar_type() == k.scalar_type() && dv.scalar_type() == k.scalar_type(), "row ", i,
                ": destination dtype must be k's");
    TORCH_CHECK(idx[i] >= 0 && idx[i] < M && cols[i] >= 0 && cols[i] < dk.size(2), "row ", i, ": index ", idx[i],
                " or column ", cols[i], " out of range");
    auto* pk = static_cast<char*>(dk.data_ptr());
    auto* pv = static_cast<char*>(dv.data_ptr());
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(pk + (h * dk.stride(1) + cols[i] * dk.stride(2)) * el,
                  ks + (h * k.stride(0) + idx[i] * k.stride(1)) * el, D * el);
      std::memcpy(pv + (h * dv.stride(1) + cols[i] * dv.stride(2)) * el,
                  vs + (h * v.stride(0) + idx[i] * v.stride(1)) * el, D * el);
    }
  }
}

// Each row's first maximum of x (R, V) float32 or bfloat16, last dim contiguous: what float32 argmax(dim=-1) gives
// (bf16 -> float32 is exact; a NaN counts as the maximum, its first index wins), without a float32 copy of the
// rows: one pass over each row, rows in parallel. Serve's greedy pick (152K-token rows: ~15x faster than
// float32 argmax, ~5x than torch.max on bf16, 32 rows on a 2-core Xeon).
template <typename T>
int64_t row_argmax(const T* x, int64_t V) {
  // the maximum by 16 lanes (NaN never wins a > and is noted apart), then the first index holding it
  v16 mx = v16{} + kNegInf;
  v16 nans = v16{};  // lanes that met a NaN: v - v is NaN there and 0 elsewhere (or NaN for an infinity)
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const v16 v = row16(x + i);
    mx = v > mx ? v : mx;
    nans += v * 0.f;
  }
  bool nan = false;
  float best = kNegInf;
  for (int u = 0; u < 16; ++u) {
    best = mx[u] > best ? mx[u] : best;
    nan |= nans[u] != nans[u];
  }
  for (; i < V; ++i) {
    const float v = static_cast<float>(x[i]);
    nan |= v != v;
    best = v > best ? v : best;
  }
  if (nan)  // a NaN in some lane, or an infinity (inf * 0 is NaN too): the first NaN, if there is one, wins
    for (int64_t j = 0; j < V; ++j) {
      const float v = static_cast<float>(x[j]);
      if (v != v) return j;
    }
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 bv = _mm512_set1_ps(best);
  for (; j + 16 <= V; j += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask((__m512)row16(x + j), bv, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; j < V; ++j)
    if (static_cast<float>(x[j]) == best) return j;
  return 0;  // every value -inf: the first
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: (R, V) float32 or bfloat16, V > 0, last dim contiguous");
  const int64_t R = x.size(0), V = x.size(1), rs = x.stride(0);
  auto out = torch::empty({R}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* base = x.data_ptr();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      o[r] = bf16 ? row_argmax(static_cast<const c10::BFloat16*>(base) + r * rs, V)
                  : row_argmax(static_cast<const float*>(base) + r * rs, V);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL, like torch's own ops: a server's event loop keeps running while a layer attends
  m.def("fused_decode", &fused_decode, "fused multi-region decode attention with score update (CPU)",
        py::arg("q"), py::arg("ks"), py::arg("vs"), py::arg("biases"), py::arg("poss"), py::arg("scores"),
        py::arg("score_scale"), py::arg("scaling"), py::arg("staged") = std::vector<bool>{},
        py::arg("sinks") = torch::empty({0}), py::call_guard<py::gil_scoped_release>());
  m.def("fused_decode_rows", &fused_decode_rows, "decode attention of many one-row caches in one call (CPU)",
        py::arg("q"), py::arg("ks"), py::arg("vs"), py::arg("biases"), py::arg("poss"), py::arg("scores"),
        py::arg("score_scales"), py::arg("scaling"), py::arg("sinks") = torch::empty({0}),
        py::call_guard<py::gil_scoped_release>());
  m.def("append_rows", &append_rows, "write one new token per one-row cache into its buffer (CPU)",
        py::arg("k"), py::arg("v"), py::arg("idx"), py::arg("dst_ks"), py::arg("dst_vs"), py::arg("cols"));
  m.def("argmax_rows", &argmax_rows, "each row's first maximum (float32 argmax semantics), rows in parallel (CPU)",
        py::arg("x"), py::call_guard<py::gil_scoped_release>());
  m.def("take_staging_ns", []() { const int64_t ns = t_caller_stage_ns; t_caller_stage_ns = 0; return ns; },
        "nanoseconds spent copying staged blocks in this thread's calls since its last take, summed over workers");
  m.def("staged_rows", [](int64_t D, int64_t elem) { return staged_rows(D, static_cast<size_t>(elem)); },
        "rows of a staged region copied at a time, for head size D and elem-byte K/V");
  m.def("staging_buffer_bytes", []() { return g_stage_buffer_bytes.load(); },
        "bytes held by the worker threads' staging buffers");
  m.def("amx_dots", []() {
#ifdef KVTIER_AMX
    return g_amx_enabled.load() && kvtier_amx::permitted();
#else
    return false;
#endif
  }, "whether bfloat16 logits go through AMX tiles (built for AMX-BF16, permitted by the OS, not switched off)");
  m.def("set_amx", [](bool on) {
#ifdef KVTIER_AMX
    g_amx_enabled = on;
#endif
    (void)on;
  }, "switch the AMX logits off (False: the VDPBF16PS path) or back on, for tests and A/B timing");
  m.def("bf16_dots", []() {
#ifdef KVTIER_DPBF16
    return true;
#else
    return false;
#endif
  }, "whether bfloat16 K is dotted with VDPBF16PS (AVX512-BF16 at build time) rather than widened to float32");
}
