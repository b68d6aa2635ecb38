// One-lane "vector" traits: the scalar tail of every vector loop and the whole scalar build.
// Included inside an anonymous namespace of each ISA translation unit (no includes here), so
// each unit gets its own copy compiled for its own target and no inline function is shared
// across units compiled for different instruction sets.

struct VS {
  static constexpr int W = 1;
  using F = float;
  using I = uint32_t;
  using M = bool;

  static F set1(float x) { return x; }
  static I iset1(uint32_t x) { return x; }
  static I iota(uint32_t base) { return base; }
  static F sqrt(F x) { return __builtin_sqrtf(x); }  // IEEE, correctly rounded (sqrtss)
  // x86 min/max semantics: the second operand is returned when either is NaN.
  static F min(F a, F b) { return a < b ? a : b; }
  static F max(F a, F b) { return a > b ? a : b; }
  static I bits(F x) { I u; __builtin_memcpy(&u, &x, 4); return u; }
  static F from_bits(I u) { F x; __builtin_memcpy(&x, &u, 4); return x; }
  static I add(I a, I b) { return a + b; }
  static I sub(I a, I b) { return a - b; }
  static I and_(I a, I b) { return a & b; }
  static I or_(I a, I b) { return a | b; }
  static I xor_(I a, I b) { return a ^ b; }
  static I mul(I a, I b) { return a * b; }
  template <int N> static I srl(I a) { return a >> N; }
  template <int N> static I sll(I a) { return a << N; }
  static I imax(I a, I b) { return a > b ? a : b; }  // used on values < 2^31 only
  static I imin(I a, I b) { return a < b ? a : b; }  // idem
  static F to_float(I a) { return static_cast<float>(static_cast<int32_t>(a)); }  // signed
  static M igt(I a, I b) { return a > b; }           // idem
  static M ieq(I a, I b) { return a == b; }
  static M mor(M a, M b) { return a || b; }
  static M isnan(F x) { return x != x; }
  static M not_le(F a, F b) { return !(a <= b); }    // true for NaN
  static M lt(F a, F b) { return a < b; }
  static M ne(F a, F b) { return a != b; }
  static F select(M m, F a, F b) { return m ? a : b; }
  static I iselect(M m, I a, I b) { return m ? a : b; }

  static F load_f32(const float* p) { return *p; }
  static void store_f32(float* p, F x) { *p = x; }
  static void store_i(uint32_t* p, I x) { *p = x; }
  static I load_u16(const uint16_t* p) { return *p; }
  static void store_u16(uint16_t* p, I x) { *p = static_cast<uint16_t>(x); }
  static I load_u8(const uint8_t* p) { return *p; }
  static void store_u8(uint8_t* p, I x) { *p = static_cast<uint8_t>(x); }
  static F gather(const float* table, I index) { return table[index]; }
  static I gather_u8(const uint8_t* table, I index) { return table[index]; }

  // IEEE binary16 <-> binary32, round to nearest even, as F16C's vcvtps2ph/vcvtph2ps.
  static F f16_to_f32(I h) {
    I sign = (h & 0x8000u) << 16;
    I rest = h & 0x7FFFu;
    if ((rest & 0x7C00u) == 0x7C00u) return from_bits(sign | 0x7F800000u | (rest & 0x3FFu) << 13);
    // Exponent field e becomes e + 112 - ... : shifting into FP32's field and scaling by 2^112
    // rebias normal numbers and turns subnormals (e = 0) into m·2^-24, exactly.
    return from_bits(sign | bits(from_bits(rest << 13) * 5.192296858534828e33f));
  }
  static I f32_to_f16(F x) {
    I u = bits(x);
    I sign = (u >> 16) & 0x8000u;
    I a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00u | ((a >> 13) & 0x3FFu);  // quiet NaN, payload kept
    if (a >= 0x477FF000u) return sign | 0x7C00u;                        // rounds to ±inf
    if (a >= 0x38800000u) return sign | (((a + 0xFFFu + ((a >> 13) & 1u)) >> 13) - (112u << 10));
    // Subnormal result: k·2^-24 with k = rne(|x|·2^24) < 2^10, by the 1.5·2^23 trick.
    F scaled = from_bits(a) * 16777216.0f;
    return sign | (bits(scaled + 12582912.0f) - 0x4B400000u);
  }
};
