// AVX-512 vector traits (16 lanes; AVX512F/BW/VL/DQ), shared by the AVX-512 builds. Included
// inside the anonymous namespace of each AVX-512 translation unit, after <immintrin.h>, so each
// gets its own copy compiled for its own target.

struct V16 {
  static constexpr int W = 16;
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;

  static F set1(float x) { return _mm512_set1_ps(x); }
  static I iset1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I iota(uint32_t base) {
    return _mm512_add_epi32(iset1(base), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  static F sqrt(F x) { return _mm512_sqrt_ps(x); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static I bits(F x) { return _mm512_castps_si512(x); }
  static F from_bits(I u) { return _mm512_castsi512_ps(u); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I mul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  template <int N> static I srl(I a) { return _mm512_srli_epi32(a, N); }
  template <int N> static I sll(I a) { return _mm512_slli_epi32(a, N); }
  static I imax(I a, I b) { return _mm512_max_epi32(a, b); }
  static I imin(I a, I b) { return _mm512_min_epi32(a, b); }
  static F to_float(I a) { return _mm512_cvtepi32_ps(a); }
  static M igt(I a, I b) { return _mm512_cmpgt_epi32_mask(a, b); }
  static M ieq(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
  static M mor(M a, M b) { return static_cast<M>(a | b); }
  static M isnan(F x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }
  static M not_le(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_NLE_UQ); }
  static M lt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M ne(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_UQ); }
  static F select(M m, F a, F b) { return _mm512_mask_blend_ps(m, b, a); }
  static I iselect(M m, I a, I b) { return _mm512_mask_blend_epi32(m, b, a); }

  static F load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static void store_f32(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void store_i(uint32_t* p, I x) { _mm512_storeu_si512(p, x); }
  static I load_u16(const uint16_t* p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store_u16(uint16_t* p, I x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x)); }
  static I load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store_u8(uint8_t* p, I x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x)); }
  static F gather(const float* table, I index) { return _mm512_i32gather_ps(index, table, 4); }
  // Four bytes read at each byte offset (the table has 3 bytes of padding), the low one kept.
  static I gather_u8(const uint8_t* table, I index) {
    return _mm512_and_si512(_mm512_i32gather_epi32(index, table, 1), iset1(0xFF));
  }
  static F f16_to_f32(I h) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)); }
  static I f32_to_f16(F x) { return _mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
};
