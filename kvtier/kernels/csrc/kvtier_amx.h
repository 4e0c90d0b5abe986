// AMX tile setup shared by kvtier's CPU kernels (fused_decode_cpu.cpp, step_cpu.cpp): the one guard, KVTIER_AMX;
// the tile configuration; the request for the tile state. The build hashes this header with each source
// (kvtier/kernels/build.py), so a change here rebuilds both.
#pragma once

// AMX-BF16 tiles on Linux; every CPU with them (Sapphire Rapids and later) also has AVX512-BF16, which the decode
// kernel's AMX path uses beside them.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define KVTIER_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace kvtier_amx {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux grants a process the AMX tile state only on request (arch_prctl); oneDNN asks too, asking twice is harmless.
inline bool permitted() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Tiles tmm0..tmm7, each 16 rows of 64 bytes (16 float32 sums, or 16 pairs of bf16 per row): what both kernels use.
inline void configure() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace kvtier_amx
#endif
