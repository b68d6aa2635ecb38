// The AVX-512 build (16 lanes; AVX512F/BW/VL/DQ). Compiled for every machine, run only where
// the CPU (and OS) supports AVX-512. BF16 conversions use the integer round-to-nearest-even of
// kernels_impl.h rather than AVX512-BF16's vcvtneps2bf16, which flushes FP32 subnormals to zero
// and quiets NaN differently from PyTorch's cast.
#include "native.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,popcnt")
#include <immintrin.h>

namespace {
using namespace hfl;
#include "traits_scalar.h"

#include "traits_avx512.h"

using V = V16;
#include "kernels_impl.h"
}  // namespace

const hfl::Table* hfl::table_avx512() {
  static const Table table = make_table("avx512");
  return &table;
}
#pragma GCC pop_options
