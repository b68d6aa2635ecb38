// The AVX-512 build with AVX512-BF16: as isa_avx512.cpp, and BF16 stores rounded by
// vcvtneps2bf16 where it equals PyTorch's cast. That instruction rounds to nearest even but
// treats subnormal inputs as zero and writes its own NaN, so a vector holding a subnormal or a
// NaN (vfpclassps: one instruction) takes the integer rounding of kernels_impl.h instead: the
// bits are those of every other build. Run only where the CPU has AVX512-BF16.
#include "native.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,f16c,popcnt")
#include <immintrin.h>

namespace {
using namespace hfl;
#include "traits_scalar.h"
#include "traits_avx512.h"

struct V16B : V16 {
  static constexpr bool kBF16Hw = true;
  // No lane subnormal or NaN (QNaN 0x01, SNaN 0x80, denormal 0x20): vcvtneps2bf16 is exact there.
  static bool bf16_exact(F x) { return _mm512_fpclass_ps_mask(x, 0xA1) == 0; }
  static __m256i bf16_hw(F x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }
  static void store_bf16_hw(uint16_t* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_hw(x)); }
};

using V = V16B;
#include "kernels_impl.h"
}  // namespace

const hfl::Table* hfl::table_avx512bf16() {
  static const Table table = make_table("avx512_bf16");
  return &table;
}
#pragma GCC pop_options
