// The optimizer steps, written once over a vector-traits class V (VS: one lane; V8: AVX2;
// V16: AVX-512) and instantiated by each ISA translation unit inside an anonymous namespace.
//
// Arithmetic contract (that of the optimizers' reference path): every FP32 operation is one
// IEEE operation rounded on its own (the units are built with -ffp-contract=off and no fast
// math, so a·b + c is never fused), square root and division are the correctly rounded
// instructions, and each conversion to a narrower format rounds to nearest even, with the
// NaN encodings of PyTorch's CPU casts. The vector body and the one-lane tail run the same
// template, so an element's bits do not depend on where it falls.
//
// Requires: native.h and traits_scalar.h included before, V and VS defined.

// ---- formats ---------------------------------------------------------------------------

// FP32 -> BF16 bits, round to nearest even (the integer form PyTorch's cast uses); NaN becomes
// 0xFFFF as PyTorch's vectorised CPU cast writes it. Subnormals are rounded like any other
// value: AVX512-BF16's vcvtneps2bf16 flushes them to zero, so it is not used.
template <class V>
inline typename V::I bf16_bits(typename V::F x) {
  auto u = V::bits(x);
  auto odd = V::and_(V::template srl<16>(u), V::iset1(1));
  auto r = V::template srl<16>(V::add(u, V::add(odd, V::iset1(0x7FFF))));
  return V::iselect(V::isnan(x), V::iset1(0xFFFF), r);
}

// FP32 -> FP8 E4M3 (fn: no infinities, 0x7F NaN) bits, round to nearest even. As PyTorch's
// cast: NaN -> 0x7F with the sign, finite values and infinities beyond 448 saturate to ±448.
template <class V>
inline typename V::I e4m3_bits(typename V::F x) {
  auto u = V::bits(x);
  auto sign = V::and_(V::template srl<24>(u), V::iset1(0x80));
  auto a = V::and_(u, V::iset1(0x7FFFFFFF));
  // Normal range (|x| >= 2^-6): round the significand to 3 bits, rebias the exponent by 120.
  auto odd = V::and_(V::template srl<20>(a), V::iset1(1));
  auto normal = V::sub(V::template srl<20>(V::add(a, V::add(odd, V::iset1(0x7FFFF)))), V::iset1(120 << 3));
  // Subnormal range: k·2^-9 with k = rne(|x|·2^9) <= 8 (the 1.5·2^23 trick, exact).
  auto scaled = V::from_bits(a) * V::set1(512.0f) + V::set1(12582912.0f);
  auto sub = V::sub(V::bits(scaled), V::iset1(0x4B400000));
  auto code = V::iselect(V::igt(V::iset1(0x3C800000), a), sub, normal);
  code = V::iselect(V::igt(a, V::iset1(0x43E7FFFF)), V::iset1(0x7E), code);  // >= 464: saturate
  code = V::iselect(V::igt(a, V::iset1(0x7F800000)), V::iset1(0x7F), code);  // NaN
  return V::or_(code, sign);
}

// FP32 -> FP8 E5M2 bits (IEEE-like: infinities, NaN 0x7F), round to nearest even, overflow to
// ±inf, NaN -> 0x7F with the sign, as PyTorch's cast.
template <class V>
inline typename V::I e5m2_bits(typename V::F x) {
  auto u = V::bits(x);
  auto sign = V::and_(V::template srl<24>(u), V::iset1(0x80));
  auto a = V::and_(u, V::iset1(0x7FFFFFFF));
  auto odd = V::and_(V::template srl<21>(a), V::iset1(1));
  auto normal = V::sub(V::template srl<21>(V::add(a, V::add(odd, V::iset1(0xFFFFF)))), V::iset1(112 << 2));
  auto scaled = V::from_bits(a) * V::set1(65536.0f) + V::set1(12582912.0f);
  auto sub = V::sub(V::bits(scaled), V::iset1(0x4B400000));
  auto code = V::iselect(V::igt(V::iset1(0x38800000), a), sub, normal);
  code = V::iselect(V::igt(a, V::iset1(0x477FFFFF)), V::iset1(0x7C), code);  // >= 2^16: inf
  code = V::iselect(V::igt(a, V::iset1(0x7F800000)), V::iset1(0x7F), code);  // NaN
  return V::or_(code, sign);
}

template <class V>
inline typename V::F e4m3_value(typename V::I code) {
  // The 7 magnitude bits placed at FP32's exponent/significand boundary and scaled by 2^120
  // rebias normal codes and give subnormal codes k·2^-9, exactly.
  auto mag = V::and_(code, V::iset1(0x7F));
  auto value = V::from_bits(V::template sll<20>(mag)) * V::set1(1.329227995784916e36f);
  value = V::select(V::ieq(mag, V::iset1(0x7F)), V::from_bits(V::iset1(0x7FC00000)), value);
  return V::from_bits(V::or_(V::bits(value), V::template sll<24>(V::and_(code, V::iset1(0x80)))));
}

template <class V>
inline typename V::F e5m2_value(typename V::I code) {
  return V::f16_to_f32(V::template sll<8>(code));  // E5M2 is the top byte of an FP16
}

// Round to `D` and widen back: the value the stored element will hold.
template <class V, int D>
inline typename V::F round_to(typename V::F x) {
  if constexpr (D == F32) {
    return x;
  } else if constexpr (D == BF16) {
    // The integer rounding even where AVX512-BF16 exists: rounding and widening back in hardware
    // (check, convert, widen, shift) costs as many operations and was slower in registers.
    auto u = V::bits(x);
    auto odd = V::and_(V::template srl<16>(u), V::iset1(1));
    auto r = V::and_(V::add(u, V::add(odd, V::iset1(0x7FFF))), V::iset1(0xFFFF0000u));
    return V::select(V::isnan(x), x, V::from_bits(r));
  } else {
    static_assert(D == F16, "round_to: FP32, BF16 or FP16");
    return V::f16_to_f32(V::f32_to_f16(x));
  }
}

template <class V, int D>
inline typename V::F load(const void* base, int64_t i) {
  if constexpr (D == F32) {
    return V::load_f32(static_cast<const float*>(base) + i);
  } else if constexpr (D == BF16) {
    return V::from_bits(V::template sll<16>(V::load_u16(static_cast<const uint16_t*>(base) + i)));
  } else if constexpr (D == F16 || D == F16S) {
    return V::f16_to_f32(V::load_u16(static_cast<const uint16_t*>(base) + i));
  } else if constexpr (D == E4M3) {
    return e4m3_value<V>(V::load_u8(static_cast<const uint8_t*>(base) + i));
  } else {
    static_assert(D == E5M2, "load: unknown format");
    return e5m2_value<V>(V::load_u8(static_cast<const uint8_t*>(base) + i));
  }
}

// Store rounded to nearest even (no saturation: a plain cast).
template <class V, int D>
inline void store(void* base, int64_t i, typename V::F x) {
  if constexpr (D == F32) {
    V::store_f32(static_cast<float*>(base) + i, x);
  } else if constexpr (D == BF16) {
    if constexpr (HasBF16Hw<V>::value) {
      if (V::bf16_exact(x)) return V::store_bf16_hw(static_cast<uint16_t*>(base) + i, x);
    }
    V::store_u16(static_cast<uint16_t*>(base) + i, bf16_bits<V>(x));
  } else if constexpr (D == F16 || D == F16S) {
    V::store_u16(static_cast<uint16_t*>(base) + i, V::f32_to_f16(x));
  } else if constexpr (D == E4M3) {
    V::store_u8(static_cast<uint8_t*>(base) + i, e4m3_bits<V>(x));
  } else {
    static_assert(D == E5M2, "store: unknown format");
    V::store_u8(static_cast<uint8_t*>(base) + i, e5m2_bits<V>(x));
  }
}

constexpr float format_max(int d) {
  return d == BF16 ? 3.3895313892515355e38f
       : d == F16 || d == F16S ? 65504.0f
       : d == E4M3 ? 448.0f
       : d == E5M2 ? 57344.0f
       : 3.4028234663852886e38f;
}


// ---- the AdamW core (optim.adamw.adamw_math) --------------------------------------------

// Everything a step broadcasts: the scalar vector, a gradient's scale, a scaled master's scales.
template <class V>
struct Consts {
  using F = typename V::F;
  F one_minus_beta1, beta2, one_minus_beta2, step, eps, decay;
  F grad_scale, inv_grad_scale, inv_param_scale, new_param_scale;
  bool grad_scale_pow2;
  explicit Consts(const Row& r)
      : one_minus_beta1(V::set1(r.scalars[ONE_MINUS_BETA1])),
        beta2(V::set1(r.scalars[BETA2])),
        one_minus_beta2(V::set1(r.scalars[ONE_MINUS_BETA2])),
        step(V::set1(r.scalars[STEP])), eps(V::set1(r.scalars[EPS])), decay(V::set1(r.scalars[DECAY])),
        grad_scale(V::set1(r.grad_scale)), inv_grad_scale(V::set1(r.inv_grad_scale)),
        inv_param_scale(V::set1(r.inv_param_scale)), new_param_scale(V::set1(r.new_param_scale)),
        grad_scale_pow2(r.grad_scale_pow2) {}
};

// g in FP32 registers; an FP8 gradient is q/s (a clipping factor makes s a non-power of two,
// where only the division is exact).
template <class V, int G>
inline typename V::F gradient(const Row& r, const Consts<V>& c, int64_t i) {
  auto g = load<V, G>(r.grad, i);
  if constexpr (G == E4M3 || G == E5M2) g = c.grad_scale_pow2 ? g * c.inv_grad_scale : g / c.grad_scale;
  return g;
}

// m₃₂ = m + (1 − β1)·(g − m); v₃₂ = min(β2·v + ((1 − β2)·g)·g, max_v).
template <class V>
inline void moments(const Consts<V>& c, typename V::F g, typename V::F m_old, typename V::F v_old,
                    typename V::F max_v, typename V::F& m, typename V::F& v) {
  m = m_old + c.one_minus_beta1 * (g - m_old);
  v = v_old * c.beta2 + (c.one_minus_beta2 * g) * g;
  v = V::min(max_v, v);  // clamp(max=): NaN is the second operand, so it stays NaN
}

// Δθ₃₂ = θ·(−α·λ) + (s·m₃₂)/(√v₃₂ + ε')  (the reference's sequence, operation for operation).
template <class V>
inline typename V::F update(const Consts<V>& c, typename V::F theta, typename V::F m, typename V::F v) {
  auto denominator = V::sqrt(v) + c.eps;
  return theta * c.decay + (c.step * m) / denominator;
}


// TwoSum in `P` arithmetic: s = r(a + b), bb = r(s − a), e = (b − bb) + (a − (s − bb)).
template <class V, int P>
inline void two_sum(typename V::F a, typename V::F b, typename V::F& s, typename V::F& e) {
  s = round_to<V, P>(a + b);
  auto bb = round_to<V, P>(s - a);
  e = (b - bb) + (a - (s - bb));
}

// (θ, δθ) ← Grow((θ, δθ), r(Δθ₃₂)) = TwoSum, r(δθ + e), Fast2Sum (|s| >= |b|), δθ in `theta_state`.
template <class V, int P>
inline void grow_store(const Row& r, int64_t i, typename V::F theta, typename V::F delta) {
  typename V::F s, e;
  two_sum<V, P>(theta, round_to<V, P>(delta), s, e);
  auto b = round_to<V, P>(load<V, P>(r.theta_state, i) + e);
  auto sum = round_to<V, P>(s + b);
  store<V, P>(r.param, i, sum);
  store<V, P>(r.theta_state, i, b + (s - sum));
}

// 16 uniform bits per element from a counter-based hash of (seed, index): the stream of
// optimizers' stream (two multiply-xorshift rounds over index + seed·golden ratio, top 16 bits).
template <class V>
inline typename V::I uniform_bits16(uint32_t seed_mix, int64_t i) {
  auto x = V::add(V::iota(static_cast<uint32_t>(i)), V::iset1(seed_mix));
  auto k = V::iset1(0x45D9F3B);
  x = V::mul(V::xor_(x, V::template srl<16>(x)), k);
  x = V::mul(V::xor_(x, V::template srl<16>(x)), k);
  x = V::xor_(x, V::template srl<16>(x));
  return V::template srl<16>(x);
}


template <class V>
inline typename V::F copysign_(typename V::F magnitude, typename V::F sign_of) {
  auto sign = V::and_(V::bits(sign_of), V::iset1(0x80000000u));
  return V::from_bits(V::or_(V::and_(V::bits(magnitude), V::iset1(0x7FFFFFFF)), sign));
}

// The smallest positive code of D (fp8.scaled.keep_nonzero's d).
constexpr float smallest_code(int d) {
  return d == E4M3 ? 0x1p-9f : d == E5M2 ? 0x1p-16f : d == BF16 ? 0x1p-133f : 0x1p-24f;
}

// payload = cast(clamp(y, −L, L) + (y − y)), y = x·s: ±inf and NaN become NaN (fp8.scaled.quantize).
// `keep_nonzero` (a second moment, formats.Scaled.keep_nonzero): a non-zero value below the
// smallest code d is stored as ±d (max(d, NaN) keeps NaN, as the reference's clamp).
template <class V, int D>
inline void store_scaled(void* base, int64_t i, typename V::F x, typename V::F scale, bool keep_nonzero = false) {
  if constexpr (D == F32) {
    store<V, F32>(base, i, x);
  } else {
    auto y = x * scale;
    auto limit = V::set1(format_max(D));
    auto clamped = V::min(limit, V::max(V::set1(-format_max(D)), y));
    auto stored = clamped + (y - y);
    if (keep_nonzero) {
      auto magnitude = V::from_bits(V::and_(V::bits(stored), V::iset1(0x7FFFFFFF)));
      auto kept = copysign_<V>(V::max(V::set1(smallest_code(D)), magnitude), stored);
      stored = V::select(V::ne(stored, V::set1(0.0f)), kept, stored);
    }
    store<V, D>(base, i, stored);
  }
}

// ---- GroupFP8 (COAT): per-group FP8 moments with dynamic range expansion ---------------

// log2(x) for x > 0 (normal or subnormal): x = 2^e·m with m in [√½, √2), ln m = ln(1 + f) by
// Cephes' single-precision polynomial (f − f²/2 + f³·P(f), peak relative error below 1e-7),
// then ·1/ln 2; no division. Error a few FP32 ulps of the result.
template <class V>
inline typename V::F log2_positive(typename V::F x) {
  auto tiny = V::lt(x, V::set1(1.17549435e-38f));
  x = V::select(tiny, x * V::set1(8388608.0f), x);
  auto u = V::bits(x);
  auto e = V::to_float(V::sub(V::template srl<23>(u), V::iset1(127)));
  e = V::select(tiny, e - V::set1(23.0f), e);
  auto m = V::from_bits(V::or_(V::and_(u, V::iset1(0x7FFFFF)), V::iset1(0x3F800000)));
  auto big = V::lt(V::set1(1.41421356f), m);
  m = V::select(big, m * V::set1(0.5f), m);
  e = V::select(big, e + V::set1(1.0f), e);
  auto f = m - V::set1(1.0f);
  auto z = f * f;
  auto p = V::set1(7.0376836292e-2f) * f - V::set1(1.1514610310e-1f);
  p = p * f + V::set1(1.1676998740e-1f);
  p = p * f - V::set1(1.2420140846e-1f);
  p = p * f + V::set1(1.4249322787e-1f);
  p = p * f - V::set1(1.6668057665e-1f);
  p = p * f + V::set1(2.0000714765e-1f);
  p = p * f - V::set1(2.4999993993e-1f);
  p = p * f + V::set1(3.3333331174e-1f);
  auto ln = f + ((p * f) * z - V::set1(0.5f) * z);
  return e + ln * V::set1(1.4426950408889634f);  // 1/ln 2
}

// 2^y for y in [−125, 126] (clamped): 2^n·2^f, n = rne(y), |f| <= ½, 2^f = e^(f·ln 2) by its
// Taylor series to degree 7 (truncation below 2^-27 relative).
template <class V>
inline typename V::F exp2_(typename V::F y) {
  y = V::min(V::set1(126.0f), V::max(V::set1(-125.0f), y));
  auto shifted = y + V::set1(12582912.0f);
  auto n = V::sub(V::bits(shifted), V::iset1(0x4B400000));
  auto z = (y - (shifted - V::set1(12582912.0f))) * V::set1(0.69314718f);
  auto p = z * V::set1(1.0f / 5040.0f) + V::set1(1.0f / 720.0f);
  p = p * z + V::set1(1.0f / 120.0f);
  p = p * z + V::set1(1.0f / 24.0f);
  p = p * z + V::set1(1.0f / 6.0f);
  p = p * z + V::set1(0.5f);
  p = p * z + V::set1(1.0f);
  p = p * z + V::set1(1.0f);
  return V::from_bits(V::add(V::bits(p), V::template sll<23>(n)));
}

// x^e for x >= 0 (0 -> 0, NaN -> NaN), e > 0: numerics.pow_nonnegative, operation for
// operation (not PyTorch's pow; a few FP32 ulps from the exact power).
template <class V>
inline typename V::F pow_nonnegative(typename V::F x, typename V::F e) {
  auto r = exp2_<V>(e * log2_positive<V>(x));
  r = V::select(V::ieq(V::bits(x), V::iset1(0)), x, r);
  return V::select(V::isnan(x), x, r);
}

// One group's decoding constants: real = sign(y)·|y|^(1/k)·c, y = q/s.
template <class V>
struct GroupCode {
  typename V::F scale, inv_k, center;
  bool power;
  GroupCode(float* const* meta, int64_t g) {
    float inv_k_value = 1.0f / meta[1][g];  // exponent.reciprocal(), FP32
    scale = V::set1(meta[0][g]);
    inv_k = V::set1(inv_k_value);
    center = V::set1(meta[2][g]);
    power = inv_k_value != 1.0f;  // the reference takes |y| itself where 1/k = 1
  }
};

// y = q/s, then sign(y)·|y|^(1/k)·c: the reference's sequence (formats.GroupFP8.decode), with
// its power `numerics.pow_nonnegative`, operation for operation.
template <class V, int D, bool EXPAND>
inline typename V::F decode_group(const void* payload, int64_t i, const GroupCode<V>& code) {
  auto y = load<V, D>(payload, i) / code.scale;
  if constexpr (!EXPAND) {
    return y;
  } else {
    auto magnitude = V::from_bits(V::and_(V::bits(y), V::iset1(0x7FFFFFFF)));
    if (code.power) magnitude = pow_nonnegative<V>(magnitude, code.inv_k);
    return copysign_<V>(magnitude * code.center, y);
  }
}

template <class V>
inline uint32_t reduce_max(typename V::I x) {
  uint32_t lanes[V::W];
  V::store_i(lanes, x);
  uint32_t r = lanes[0];
  for (int l = 1; l < V::W; ++l) r = lanes[l] > r ? lanes[l] : r;
  return r;
}

template <class V>
inline uint32_t reduce_min(typename V::I x) {
  uint32_t lanes[V::W];
  V::store_i(lanes, x);
  uint32_t r = lanes[0];
  for (int l = 1; l < V::W; ++l) r = lanes[l] < r ? lanes[l] : r;
  return r;
}

// optim.coat.quantize_state of one group held in `buf` (FP32, `size` elements, a multiple of V::W):
// amax, amin (smallest non-zero |x|), k and c (expansion), |x| ← (|x|/c)^k, s = F/amax (NaN if
// amax is not finite, 1 if 0), payload = cast(clamp(x·s) + (x·s − x·s)).
template <int D, bool EXPAND>
inline void encode_fp8_group(float* buf, int64_t size, void* payload, int64_t base, float* const* meta, int64_t g,
                             bool keep_nonzero) {
  const float limit = format_max(D);
  auto magnitude_mask = V::iset1(0x7FFFFFFF);
  auto infinity = V::iset1(0x7F800000);
  auto zero = V::iset1(0);
  typename V::I amax_v = zero, amin_v = infinity;
  for (int64_t j = 0; j < size; j += V::W) {
    auto b = V::and_(V::bits(V::load_f32(buf + j)), magnitude_mask);
    amax_v = V::imax(amax_v, b);  // bits order like |x|, NaN above inf: max propagates NaN
    auto excluded = V::mor(V::ieq(b, zero), V::igt(b, infinity));
    amin_v = V::imin(amin_v, V::iselect(excluded, infinity, b));
  }
  const uint32_t amax_bits = reduce_max<V>(amax_v), amin_bits = reduce_min<V>(amin_v);
  float amax = VS::from_bits(amax_bits), amin = VS::from_bits(amin_bits);
  float k = 1.0f, c = 1.0f;
  if constexpr (EXPAND) {
    // formats.expansion_exponent, in FP64 as there: k = max(1, floor(log2(F²/2)/log2(R)·16)/16).
    const double target = __builtin_log2(static_cast<double>(limit) * static_cast<double>(limit) / 2.0);
    const double log_range = __builtin_log2(static_cast<double>(amax)) - __builtin_log2(static_cast<double>(amin));
    const bool usable = amax > 0.0f && log_range > 0.0;
    if (usable) {
      double raw = __builtin_floor(target / log_range * 16.0) / 16.0;
      k = static_cast<float>(raw < 1.0 ? 1.0 : raw);
    }
    if (amax > 0.0f && k > 1.0f) c = __builtin_sqrtf(amax) * __builtin_sqrtf(amin);
    if (k != 1.0f) {  // |x|/1 and x^1 are x: nothing to do for k = 1 (c = 1 then)
      auto cv = V::set1(c), kv = V::set1(k);
      typename V::I new_max = zero;
      for (int64_t j = 0; j < size; j += V::W) {
        auto x = V::load_f32(buf + j);
        auto magnitude = V::from_bits(V::and_(V::bits(x), magnitude_mask));
        magnitude = pow_nonnegative<V>(magnitude / cv, kv);
        new_max = V::imax(new_max, V::and_(V::bits(magnitude), magnitude_mask));
        V::store_f32(buf + j, copysign_<V>(magnitude, x));
      }
      amax = VS::from_bits(reduce_max<V>(new_max));
    }
  }
  // F/amax as PyTorch evaluates a Python scalar over a tensor: reciprocal, then multiply.
  // At most 2^126 (formats.GroupFP8.choose): a decayed amax below F/FLT_MAX would give s = inf.
  float s = amax > 0.0f ? (1.0f / amax) * limit : 1.0f;
  if (s > 0x1p126f) s = 0x1p126f;
  if (!(VS::bits(amax) < 0x7F800000u)) s = VS::from_bits(0x7FC00000u);  // inf or NaN amax: NaN scale
  auto sv = V::set1(s);
  for (int64_t j = 0; j < size; j += V::W) store_scaled<V, D>(payload, base + j, V::load_f32(buf + j), sv);
  if (keep_nonzero) {  // formats.GroupFP8.keep_nonzero: a non-zero y·s below the smallest code takes it
    auto* codes = static_cast<uint8_t*>(payload) + base;
    for (int64_t j = 0; j < size; ++j) {
      const float ys = buf[j] * s;
      if ((codes[j] & 0x7F) == 0 && ys != 0.0f) codes[j] = static_cast<uint8_t>(((VS::bits(ys) >> 24) & 0x80) | 0x01);
    }
  }
  meta[0][g] = s;
  meta[1][g] = k;
  meta[2][g] = c;
}

// ---- blockwise 8-bit states (formats.Blockwise8bit): dynamic-map codes, absmax per block ----

// The index of the nearest map value, ties to the lower one (torch.bucketize over the
// midpoints): the lookup table gives, for x's top 16 bits, the number of midpoints below every
// float with those bits; at most one midpoint lies among them (checked where the table is
// built), the next one, so one comparison finishes the count. NaN takes bucketize's code.
template <class V>
inline typename V::I map_encode(const Moment& mo, typename V::F x) {
  auto base = V::gather_u8(mo.map_lookup, V::template srl<16>(V::bits(x)));
  auto above = V::lt(V::gather(mo.map_mids, base), x);
  auto code = V::iselect(above, V::add(base, V::iset1(1)), base);
  return V::iselect(V::isnan(x), V::iset1(mo.map_nan), code);
}

// Encode one block held in `buf` (FP32, `size` elements, a multiple of V::W): a = max|x| (NaN
// above inf), x / (a > 0 ? a : 1), clamped at 0 for the unsigned map, then the codes; absmax = a.
template <bool NONNEGATIVE>
inline void encode_block(const Moment& mo, float* buf, int64_t size, uint8_t* codes, float* absmax) {
  typename V::I amax_v = V::iset1(0);
  for (int64_t j = 0; j < size; j += V::W) {
    amax_v = V::imax(amax_v, V::and_(V::bits(V::load_f32(buf + j)), V::iset1(0x7FFFFFFF)));
  }
  const float amax = VS::from_bits(reduce_max<V>(amax_v));
  const auto divisor = V::set1(amax > 0.0f ? amax : 1.0f);
  for (int64_t j = 0; j < size; j += V::W) {
    auto x = V::load_f32(buf + j) / divisor;
    if constexpr (NONNEGATIVE) x = V::max(V::set1(0.0f), x);  // clamp(min=0): NaN stays NaN
    auto code = map_encode<V>(mo, x);
    // A positive v never takes the zero code (code 0; formats.Blockwise8bit.store_): at least code 1.
    if constexpr (NONNEGATIVE) code = V::iselect(V::lt(V::set1(0.0f), x), V::imax(code, V::iset1(1)), code);
    V::store_u8(codes + j, code);
  }
  *absmax = amax;
}


// ---- formats: how a moment is stored (hf_lowprec.optim.formats) ------------------------
//
// A format has a layout, the largest value v may hold in registers before it is stored
// (`kRegisterMax`, formats.Format.register_max), a `Code<V>` of per-tensor or per-group
// constants, `decode` of one vector, and `encode` of one vector (element-wise and per-tensor
// layouts) or `encode_group` of a group gathered in FP32 (per-group layouts).

enum Layout : int { ELEMENTWISE = 0, PER_TENSOR = 1, PER_GROUP = 2 };

struct NoCode {
  NoCode(const Moment&, int64_t) {}
};

// formats.Plain: the value rounded once to D.
template <int D>
struct PlainFormat {
  static constexpr int kLayout = ELEMENTWISE;
  static constexpr float kRegisterMax = format_max(D);
  template <class V> using Code = NoCode;
  template <class V>
  static typename V::F decode(const Moment& mo, const NoCode&, int64_t i) { return load<V, D>(mo.payload, i); }
  template <class V>
  static void encode(const Moment& mo, const NoCode&, int64_t i, typename V::F x) { store<V, D>(mo.payload, i, x); }
};

// formats.Pair over Plain: x = value + error; stores r(x) and r(x − r(x)) (Collage-plus's δv).
template <int D>
struct PairFormat : PlainFormat<D> {
  template <class V>
  static typename V::F decode(const Moment& mo, const NoCode&, int64_t i) {
    return load<V, D>(mo.payload, i) + load<V, D>(mo.error, i);
  }
  template <class V>
  static void encode(const Moment& mo, const NoCode&, int64_t i, typename V::F x) {
    store<V, D>(mo.payload, i, x);
    store<V, D>(mo.error, i, x - round_to<V, D>(x));
  }
};

// formats.Scaled: payload = saturate(x·s), s a power of two per tensor, re-chosen from the new
// values' amax (pass AMAX) before they are stored (pass STORE); FP32 storage keeps s = 1.
template <int D>
struct ScaledFormat {
  static constexpr int kLayout = PER_TENSOR;
  static constexpr float kRegisterMax = format_max(F32);
  template <class V>
  struct Code {
    typename V::F inv, next;
    bool keep_nonzero;
    Code(const Moment& mo, int64_t)
        : inv(V::set1(mo.inv_scale)), next(V::set1(mo.new_scale)), keep_nonzero(mo.nonnegative) {}
  };
  template <class V>
  static typename V::F decode(const Moment& mo, const Code<V>& code, int64_t i) {
    return load<V, D>(mo.payload, i) * code.inv;  // power-of-two scales: exact
  }
  template <class V>
  static void encode(const Moment& mo, const Code<V>& code, int64_t i, typename V::F x) {
    store_scaled<V, D>(mo.payload, i, x, code.next, code.keep_nonzero);
  }
};

// formats.GroupFP8 (COAT): per group (s, k, c), dynamic range expansion when EXPAND. A last
// partial group is padded with zeros for the encoding, as optim.coat.quantize_state pads.
template <int D, bool EXPAND>
struct GroupFP8Format {
  static constexpr int kLayout = PER_GROUP;
  static constexpr float kRegisterMax = format_max(F32);
  static constexpr bool kPadDecoded = false;
  template <class V>
  struct Code : GroupCode<V> {
    Code(const Moment& mo, int64_t g) : GroupCode<V>(mo.meta, g) {}
  };
  template <class V>
  static typename V::F decode(const Moment& mo, const Code<V>& code, int64_t i) {
    return decode_group<V, D, EXPAND>(mo.payload, i, code);
  }
  static void encode_group(const Moment& mo, float* buf, int64_t size, int64_t base, int64_t g) {
    encode_fp8_group<D, EXPAND>(buf, size, mo.payload, base, mo.meta, g, mo.nonnegative);
  }
};

// formats.Blockwise8bit: dynamic-map codes, absmax per block. A last partial block runs its
// padding as the reference pads it (θ = g = 0, the stored codes of the padding decoded), so the
// block's absmax and codes match.
struct Blockwise8bitFormat {
  static constexpr int kLayout = PER_GROUP;
  static constexpr float kRegisterMax = format_max(F32);
  static constexpr bool kPadDecoded = true;
  template <class V>
  struct Code {
    typename V::F absmax;
    Code(const Moment& mo, int64_t g) : absmax(V::set1(mo.meta[0][g])) {}
  };
  template <class V>
  static typename V::F decode(const Moment& mo, const Code<V>& code, int64_t i) {
    return V::gather(mo.map_values, V::load_u8(static_cast<const uint8_t*>(mo.payload) + i)) * code.absmax;
  }
  static void encode_group(const Moment& mo, float* buf, int64_t size, int64_t base, int64_t g) {
    auto* codes = static_cast<uint8_t*>(mo.payload) + base;
    if (mo.nonnegative) {
      encode_block<true>(mo, buf, size, codes, mo.meta[0] + g);
    } else {
      encode_block<false>(mo, buf, size, codes, mo.meta[0] + g);
    }
  }
};

// ---- rules: how Δθ₃₂ reaches θ (hf_lowprec.optim.rules) ---------------------------------
//
// A rule reads θ into FP32 registers and applies θ + Δθ₃₂ as it rounds; `kScaled`: θ is stored
// with a per-tensor scale (its amax is needed first, as a Scaled format's).

// rules.Nearest: θ ← r(θ + Δθ₃₂).
template <int P>
struct NearestRule {
  static constexpr bool kScaled = false;
  template <class V>
  static typename V::F read(const Row& r, const Consts<V>&, int64_t i) { return load<V, P>(r.param, i); }
  template <class V>
  static void apply(const Row& r, const Consts<V>&, int64_t i, typename V::F theta, typename V::F delta) {
    store<V, P>(r.param, i, theta + delta);
  }
};

// rules.Grow (Collage): (θ, δθ) ← Grow((θ, δθ), r(Δθ₃₂)) = TwoSum, add, Fast2Sum.
template <int P>
struct GrowRule : NearestRule<P> {
  template <class V>
  static void apply(const Row& r, const Consts<V>&, int64_t i, typename V::F theta, typename V::F delta) {
    grow_store<V, P>(r, i, theta, delta);
  }
};

// rules.Kahan: y = r(Δθ₃₂ + k); (θ, k) ← TwoSum(θ, y).
template <int P>
struct KahanRule : NearestRule<P> {
  template <class V>
  static void apply(const Row& r, const Consts<V>&, int64_t i, typename V::F theta, typename V::F delta) {
    auto y = round_to<V, P>(load<V, P>(r.theta_state, i) + delta);
    typename V::F s, e;
    two_sum<V, P>(theta, y, s, e);
    store<V, P>(r.param, i, s);
    store<V, P>(r.theta_state, i, e);
  }
};

// rules.StochasticRounding into BF16: θ ← SR(θ + Δθ₃₂); values that are not finite or beyond
// BF16's largest finite value are rounded to nearest, as numerics.stochastic_round.
template <int P>
struct StochasticRoundingRule : NearestRule<P> {
  static_assert(P == BF16, "stochastic rounding: BF16 θ only");
  template <class V>
  static void apply(const Row& r, const Consts<V>&, int64_t i, typename V::F theta, typename V::F delta) {
    auto target = delta + theta;
    auto random = V::template srl<16>(V::add(V::bits(target), uniform_bits16<V>(r.seed_mix, i)));
    auto magnitude = V::from_bits(V::and_(V::bits(target), V::iset1(0x7FFFFFFF)));
    auto plain = V::not_le(magnitude, V::set1(format_max(BF16)));
    V::store_u16(static_cast<uint16_t*>(r.param) + i, V::iselect(plain, bf16_bits<V>(target), random));
  }
};

// rules.Master: the FP32 master θ₃₂ ← θ₃₂ + Δθ₃₂, the visible weight r(θ₃₂).
template <int P>
struct MasterRule {
  static constexpr bool kScaled = false;
  template <class V>
  static typename V::F read(const Row& r, const Consts<V>&, int64_t i) { return load<V, F32>(r.theta_state, i); }
  template <class V>
  static void apply(const Row& r, const Consts<V>&, int64_t i, typename V::F theta, typename V::F delta) {
    auto updated = theta + delta;
    store<V, F32>(r.theta_state, i, updated);
    store<V, P>(r.param, i, updated);
  }
};

// rules.ScaledMaster (FP8-LM): an FP16 payload θ·s, s re-chosen from the new θ's amax.
template <int P>
struct ScaledMasterRule {
  static_assert(P == F16S, "a scaled master is an FP16 payload");
  static constexpr bool kScaled = true;
  template <class V>
  static typename V::F read(const Row& r, const Consts<V>& c, int64_t i) {
    return load<V, F16S>(r.param, i) * c.inv_param_scale;
  }
  template <class V>
  static void apply(const Row& r, const Consts<V>& c, int64_t i, typename V::F theta, typename V::F delta) {
    store_scaled<V, F16>(r.param, i, theta + delta, c.new_param_scale);
  }
};

// ---- the step: one template over (m format, v format, rule, gradient dtype) ------------
//
// Three drivers, chosen by the formats' layouts: element-wise formats store in one pass;
// per-tensor scales take two (AMAX, then STORE recomputing the same values: re-reading g, m,
// v, θ moves fewer bytes than writing and re-reading FP32 values, and a payload stored with a
// predicted scale could not be corrected exactly once the inputs are overwritten); per-group
// formats gather a group's new m and v in FP32 and encode it whole.
template <class MF, class VF, class R, int G>
struct Step {
  static constexpr bool kGroups = MF::kLayout == PER_GROUP;
  static_assert(kGroups == (VF::kLayout == PER_GROUP), "m and v: both grouped or neither");
  static constexpr bool kTwoPasses = MF::kLayout == PER_TENSOR || VF::kLayout == PER_TENSOR || R::kScaled;
  template <class W> using MCode = typename MF::template Code<W>;
  template <class W> using VCode = typename VF::template Code<W>;

  template <class W>
  static inline void compute(const Row& r, const Consts<W>& c, const MCode<W>& mc, const VCode<W>& vc, int64_t i,
                             typename W::F& theta, typename W::F& m, typename W::F& v) {
    theta = R::template read<W>(r, c, i);
    moments<W>(c, gradient<W, G>(r, c, i), MF::template decode<W>(r.moment[0], mc, i),
               VF::template decode<W>(r.moment[1], vc, i), W::set1(VF::kRegisterMax), m, v);
  }

  template <class W>
  static inline void element(const Row& r, const Consts<W>& c, const MCode<W>& mc, const VCode<W>& vc, int64_t i) {
    typename W::F theta, m, v;
    compute<W>(r, c, mc, vc, i, theta, m, v);
    auto delta = update<W>(c, theta, m, v);
    MF::template encode<W>(r.moment[0], mc, i, m);
    VF::template encode<W>(r.moment[1], vc, i, v);
    R::template apply<W>(r, c, i, theta, delta);
  }

  // |x| as bits orders like |x| (NaN above +inf), so an integer max is the amax.
  template <class W>
  static inline void amax_element(const Row& r, const Consts<W>& c, const MCode<W>& mc, const VCode<W>& vc, int64_t i,
                                  typename W::I* acc) {
    typename W::F theta, m, v;
    compute<W>(r, c, mc, vc, i, theta, m, v);
    auto magnitude = W::iset1(0x7FFFFFFF);
    if constexpr (R::kScaled) {  // an unscaled θ needs no amax: no root or division here
      acc[2] = W::imax(acc[2], W::and_(W::bits(theta + update<W>(c, theta, m, v)), magnitude));
    }
    acc[0] = W::imax(acc[0], W::and_(W::bits(m), magnitude));
    acc[1] = W::imax(acc[1], W::and_(W::bits(v), magnitude));
  }

  static void run_elements(const Row& r, int64_t begin, int64_t end) {
    const Consts<V> c(r);
    const MCode<V> mc(r.moment[0], 0);
    const VCode<V> vc(r.moment[1], 0);
    int64_t i = begin;
    for (; i + V::W <= end; i += V::W) element<V>(r, c, mc, vc, i);
    if (i < end) {
      const Consts<VS> cs(r);
      const MCode<VS> mcs(r.moment[0], 0);
      const VCode<VS> vcs(r.moment[1], 0);
      for (; i < end; ++i) element<VS>(r, cs, mcs, vcs, i);
    }
  }

  static void run_amax(const Row& r, int64_t begin, int64_t end, uint32_t* out) {
    const Consts<V> c(r);
    const MCode<V> mc(r.moment[0], 0);
    const VCode<V> vc(r.moment[1], 0);
    typename V::I acc[3] = {V::iset1(0), V::iset1(0), V::iset1(0)};
    int64_t i = begin;
    for (; i + V::W <= end; i += V::W) amax_element<V>(r, c, mc, vc, i, acc);
    VS::I result[3];
    for (int k = 0; k < 3; ++k) result[k] = reduce_max<V>(acc[k]);
    if (i < end) {
      const Consts<VS> cs(r);
      const MCode<VS> mcs(r.moment[0], 0);
      const VCode<VS> vcs(r.moment[1], 0);
      for (; i < end; ++i) amax_element<VS>(r, cs, mcs, vcs, i, result);
    }
    for (int k = 0; k < 3; ++k) out[k] = result[k];
  }

  // Groups [begin, end) of one row (begin a multiple of the group size): decode, AdamW, the
  // rule, then encode the group's new m and v whole.
  static void run_groups(const Row& r, int64_t begin, int64_t end) {
    const int64_t size = r.group_size;
    alignas(64) float mbuf[kMaxGroup];
    alignas(64) float vbuf[kMaxGroup];
    const Consts<V> c(r);
    const Consts<VS> cs(r);
    for (int64_t base = begin; base < end; base += size) {
      const int64_t g = base / size;
      const int64_t count = size < r.numel - base ? size : r.numel - base;
      {
        const MCode<V> mc(r.moment[0], g);
        const VCode<V> vc(r.moment[1], g);
        int64_t j = 0;
        for (; j + V::W <= count; j += V::W) group_element<V>(r, c, mc, vc, base + j, mbuf + j, vbuf + j);
        if (j < size) {
          const MCode<VS> mcs(r.moment[0], g);
          const VCode<VS> vcs(r.moment[1], g);
          for (; j < count; ++j) group_element<VS>(r, cs, mcs, vcs, base + j, mbuf + j, vbuf + j);
          for (; j < size; ++j) {  // padding: θ = g = 0, the format's stored padding or zeros
            float m_old = MF::kPadDecoded ? MF::template decode<VS>(r.moment[0], mcs, base + j) : 0.0f;
            float v_old = VF::kPadDecoded ? VF::template decode<VS>(r.moment[1], vcs, base + j) : 0.0f;
            moments<VS>(cs, 0.0f, m_old, v_old, VF::kRegisterMax, mbuf[j], vbuf[j]);
          }
        }
      }
      MF::encode_group(r.moment[0], mbuf, size, base, g);
      VF::encode_group(r.moment[1], vbuf, size, base, g);
    }
  }

  template <class W>
  static inline void group_element(const Row& r, const Consts<W>& c, const MCode<W>& mc, const VCode<W>& vc,
                                   int64_t i, float* mbuf, float* vbuf) {
    typename W::F theta, m, v;
    compute<W>(r, c, mc, vc, i, theta, m, v);
    R::template apply<W>(r, c, i, theta, update<W>(c, theta, m, v));
    W::store_f32(mbuf, m);
    W::store_f32(vbuf, v);
  }

  static bool run(int pass, const Row& r, int64_t begin, int64_t end, uint32_t* amax) {
    if constexpr (kGroups) {
      if (pass != STORE || r.group_size <= 0 || r.group_size > kMaxGroup || r.group_size % V::W) return false;
      run_groups(r, begin, end);
    } else if constexpr (kTwoPasses) {
      if (pass == AMAX) {
        run_amax(r, begin, end, amax);
      } else {
        run_elements(r, begin, end);
      }
    } else {
      if (pass != STORE) return false;
      run_elements(r, begin, end);
    }
    return true;
  }
};

// ---- the families ----------------------------------------------------------------------

template <int P, int M, int VD>
struct Dtypes {};  // (θ, m, v) storage dtypes a family runs
template <int... G>
struct Grads {};  // gradient dtypes it takes
template <int MF, int VF, int R, class GradDtypes, class... Storage>
struct Family {};

using Grads16 = Grads<F32, BF16, F16>;
using GradsFP8 = Grads<E4M3, E5M2, F32, BF16, F16>;

// Every native family: its (m format, v format, rule) tags, the gradients it takes, the storage
// dtypes it runs. Adding a family is one line here (and its composition in Python).
using Families = std::tuple<
    // PlainAdamW (fp32; bf16-mixed's FP32 masters; bf16-pure), FP32StatesAdamW
    Family<PLAIN, PLAIN, NEAREST, Grads16, Dtypes<F32, F32, F32>, Dtypes<BF16, F32, F32>, Dtypes<F16, F32, F32>,
           Dtypes<BF16, BF16, BF16>>,
    Family<PLAIN, PLAIN, KAHAN, Grads16, Dtypes<BF16, BF16, BF16>, Dtypes<BF16, F32, F32>, Dtypes<F16, F32, F32>>,
    Family<PLAIN, PLAIN, STOCHASTIC_ROUNDING, Grads16, Dtypes<BF16, BF16, BF16>, Dtypes<BF16, F32, F32>>,
    Family<PLAIN, PLAIN, MASTER, Grads16, Dtypes<F32, F32, F32>, Dtypes<BF16, F32, F32>, Dtypes<F16, F32, F32>>,
    // CollageAdamW light and plus
    Family<PLAIN, PLAIN, GROW, Grads16, Dtypes<BF16, BF16, BF16>, Dtypes<BF16, F32, F32>, Dtypes<F32, F32, F32>>,
    Family<PLAIN, PAIR, GROW, Grads16, Dtypes<BF16, BF16, BF16>, Dtypes<BF16, F32, F32>, Dtypes<F32, F32, F32>>,
    // FP8AdamW: a scaled FP16 master, or a plain FP32/BF16 one; (E4M3, FP16) or (FP32, FP32) moments
    Family<SCALED, SCALED, SCALED_MASTER, GradsFP8, Dtypes<F16S, E4M3, F16>, Dtypes<F16S, F32, F32>>,
    Family<SCALED, SCALED, NEAREST, GradsFP8, Dtypes<F32, E4M3, F16>, Dtypes<BF16, E4M3, F16>, Dtypes<F32, F32, F32>,
           Dtypes<BF16, F32, F32>>,
    // COATAdamW: FP32 θ, or BF16/FP16 θ with δθ
    Family<GROUP_FP8, GROUP_FP8, NEAREST, Grads16, Dtypes<F32, E4M3, E4M3>, Dtypes<F32, E4M3, E5M2>>,
    Family<GROUP_FP8, GROUP_FP8, GROW, Grads16, Dtypes<BF16, E4M3, E4M3>, Dtypes<BF16, E4M3, E5M2>,
           Dtypes<F16, E4M3, E4M3>, Dtypes<F16, E4M3, E5M2>>,
    // Collage8bitAdamW
    Family<BLOCKWISE_8BIT, BLOCKWISE_8BIT, GROW, Grads16, Dtypes<BF16, U8, U8>, Dtypes<F16, U8, U8>>>;

// ---- from the declaration and the row's dtypes to the instantiation ---------------------

template <int TAG, int D, bool EXPAND>
struct FormatOf;
template <int D, bool X> struct FormatOf<PLAIN, D, X> { using type = PlainFormat<D>; };
template <int D, bool X> struct FormatOf<PAIR, D, X> { using type = PairFormat<D>; };
template <int D, bool X> struct FormatOf<SCALED, D, X> { using type = ScaledFormat<D>; };
template <int D, bool X> struct FormatOf<GROUP_FP8, D, X> { using type = GroupFP8Format<D, X>; };
template <bool X> struct FormatOf<BLOCKWISE_8BIT, U8, X> { using type = Blockwise8bitFormat; };

template <int TAG, int P>
struct RuleOf;
template <int P> struct RuleOf<NEAREST, P> { using type = NearestRule<P>; };
template <int P> struct RuleOf<GROW, P> { using type = GrowRule<P>; };
template <int P> struct RuleOf<KAHAN, P> { using type = KahanRule<P>; };
template <int P> struct RuleOf<STOCHASTIC_ROUNDING, P> { using type = StochasticRoundingRule<P>; };
template <int P> struct RuleOf<MASTER, P> { using type = MasterRule<P>; };
template <int P> struct RuleOf<SCALED_MASTER, P> { using type = ScaledMasterRule<P>; };

template <int MF, int VF, int R, int P, int M, int VD, int G, bool X>
inline bool run_typed(int pass, const Row& r, int64_t b, int64_t e, uint32_t* amax) {
  using S = Step<typename FormatOf<MF, M, X>::type, typename FormatOf<VF, VD, X>::type, typename RuleOf<R, P>::type, G>;
  return S::run(pass, r, b, e, amax);
}

template <int MF, int VF, int R, int P, int M, int VD, int G>
inline bool run_expand(int pass, const Row& r, int64_t b, int64_t e, uint32_t* amax) {
  if constexpr (MF == GROUP_FP8 || VF == GROUP_FP8) {
    if (r.expand) return run_typed<MF, VF, R, P, M, VD, G, true>(pass, r, b, e, amax);
  }
  return run_typed<MF, VF, R, P, M, VD, G, false>(pass, r, b, e, amax);
}

template <int MF, int VF, int R, int... G, int P, int M, int VD>
inline bool run_storage(Grads<G...>, Dtypes<P, M, VD>, int pass, const Row& r, int64_t b, int64_t e, uint32_t* amax) {
  if (r.param_dtype != P || r.moment[0].dtype != M || r.moment[1].dtype != VD) return false;
  bool ran = false;
  const bool matched = ((r.grad_dtype == G && ((ran = run_expand<MF, VF, R, P, M, VD, G>(pass, r, b, e, amax)), true)) || ...);
  return matched && ran;
}

template <int MF, int VF, int R, class GL, class... S>
inline bool run_family(Family<MF, VF, R, GL, S...>, const Declaration& d, int pass, const Row& r, int64_t b, int64_t e,
                       uint32_t* amax) {
  if (d.m_format != MF || d.v_format != VF || d.rule != R) return false;
  return (run_storage<MF, VF, R>(GL{}, S{}, pass, r, b, e, amax) || ...);
}

template <class... Fs>
inline bool run_declared(std::tuple<Fs...>*, const Declaration& d, int pass, const Row& r, int64_t b, int64_t e,
                         uint32_t* amax) {
  return (run_family(Fs{}, d, pass, r, b, e, amax) || ...);
}

inline bool step(const Declaration& d, int pass, const Row& r, int64_t b, int64_t e, uint32_t* amax) {
  return run_declared(static_cast<Families*>(nullptr), d, pass, r, b, e, amax);
}

inline Table make_table(const char* name) { return Table{name, step}; }
