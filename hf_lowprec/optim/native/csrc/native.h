// Shared declarations of the native CPU optimizer kernels (hf_lowprec.optim.native).
//
// Each instruction-set translation unit (isa_scalar.cpp, isa_avx2.cpp, isa_avx512.cpp) compiles
// the same kernel templates (kernels_impl.h) for its vector width and exports one `Table` of
// entry points. bindings.cpp picks a table at run time (CPU features, or HF_LOWPREC_CPU_ISA),
// splits each bucket of tensors into blocks and runs the blocks on ATen's thread pool.
#pragma once

#include <cstdint>
#include <type_traits>

namespace hfl {

// Storage formats. F16S is a scaled FP16 master (FP8AdamW): payload = saturate(real·s); U8 the
// codes of the blockwise 8-bit states.
enum DType : int { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3, E5M2 = 4, F16S = 5, U8 = 6 };

// Slots of the per-parameter scalar vector (hf_lowprec.optim.native.adamw_scalars).
enum Slot : int { ONE_MINUS_BETA1 = 0, BETA2 = 1, ONE_MINUS_BETA2 = 2, STEP = 3, EPS = 4, DECAY = 5 };

// One contiguous flat tensor of a bucket, and everything its step reads besides the elements.
struct Row {
  void* param = nullptr;         // θ (FP8AdamW: payload of a scaled FP16 master, or plain)
  const void* grad = nullptr;    // g
  void* exp_avg = nullptr;       // m
  void* exp_avg_sq = nullptr;    // v
  void* theta_state = nullptr;   // δθ (Collage), k (Kahan), FP32 master (master-weight)
  void* v_error = nullptr;       // δv (Collage-plus)
  int param_dtype = F32, grad_dtype = F32, moment_dtype = F32, theta_state_dtype = F32;
  int exp_avg_sq_dtype = F32;    // FP8AdamW only (m and v differ there)
  float scalars[6] = {0, 0, 0, 0, 0, 0};
  uint32_t seed_mix = 0;         // stochastic rounding: seed·0x9E3779B9 mod 2^32
  // FP8AdamW: reciprocal scales of the stored values (real = payload·(1/s)), the gradient's
  // scale (real = payload / s), and the new scales of pass 2.
  float inv_param_scale = 1, grad_scale = 1, inv_m_scale = 1, inv_v_scale = 1;
  float new_param_scale = 1, new_m_scale = 1, new_v_scale = 1;
  // A power-of-two gradient scale (no clipping factor) is applied as the exact product with
  // 1/s: the same correctly rounded quotient, without a division per element.
  float inv_grad_scale = 1;
  bool grad_scale_pow2 = false;
  int64_t numel = 0;
  // COAT: per-group (scale, exponent k, centre c) of m and v, FP32, one per group of
  // `group_size` elements; payloads padded to whole groups; `expand` = dynamic range expansion.
  float* m_meta[3] = {nullptr, nullptr, nullptr};
  float* v_meta[3] = {nullptr, nullptr, nullptr};
  int64_t group_size = 0;
  bool expand = false;
  // Blockwise 8-bit (formats.Blockwise8bit): per map (0: m, signed; 1: v, unsigned) its 256
  // values, its 255 midpoints and a +inf sentinel, the lookup table of the code below each
  // 16-bit key (an FP32's top half) and the code of NaN; the absmax per block of `group_size`
  // in m_meta[0] and v_meta[0].
  const float* map_values[2] = {nullptr, nullptr};
  const float* map_mids[2] = {nullptr, nullptr};
  const uint8_t* map_base[2] = {nullptr, nullptr};
  uint32_t map_nan[2] = {0, 0};
};

// Largest COAT group the kernels take (their per-group buffers live on the stack).
constexpr int64_t kMaxGroup = 1024;

// Runs elements [begin, end) of one row. `amax` (FP8AdamW pass 1 only) receives the
// bit patterns of max|m|, max|v|, max|θ'| over the range (NaN above +inf).
using RangeFn = bool (*)(const Row& row, int64_t begin, int64_t end, uint32_t* amax);

struct Table {
  const char* name;
  RangeFn adamw, collage_light, collage_plus, kahan, sr, master, fp8_amax, fp8_store, coat, eightbit;
};

const Table* table_scalar();
const Table* table_avx2();
const Table* table_avx512();
const Table* table_avx512bf16();

// Whether vector traits V round FP32 to BF16 in hardware where that is exact (AVX512-BF16).
template <class T, class = void>
struct HasBF16Hw : std::false_type {};
template <class T>
struct HasBF16Hw<T, std::void_t<decltype(T::kBF16Hw)>> : std::true_type {};

}  // namespace hfl
