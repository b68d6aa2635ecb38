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

// ---- the AdamW core --------------------------------------------------------------------

template <class V>
struct Consts {
  using F = typename V::F;
  F one_minus_beta1, beta2, one_minus_beta2, step, eps, decay;
  explicit Consts(const Row& r)
      : one_minus_beta1(V::set1(r.scalars[ONE_MINUS_BETA1])),
        beta2(V::set1(r.scalars[BETA2])),
        one_minus_beta2(V::set1(r.scalars[ONE_MINUS_BETA2])),
        step(V::set1(r.scalars[STEP])), eps(V::set1(r.scalars[EPS])), decay(V::set1(r.scalars[DECAY])) {}
};

// m₃₂ = m + (1 − β1)·(g − m); v₃₂ = min(β2·v + ((1 − β2)·g)·g, max_v);
// Δθ₃₂ = θ·(−α·λ) + (s·m₃₂)/(√v₃₂ + ε')  (the reference's sequence, operation for operation).
template <class V>
inline void adamw_math(const Consts<V>& c, typename V::F theta, typename V::F g, typename V::F m_old,
                       typename V::F v_old, typename V::F max_v, typename V::F& m, typename V::F& v,
                       typename V::F& delta) {
  m = m_old + c.one_minus_beta1 * (g - m_old);
  v = v_old * c.beta2 + (c.one_minus_beta2 * g) * g;
  v = V::min(max_v, v);  // clamp(max=): NaN is the second operand, so it stays NaN
  auto denominator = V::sqrt(v) + c.eps;
  delta = theta * c.decay + (c.step * m) / denominator;
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

// ---- families --------------------------------------------------------------------------

// bf16-pure / FP32-states / FP32 AdamW: θ ← r(θ + Δθ₃₂); m, v stored once each.
template <int P, int G, int M>
struct AdamWKernel {
  template <class V>
  static inline void step(const Row& r, const Consts<V>& c, int64_t i) {
    typename V::F m, v, delta;
    auto theta = load<V, P>(r.param, i);
    adamw_math<V>(c, theta, load<V, G>(r.grad, i), load<V, M>(r.exp_avg, i), load<V, M>(r.exp_avg_sq, i),
                  V::set1(format_max(M)), m, v, delta);
    store<V, M>(r.exp_avg, i, m);
    store<V, M>(r.exp_avg_sq, i, v);
    store<V, P>(r.param, i, theta + delta);
  }
};

// Collage (light: δθ; plus: also δv): moments as AdamW (plus: v = v + δv first, then
// δv ← r(v₃₂ − r(v₃₂))), then (θ, δθ) ← Grow((θ, δθ), r(Δθ₃₂)) = TwoSum, add, Fast2Sum.
template <int P, int G, int M, bool PLUS>
struct CollageKernel {
  template <class V>
  static inline void step(const Row& r, const Consts<V>& c, int64_t i) {
    typename V::F m, v, delta;
    auto theta = load<V, P>(r.param, i);
    auto v_old = load<V, M>(r.exp_avg_sq, i);
    if constexpr (PLUS) v_old = v_old + load<V, M>(r.v_error, i);
    adamw_math<V>(c, theta, load<V, G>(r.grad, i), load<V, M>(r.exp_avg, i), v_old, V::set1(format_max(M)), m, v,
                  delta);
    store<V, M>(r.exp_avg, i, m);
    store<V, M>(r.exp_avg_sq, i, v);
    if constexpr (PLUS) store<V, M>(r.v_error, i, v - round_to<V, M>(v));
    grow_store<V, P>(r, i, theta, delta);
  }
};

// Kahan: y = r(Δθ₃₂ + k); (θ, k) ← TwoSum(θ, y).
template <int P, int G, int M>
struct KahanKernel {
  template <class V>
  static inline void step(const Row& r, const Consts<V>& c, int64_t i) {
    typename V::F m, v, delta;
    auto theta = load<V, P>(r.param, i);
    adamw_math<V>(c, theta, load<V, G>(r.grad, i), load<V, M>(r.exp_avg, i), load<V, M>(r.exp_avg_sq, i),
                  V::set1(format_max(M)), m, v, delta);
    store<V, M>(r.exp_avg, i, m);
    store<V, M>(r.exp_avg_sq, i, v);
    auto y = round_to<V, P>(load<V, P>(r.theta_state, i) + delta);
    typename V::F s, e;
    two_sum<V, P>(theta, y, s, e);
    store<V, P>(r.param, i, s);
    store<V, P>(r.theta_state, i, e);
  }
};

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

// Stochastic rounding to BF16: θ ← SR(θ + Δθ₃₂); values that are not finite or beyond BF16's
// largest finite value are rounded to nearest, as numerics.stochastic_round.
template <int G, int M>
struct SRKernel {
  template <class V>
  static inline void step(const Row& r, const Consts<V>& c, int64_t i) {
    typename V::F m, v, delta;
    auto theta = load<V, BF16>(r.param, i);
    adamw_math<V>(c, theta, load<V, G>(r.grad, i), load<V, M>(r.exp_avg, i), load<V, M>(r.exp_avg_sq, i),
                  V::set1(format_max(M)), m, v, delta);
    store<V, M>(r.exp_avg, i, m);
    store<V, M>(r.exp_avg_sq, i, v);
    auto target = delta + theta;
    auto random = V::template srl<16>(V::add(V::bits(target), uniform_bits16<V>(r.seed_mix, i)));
    auto magnitude = V::from_bits(V::and_(V::bits(target), V::iset1(0x7FFFFFFF)));
    auto plain = V::not_le(magnitude, V::set1(format_max(BF16)));
    V::store_u16(static_cast<uint16_t*>(r.param) + i, V::iselect(plain, bf16_bits<V>(target), random));
  }
};

// Master weights: FP32 master θ₃₂ ← θ₃₂ + Δθ₃₂ with FP32 moments, the visible weight r(θ₃₂).
template <int P, int G>
struct MasterKernel {
  template <class V>
  static inline void step(const Row& r, const Consts<V>& c, int64_t i) {
    typename V::F m, v, delta;
    auto theta = load<V, F32>(r.theta_state, i);
    adamw_math<V>(c, theta, load<V, G>(r.grad, i), load<V, F32>(r.exp_avg, i), load<V, F32>(r.exp_avg_sq, i),
                  V::set1(format_max(F32)), m, v, delta);
    store<V, F32>(r.exp_avg, i, m);
    store<V, F32>(r.exp_avg_sq, i, v);
    auto updated = theta + delta;
    store<V, F32>(r.theta_state, i, updated);
    store<V, P>(r.param, i, updated);
  }
};

// ---- FP8AdamW (fp8_adamw.fp8_adamw_param_step on dequantized values; two passes) --------

template <class V>
struct FP8Consts : Consts<V> {
  using F = typename V::F;
  F inv_p, g_scale, inv_g, inv_m, inv_v, new_p, new_m, new_v;
  bool has_decay, g_pow2;
  explicit FP8Consts(const Row& r)
      : Consts<V>(r), inv_p(V::set1(r.inv_param_scale)), g_scale(V::set1(r.grad_scale)),
        inv_g(V::set1(r.inv_grad_scale)),
        inv_m(V::set1(r.inv_m_scale)), inv_v(V::set1(r.inv_v_scale)), new_p(V::set1(r.new_param_scale)),
        new_m(V::set1(r.new_m_scale)), new_v(V::set1(r.new_v_scale)), has_decay(r.scalars[DECAY] != 0.0f),
        g_pow2(r.grad_scale_pow2) {}
};

// m = m + (1 − β1)(g − m); v = β2·v + ((1 − β2)·g)·g (no clamp), from the dequantized values.
template <class V, int G, int M, int VD>
inline void fp8_moments(const Row& r, const FP8Consts<V>& c, int64_t i, typename V::F& m, typename V::F& v) {
  auto g = load<V, G>(r.grad, i);
  // g = q/s: a clipping factor makes s a non-power of two, where only the division is exact.
  if constexpr (G == E4M3 || G == E5M2) g = c.g_pow2 ? g * c.inv_g : g / c.g_scale;
  auto m_old = load<V, M>(r.exp_avg, i) * c.inv_m;  // power-of-two scales: exact
  m = m_old + c.one_minus_beta1 * (g - m_old);
  v = (load<V, VD>(r.exp_avg_sq, i) * c.inv_v) * c.beta2 + (c.one_minus_beta2 * g) * g;
}

// (θ', m, v) in real units: m = m + (1 − β1)(g − m); v = β2·v + ((1 − β2)·g)·g (no clamp);
// u = (s·m)/(√v + ε'); u = u + (−α·λ)·θ when λ ≠ 0; θ' = θ + u.
template <class V, int P, int G, int M, int VD>
inline void fp8_adamw_math(const Row& r, const FP8Consts<V>& c, int64_t i, typename V::F& updated,
                           typename V::F& m, typename V::F& v) {
  auto real = load<V, P>(r.param, i);
  if constexpr (P == F16S) real = real * c.inv_p;
  fp8_moments<V, G, M, VD>(r, c, i, m, v);
  auto update = (c.step * m) / (V::sqrt(v) + c.eps);
  if (c.has_decay) update = update + c.decay * real;
  updated = real + update;
}

// payload = cast(clamp(y, −L, L) + (y − y)), y = x·s: ±inf and NaN become NaN (fp8.scaled.quantize).
template <class V, int D>
inline void store_scaled(void* base, int64_t i, typename V::F x, typename V::F scale) {
  if constexpr (D == F32) {
    store<V, F32>(base, i, x);
  } else {
    auto y = x * scale;
    auto limit = V::set1(format_max(D));
    auto clamped = V::min(limit, V::max(V::set1(-format_max(D)), y));
    store<V, D>(base, i, clamped + (y - y));
  }
}

template <int P, int G, int M, int VD>
struct FP8AmaxKernel {
  template <class V>
  static inline void step(const Row& r, const FP8Consts<V>& c, int64_t i, typename V::I* amax) {
    typename V::F updated, m, v;
    auto magnitude = V::iset1(0x7FFFFFFF);
    if constexpr (P == F16S) {
      fp8_adamw_math<V, P, G, M, VD>(r, c, i, updated, m, v);
      // |x| as bits orders like |x| (NaN above +inf), so an integer max is the amax.
      amax[2] = V::imax(amax[2], V::and_(V::bits(updated), magnitude));
    } else {  // an unscaled master needs no amax: the moments only, no root or division
      fp8_moments<V, G, M, VD>(r, c, i, m, v);
    }
    amax[0] = V::imax(amax[0], V::and_(V::bits(m), magnitude));
    amax[1] = V::imax(amax[1], V::and_(V::bits(v), magnitude));
  }
};

template <int P, int G, int M, int VD>
struct FP8StoreKernel {
  template <class V>
  static inline void step(const Row& r, const FP8Consts<V>& c, int64_t i) {
    typename V::F updated, m, v;
    fp8_adamw_math<V, P, G, M, VD>(r, c, i, updated, m, v);
    store_scaled<V, M>(r.exp_avg, i, m, c.new_m);
    store_scaled<V, VD>(r.exp_avg_sq, i, v, c.new_v);
    if constexpr (P == F16S) {
      store_scaled<V, F16>(r.param, i, updated, c.new_p);
    } else {
      store<V, P>(r.param, i, updated);
    }
  }
};

// ---- loops and dtype dispatch ----------------------------------------------------------

template <class K>
inline void run(const Row& r, int64_t begin, int64_t end) {
  const Consts<V> c(r);
  int64_t i = begin;
  for (; i + V::W <= end; i += V::W) K::template step<V>(r, c, i);
  if (i < end) {
    const Consts<VS> cs(r);
    for (; i < end; ++i) K::template step<VS>(r, cs, i);
  }
}

template <class K>
inline void run_amax(const Row& r, int64_t begin, int64_t end, uint32_t* out) {
  const FP8Consts<V> c(r);
  typename V::I acc[3] = {V::iset1(0), V::iset1(0), V::iset1(0)};
  int64_t i = begin;
  for (; i + V::W <= end; i += V::W) K::template step<V>(r, c, i, acc);
  uint32_t lanes[3][V::W > 0 ? V::W : 1];
  for (int k = 0; k < 3; ++k) V::store_i(lanes[k], acc[k]);
  uint32_t result[3] = {0, 0, 0};
  for (int k = 0; k < 3; ++k)
    for (int l = 0; l < V::W; ++l) result[k] = lanes[k][l] > result[k] ? lanes[k][l] : result[k];
  if (i < end) {
    const FP8Consts<VS> cs(r);
    VS::I tail[3] = {result[0], result[1], result[2]};
    for (; i < end; ++i) K::template step<VS>(r, cs, i, tail);
    for (int k = 0; k < 3; ++k) result[k] = tail[k];
  }
  for (int k = 0; k < 3; ++k) out[k] = result[k];
}

template <class K>
inline void run_fp8(const Row& r, int64_t begin, int64_t end) {
  const FP8Consts<V> c(r);
  int64_t i = begin;
  for (; i + V::W <= end; i += V::W) K::template step<V>(r, c, i);
  if (i < end) {
    const FP8Consts<VS> cs(r);
    for (; i < end; ++i) K::template step<VS>(r, cs, i);
  }
}

// Gradient dtype dispatch: FP32, BF16, FP16 for the AdamW families.
#define HFL_GRAD_SWITCH(G_VAR, CALL)            \
  switch (G_VAR) {                              \
    case F32: { constexpr int G = F32; CALL; return true; }   \
    case BF16: { constexpr int G = BF16; CALL; return true; } \
    case F16: { constexpr int G = F16; CALL; return true; }   \
    default: return false;                      \
  }

inline bool adamw_range(const Row& r, int64_t b, int64_t e, uint32_t*) {
  if (r.moment_dtype == F32) {
    constexpr int M = F32;
    switch (r.param_dtype) {
      case F32: { constexpr int P = F32; HFL_GRAD_SWITCH(r.grad_dtype, (run<AdamWKernel<P, G, M>>(r, b, e))) }
      case BF16: { constexpr int P = BF16; HFL_GRAD_SWITCH(r.grad_dtype, (run<AdamWKernel<P, G, M>>(r, b, e))) }
      case F16: { constexpr int P = F16; HFL_GRAD_SWITCH(r.grad_dtype, (run<AdamWKernel<P, G, M>>(r, b, e))) }
      default: return false;
    }
  }
  if (r.moment_dtype == BF16 && r.param_dtype == BF16) {
    constexpr int M = BF16, P = BF16;
    HFL_GRAD_SWITCH(r.grad_dtype, (run<AdamWKernel<P, G, M>>(r, b, e)))
  }
  return false;
}

template <bool PLUS>
inline bool collage_range(const Row& r, int64_t b, int64_t e, uint32_t*) {
  if (r.param_dtype == BF16 && r.moment_dtype == BF16) {
    constexpr int P = BF16, M = BF16;
    HFL_GRAD_SWITCH(r.grad_dtype, (run<CollageKernel<P, G, M, PLUS>>(r, b, e)))
  }
  if (r.param_dtype == BF16 && r.moment_dtype == F32) {
    constexpr int P = BF16, M = F32;
    HFL_GRAD_SWITCH(r.grad_dtype, (run<CollageKernel<P, G, M, PLUS>>(r, b, e)))
  }
  if (r.param_dtype == F32 && r.moment_dtype == F32) {
    constexpr int P = F32, M = F32;
    HFL_GRAD_SWITCH(r.grad_dtype, (run<CollageKernel<P, G, M, PLUS>>(r, b, e)))
  }
  return false;
}

inline bool collage_light_range(const Row& r, int64_t b, int64_t e, uint32_t* a) { return collage_range<false>(r, b, e, a); }
inline bool collage_plus_range(const Row& r, int64_t b, int64_t e, uint32_t* a) { return collage_range<true>(r, b, e, a); }

inline bool kahan_range(const Row& r, int64_t b, int64_t e, uint32_t*) {
  if (r.param_dtype == BF16 && r.moment_dtype == BF16) {
    constexpr int P = BF16, M = BF16;
    HFL_GRAD_SWITCH(r.grad_dtype, (run<KahanKernel<P, G, M>>(r, b, e)))
  }
  if (r.param_dtype == F16 && r.moment_dtype == F32) {
    constexpr int P = F16, M = F32;
    HFL_GRAD_SWITCH(r.grad_dtype, (run<KahanKernel<P, G, M>>(r, b, e)))
  }
  if (r.param_dtype == BF16 && r.moment_dtype == F32) {
    constexpr int P = BF16, M = F32;
    HFL_GRAD_SWITCH(r.grad_dtype, (run<KahanKernel<P, G, M>>(r, b, e)))
  }
  return false;
}

inline bool sr_range(const Row& r, int64_t b, int64_t e, uint32_t*) {
  if (r.param_dtype != BF16) return false;
  if (r.moment_dtype == BF16) {
    constexpr int M = BF16;
    HFL_GRAD_SWITCH(r.grad_dtype, (run<SRKernel<G, M>>(r, b, e)))
  }
  if (r.moment_dtype == F32) {
    constexpr int M = F32;
    HFL_GRAD_SWITCH(r.grad_dtype, (run<SRKernel<G, M>>(r, b, e)))
  }
  return false;
}

inline bool master_range(const Row& r, int64_t b, int64_t e, uint32_t*) {
  switch (r.param_dtype) {
    case BF16: { constexpr int P = BF16; HFL_GRAD_SWITCH(r.grad_dtype, (run<MasterKernel<P, G>>(r, b, e))) }
    case F16: { constexpr int P = F16; HFL_GRAD_SWITCH(r.grad_dtype, (run<MasterKernel<P, G>>(r, b, e))) }
    case F32: { constexpr int P = F32; HFL_GRAD_SWITCH(r.grad_dtype, (run<MasterKernel<P, G>>(r, b, e))) }
    default: return false;
  }
}

// FP8AdamW: (m, v) formats (E4M3, FP16) as FP8-LM, or (FP32, FP32) for the parameters kept in
// high precision; masters scaled FP16 (F16S), FP32 or BF16; gradients FP8 with a scale, or FP32/BF16/FP16.
#define HFL_FP8_GRAD_SWITCH(CALL)                                \
  switch (r.grad_dtype) {                                        \
    case E4M3: { constexpr int G = E4M3; CALL; return true; }    \
    case E5M2: { constexpr int G = E5M2; CALL; return true; }    \
    case F32: { constexpr int G = F32; CALL; return true; }      \
    case BF16: { constexpr int G = BF16; CALL; return true; }    \
    case F16: { constexpr int G = F16; CALL; return true; }      \
    default: return false;                                       \
  }

#define HFL_FP8_DISPATCH(RUNNER, KERNEL, ...)                                                                   \
  if (r.moment_dtype == E4M3 && r.exp_avg_sq_dtype == F16) {                                                    \
    constexpr int M = E4M3, VD = F16;                                                                           \
    switch (r.param_dtype) {                                                                                    \
      case F16S: { constexpr int P = F16S; HFL_FP8_GRAD_SWITCH((RUNNER<KERNEL<P, G, M, VD>>(__VA_ARGS__))) }    \
      case F32: { constexpr int P = F32; HFL_FP8_GRAD_SWITCH((RUNNER<KERNEL<P, G, M, VD>>(__VA_ARGS__))) }      \
      case BF16: { constexpr int P = BF16; HFL_FP8_GRAD_SWITCH((RUNNER<KERNEL<P, G, M, VD>>(__VA_ARGS__))) }    \
      default: return false;                                                                                    \
    }                                                                                                           \
  }                                                                                                             \
  if (r.moment_dtype == F32 && r.exp_avg_sq_dtype == F32) {                                                     \
    constexpr int M = F32, VD = F32;                                                                            \
    switch (r.param_dtype) {                                                                                    \
      case F16S: { constexpr int P = F16S; HFL_FP8_GRAD_SWITCH((RUNNER<KERNEL<P, G, M, VD>>(__VA_ARGS__))) }    \
      case F32: { constexpr int P = F32; HFL_FP8_GRAD_SWITCH((RUNNER<KERNEL<P, G, M, VD>>(__VA_ARGS__))) }      \
      case BF16: { constexpr int P = BF16; HFL_FP8_GRAD_SWITCH((RUNNER<KERNEL<P, G, M, VD>>(__VA_ARGS__))) }    \
      default: return false;                                                                                    \
    }                                                                                                           \
  }                                                                                                             \
  return false;

inline bool fp8_amax_range(const Row& r, int64_t b, int64_t e, uint32_t* amax) {
  HFL_FP8_DISPATCH(run_amax, FP8AmaxKernel, r, b, e, amax)
}

inline bool fp8_store_range(const Row& r, int64_t b, int64_t e, uint32_t*) {
  HFL_FP8_DISPATCH(run_fp8, FP8StoreKernel, r, b, e)
}


// ---- COAT: per-group FP8 moments with dynamic range expansion (coat.state) -------------

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

template <class V>
inline typename V::F copysign_(typename V::F magnitude, typename V::F sign_of) {
  auto sign = V::and_(V::bits(sign_of), V::iset1(0x80000000u));
  return V::from_bits(V::or_(V::and_(V::bits(magnitude), V::iset1(0x7FFFFFFF)), sign));
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
inline typename V::F decode(const void* payload, int64_t i, const GroupCode<V>& code) {
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

// coat.quantize_state of one group held in `buf` (FP32, `size` elements, a multiple of V::W):
// amax, amin (smallest non-zero |x|), k and c (expansion), |x| ← (|x|/c)^k, s = F/amax (NaN if
// amax is not finite, 1 if 0), payload = cast(clamp(x·s) + (x·s − x·s)).
template <int D, bool EXPAND>
inline void encode_group(float* buf, int64_t size, void* payload, int64_t base, float* const* meta, int64_t g) {
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
  float s = amax > 0.0f ? (1.0f / amax) * limit : 1.0f;
  if (!(VS::bits(amax) < 0x7F800000u)) s = VS::from_bits(0x7FC00000u);  // inf or NaN amax: NaN scale
  auto sv = V::set1(s);
  for (int64_t j = 0; j < size; j += V::W) store_scaled<V, D>(payload, base + j, V::load_f32(buf + j), sv);
  meta[0][g] = s;
  meta[1][g] = k;
  meta[2][g] = c;
}

template <class V, int P, int G, int VM, bool EXPAND>
inline void coat_element(const Row& r, const Consts<V>& c, const GroupCode<V>& mc, const GroupCode<V>& vc,
                         int64_t i, float* mbuf, float* vbuf) {
  typename V::F m, v, delta;
  auto theta = load<V, P>(r.param, i);
  auto m_old = decode<V, E4M3, EXPAND>(r.exp_avg, i, mc);
  auto v_old = decode<V, VM, EXPAND>(r.exp_avg_sq, i, vc);
  adamw_math<V>(c, theta, load<V, G>(r.grad, i), m_old, v_old, V::set1(format_max(F32)), m, v, delta);
  if constexpr (P == F32) {
    store<V, F32>(r.param, i, theta + delta);
  } else {
    grow_store<V, P>(r, i, theta, delta);
  }
  V::store_f32(mbuf, m);
  V::store_f32(vbuf, v);
}

// Groups [begin, end) of one row (begin a multiple of the group size): decode, AdamW, the
// parameter update, encode m and v with fresh per-group (s, k, c). A last partial group is
// padded with zeros for the encoding, as coat.quantize_state pads.
template <int P, int G, int VM, bool EXPAND>
inline void coat_run(const Row& r, int64_t begin, int64_t end) {
  const int64_t size = r.group_size;
  alignas(64) float mbuf[kMaxGroup];
  alignas(64) float vbuf[kMaxGroup];
  const Consts<V> c(r);
  const Consts<VS> cs(r);
  for (int64_t base = begin; base < end; base += size) {
    const int64_t g = base / size;
    const int64_t count = size < r.numel - base ? size : r.numel - base;
    {
      const GroupCode<V> mc(r.m_meta, g), vc(r.v_meta, g);
      int64_t j = 0;
      for (; j + V::W <= count; j += V::W) coat_element<V, P, G, VM, EXPAND>(r, c, mc, vc, base + j, mbuf + j, vbuf + j);
      if (j < count) {
        const GroupCode<VS> mcs(r.m_meta, g), vcs(r.v_meta, g);
        for (; j < count; ++j) coat_element<VS, P, G, VM, EXPAND>(r, cs, mcs, vcs, base + j, mbuf + j, vbuf + j);
      }
      for (; j < size; ++j) mbuf[j] = vbuf[j] = 0.0f;
    }
    encode_group<E4M3, EXPAND>(mbuf, size, r.exp_avg, base, r.m_meta, g);
    encode_group<VM, EXPAND>(vbuf, size, r.exp_avg_sq, base, r.v_meta, g);
  }
}

#define HFL_COAT_GRAD(P_, VM_, EXPAND_)                                                           \
  switch (r.grad_dtype) {                                                                         \
    case F32: coat_run<P_, F32, VM_, EXPAND_>(r, b, e); return true;                              \
    case BF16: coat_run<P_, BF16, VM_, EXPAND_>(r, b, e); return true;                            \
    case F16: coat_run<P_, F16, VM_, EXPAND_>(r, b, e); return true;                              \
    default: return false;                                                                        \
  }

template <int P, int VM>
inline bool coat_dispatch_expand(const Row& r, int64_t b, int64_t e) {
  if (r.expand) {
    HFL_COAT_GRAD(P, VM, true)
  } else {
    HFL_COAT_GRAD(P, VM, false)
  }
}

template <int P>
inline bool coat_dispatch_v(const Row& r, int64_t b, int64_t e) {
  if (r.moment_dtype != E4M3) return false;
  if (r.exp_avg_sq_dtype == E4M3) return coat_dispatch_expand<P, E4M3>(r, b, e);
  if (r.exp_avg_sq_dtype == E5M2) return coat_dispatch_expand<P, E5M2>(r, b, e);
  return false;
}

inline bool coat_range(const Row& r, int64_t b, int64_t e, uint32_t*) {
  if (r.group_size <= 0 || r.group_size > kMaxGroup || r.group_size % V::W) return false;
  switch (r.param_dtype) {
    case F32: return coat_dispatch_v<F32>(r, b, e);
    case BF16: return coat_dispatch_v<BF16>(r, b, e);
    case F16: return coat_dispatch_v<F16>(r, b, e);
    default: return false;
  }
}

// ---- blockwise 8-bit states (formats.Blockwise8bit): dynamic-map codes, absmax per block ----

// The index of the nearest map value, ties to the lower one (torch.bucketize over the
// midpoints): the lookup table gives, for x's top 16 bits, the number of midpoints below every
// float with those bits; at most one midpoint lies among them (checked where the table is
// built), the next one, so one comparison finishes the count. NaN takes bucketize's code.
template <class V>
inline typename V::I map_encode(const Row& r, int map, typename V::F x) {
  auto base = V::gather_u8(r.map_base[map], V::template srl<16>(V::bits(x)));
  auto above = V::lt(V::gather(r.map_mids[map], base), x);
  auto code = V::iselect(above, V::add(base, V::iset1(1)), base);
  return V::iselect(V::isnan(x), V::iset1(r.map_nan[map]), code);
}

template <class V, int P, int G>
inline void eightbit_element(const Row& r, const Consts<V>& c, typename V::F m_absmax, typename V::F v_absmax,
                             int64_t i, float* mbuf, float* vbuf) {
  typename V::F m, v, delta;
  auto theta = load<V, P>(r.param, i);
  auto m_old = V::gather(r.map_values[0], V::load_u8(static_cast<const uint8_t*>(r.exp_avg) + i)) * m_absmax;
  auto v_old = V::gather(r.map_values[1], V::load_u8(static_cast<const uint8_t*>(r.exp_avg_sq) + i)) * v_absmax;
  adamw_math<V>(c, theta, load<V, G>(r.grad, i), m_old, v_old, V::set1(format_max(F32)), m, v, delta);
  grow_store<V, P>(r, i, theta, delta);
  V::store_f32(mbuf, m);
  V::store_f32(vbuf, v);
}

// Encode one block held in `buf` (FP32, `size` elements, a multiple of V::W): a = max|x| (NaN
// above inf), x / (a > 0 ? a : 1), clamped at 0 for the unsigned map, then the codes; absmax = a.
template <int MAP>
inline void encode_block(const Row& r, float* buf, int64_t size, uint8_t* codes, float* absmax) {
  typename V::I amax_v = V::iset1(0);
  for (int64_t j = 0; j < size; j += V::W) {
    amax_v = V::imax(amax_v, V::and_(V::bits(V::load_f32(buf + j)), V::iset1(0x7FFFFFFF)));
  }
  const float amax = VS::from_bits(reduce_max<V>(amax_v));
  const auto divisor = V::set1(amax > 0.0f ? amax : 1.0f);
  for (int64_t j = 0; j < size; j += V::W) {
    auto x = V::load_f32(buf + j) / divisor;
    if constexpr (MAP == 1) x = V::max(V::set1(0.0f), x);  // clamp(min=0): NaN stays NaN
    V::store_u8(codes + j, map_encode<V>(r, MAP, x));
  }
  *absmax = amax;
}

// Blocks [begin, end) of one row (begin a multiple of the block): decode, AdamW, Grow, encode.
// A last partial block runs its padding as the reference pads it (θ = g = 0, the stored codes
// of the padding decoded), so the block's absmax and codes match.
template <int P, int G>
inline void eightbit_run(const Row& r, int64_t begin, int64_t end) {
  const int64_t size = r.group_size;
  alignas(64) float mbuf[kMaxGroup];
  alignas(64) float vbuf[kMaxGroup];
  const Consts<V> c(r);
  const Consts<VS> cs(r);
  auto* m_codes = static_cast<uint8_t*>(r.exp_avg);
  auto* v_codes = static_cast<uint8_t*>(r.exp_avg_sq);
  for (int64_t base = begin; base < end; base += size) {
    const int64_t g = base / size;
    const int64_t count = size < r.numel - base ? size : r.numel - base;
    const float ma = r.m_meta[0][g], va = r.v_meta[0][g];
    int64_t j = 0;
    for (; j + V::W <= count; j += V::W) {
      eightbit_element<V, P, G>(r, c, V::set1(ma), V::set1(va), base + j, mbuf + j, vbuf + j);
    }
    for (; j < count; ++j) eightbit_element<VS, P, G>(r, cs, ma, va, base + j, mbuf + j, vbuf + j);
    for (; j < size; ++j) {
      float delta;
      adamw_math<VS>(cs, 0.0f, 0.0f, r.map_values[0][m_codes[base + j]] * ma, r.map_values[1][v_codes[base + j]] * va,
                     format_max(F32), mbuf[j], vbuf[j], delta);
    }
    encode_block<0>(r, mbuf, size, m_codes + base, r.m_meta[0] + g);
    encode_block<1>(r, vbuf, size, v_codes + base, r.v_meta[0] + g);
  }
}

inline bool eightbit_range(const Row& r, int64_t b, int64_t e, uint32_t*) {
  if (r.group_size <= 0 || r.group_size > kMaxGroup || r.group_size % V::W) return false;
  if (r.moment_dtype != U8 || r.exp_avg_sq_dtype != U8) return false;
  switch (r.param_dtype) {
    case BF16: { constexpr int P = BF16; HFL_GRAD_SWITCH(r.grad_dtype, (eightbit_run<P, G>(r, b, e))) }
    case F16: { constexpr int P = F16; HFL_GRAD_SWITCH(r.grad_dtype, (eightbit_run<P, G>(r, b, e))) }
    default: return false;
  }
}

inline Table make_table(const char* name) {
  return Table{name, adamw_range, collage_light_range, collage_plus_range, kahan_range,
               sr_range, master_range, fp8_amax_range, fp8_store_range, coat_range, eightbit_range};
}
