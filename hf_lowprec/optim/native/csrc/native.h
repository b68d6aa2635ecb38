// Shared declarations of the native CPU optimizer kernels (hf_lowprec.optim.native).
//
// One AdamW step, written once (kernels_impl.h) over a (m format, v format, update rule)
// declaration, as the Python core composes `formats` and `rules`. Each instruction-set
// translation unit (isa_scalar.cpp, isa_avx2.cpp, isa_avx512*.cpp) compiles it for its vector
// width and exports one `Table`; bindings.cpp, the one Python entry point, reads the
// declaration and the state tensors by name, picks a table at run time (CPU features, or
// HF_LOWPREC_CPU_ISA), splits the bucket into blocks and runs them on ATen's thread pool.
//
// Adding a family: one line in kernels_impl.h's `Families` (its tags and the storage dtypes it
// runs) and its composition on the Python side; a new format or rule is one struct here and one
// in kernels_impl.h, and the name of its state tensors in bindings.cpp.
#pragma once

#include <cstdint>
#include <tuple>
#include <type_traits>

namespace hfl {

// Storage dtypes. F16S is a scaled FP16 master (rule SCALED_MASTER): payload = saturate(real·s);
// U8 the codes of the blockwise 8-bit states.
enum DType : int { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3, E5M2 = 4, F16S = 5, U8 = 6 };

// How a moment is stored (hf_lowprec.optim.formats): Plain, Pair (value + error), Scaled (one
// power-of-two scale per tensor), GroupFP8 (COAT: per-group scale, exponent, centre) and
// Blockwise8bit (dynamic-map codes, absmax per block).
enum FormatTag : int { PLAIN = 0, PAIR = 1, SCALED = 2, GROUP_FP8 = 3, BLOCKWISE_8BIT = 4 };

// How the update reaches θ (hf_lowprec.optim.rules).
enum RuleTag : int { NEAREST = 0, GROW = 1, KAHAN = 2, STOCHASTIC_ROUNDING = 3, MASTER = 4, SCALED_MASTER = 5 };

// Slots of the per-parameter scalar vector (hf_lowprec.optim.native.adamw_scalars).
enum Slot : int { ONE_MINUS_BETA1 = 0, BETA2 = 1, ONE_MINUS_BETA2 = 2, STEP = 3, EPS = 4, DECAY = 5 };

// A family as Python declares it: the tags of its m and v formats and of its rule.
struct Declaration {
  int m_format = PLAIN, v_format = PLAIN, rule = NEAREST;
};

// One stored moment of a row (m or v): its payload and whatever its format keeps beside it.
struct Moment {
  void* payload = nullptr;
  int dtype = F32;
  void* error = nullptr;                    // Pair: the error component, payload's dtype
  float* meta[3] = {nullptr, nullptr, nullptr};  // GroupFP8: (scale, exponent, centre) per group;
                                            // Blockwise8bit: absmax per block in meta[0]
  float inv_scale = 1, new_scale = 1;       // Scaled: real = payload·inv_scale; pass 2's scale
  // Blockwise8bit: the map's 256 values, its 255 midpoints and a +inf sentinel, the code below
  // each 16-bit key (an FP32's top half), the code of NaN; `nonnegative`: clamp at 0 first.
  // GroupFP8 and Scaled: `nonnegative` is `keep_nonzero` (a second moment: no non-zero value
  // stored as 0).
  const float* map_values = nullptr;
  const float* map_mids = nullptr;
  const uint8_t* map_lookup = nullptr;
  uint32_t map_nan = 0;
  bool nonnegative = false;
};

// One contiguous flat tensor of a bucket, and everything its step reads besides the elements.
struct Row {
  void* param = nullptr;         // θ (SCALED_MASTER: the FP16 payload)
  const void* grad = nullptr;    // g
  void* theta_state = nullptr;   // δθ (GROW), k (KAHAN), the FP32 master (MASTER)
  int param_dtype = F32, grad_dtype = F32;
  Moment moment[2];              // m, v
  float scalars[6] = {0, 0, 0, 0, 0, 0};
  uint32_t seed_mix = 0;         // STOCHASTIC_ROUNDING: seed·0x9E3779B9 mod 2^32
  float inv_param_scale = 1, new_param_scale = 1;  // SCALED_MASTER: real = payload·(1/s); pass 2's s
  // An FP8 gradient: real = payload / s; a power-of-two s (no clipping factor) is applied as
  // the exact product with 1/s: the same correctly rounded quotient, no division per element.
  float grad_scale = 1, inv_grad_scale = 1;
  bool grad_scale_pow2 = false;
  int64_t numel = 0;
  int64_t group_size = 1;        // GroupFP8 / Blockwise8bit: elements per group (payloads padded)
  bool expand = false;           // GroupFP8: dynamic range expansion
};

// Largest group the kernels take (their per-group buffers live on the stack).
constexpr int64_t kMaxGroup = 1024;

// Passes of a step. Formats with one scale per tensor need the new values' amax before any is
// stored: pass AMAX returns the bit patterns of max|m|, max|v|, max|θ'| over the range (NaN
// above +inf) and STORE recomputes and stores; every other family stores in its one pass.
enum Pass : int { STORE = 0, AMAX = 1 };

// Runs pass `pass` of the declared family over elements [begin, end) of one row; false when
// this build has no kernel for the declaration and the row's dtypes (nothing is written then).
// With begin == end it only answers that question.
using StepFn = bool (*)(const Declaration& d, int pass, const Row& row, int64_t begin, int64_t end, uint32_t* amax);

// Whether the declared family has one scale per tensor (two passes), or groups (blocks must
// start on a group boundary).
bool two_passes(const Declaration& d);
bool grouped(const Declaration& d);

struct Table {
  const char* name;
  StepFn step;
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
