// The AVX2 build (8 lanes; F16C for FP16 conversions). Everything in this unit is compiled for
// AVX2 by the target pragma and kept in an anonymous namespace, so no inline function compiled
// for AVX2 can be picked by the linker for code that runs on an older CPU.
#include "native.h"

#pragma GCC push_options
#pragma GCC target("avx2,f16c,popcnt")
#include <immintrin.h>

namespace {
using namespace hfl;
#include "traits_scalar.h"

struct V8 {
  static constexpr int W = 8;
  using F = __m256;
  using I = __m256i;
  using M = __m256i;

  static F set1(float x) { return _mm256_set1_ps(x); }
  static I iset1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I iota(uint32_t base) { return _mm256_add_epi32(iset1(base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
  static F sqrt(F x) { return _mm256_sqrt_ps(x); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static I bits(F x) { return _mm256_castps_si256(x); }
  static F from_bits(I u) { return _mm256_castsi256_ps(u); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I mul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  template <int N> static I srl(I a) { return _mm256_srli_epi32(a, N); }
  template <int N> static I sll(I a) { return _mm256_slli_epi32(a, N); }
  static I imax(I a, I b) { return _mm256_max_epi32(a, b); }
  static I imin(I a, I b) { return _mm256_min_epi32(a, b); }
  static F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static M igt(I a, I b) { return _mm256_cmpgt_epi32(a, b); }
  static M ieq(I a, I b) { return _mm256_cmpeq_epi32(a, b); }
  static M mor(M a, M b) { return _mm256_or_si256(a, b); }
  static M isnan(F x) { return bits(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
  static M not_le(F a, F b) { return bits(_mm256_cmp_ps(a, b, _CMP_NLE_UQ)); }
  static M lt(F a, F b) { return bits(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  static M ne(F a, F b) { return bits(_mm256_cmp_ps(a, b, _CMP_NEQ_UQ)); }
  static F select(M m, F a, F b) { return _mm256_blendv_ps(b, a, from_bits(m)); }
  static I iselect(M m, I a, I b) { return _mm256_blendv_epi8(b, a, m); }

  static F load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f32(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void store_i(uint32_t* p, I x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
  static I load_u16(const uint16_t* p) { return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static __m128i pack16(I x) {  // low 16 bits of each lane (every lane holds a value <= 0xFFFF)
    I packed = _mm256_packus_epi32(x, x);  // per 128-bit half: x0..x3 x0..x3 | x4..x7 x4..x7
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
  }
  static void store_u16(uint16_t* p, I x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pack16(x)); }
  static I load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static void store_u8(uint8_t* p, I x) {
    __m128i bytes = _mm_packus_epi16(pack16(x), _mm_setzero_si128());
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), bytes);
  }
  static F gather(const float* table, I index) { return _mm256_i32gather_ps(table, index, 4); }
  // Four bytes read at each byte offset (the table has 3 bytes of padding), the low one kept.
  static I gather_u8(const uint8_t* table, I index) {
    return _mm256_and_si256(_mm256_i32gather_epi32(reinterpret_cast<const int*>(table), index, 1), iset1(0xFF));
  }
  static F f16_to_f32(I h) { return _mm256_cvtph_ps(pack16(h)); }
  static I f32_to_f16(F x) { return _mm256_cvtepu16_epi32(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
};

using V = V8;
#include "kernels_impl.h"
}  // namespace

const hfl::Table* hfl::table_avx2() {
  static const Table table = make_table("avx2");
  return &table;
}
#pragma GCC pop_options
