// The one Python entry point of the native CPU optimizer kernels: a family's declaration (the
// tags of its m format, v format and rule) and its tensors by name in; argument checks before
// anything is written, the ISA's table, blocks over ATen's thread pool (OpenMP in PyTorch's CPU
// builds), and the per-tensor scales of the two-pass families.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "native.h"

namespace hfl {

bool two_passes(const Declaration& d) { return d.m_format == SCALED || d.v_format == SCALED || d.rule == SCALED_MASTER; }

bool grouped(const Declaration& d) {
  return d.m_format == GROUP_FP8 || d.m_format == BLOCKWISE_8BIT || d.v_format == GROUP_FP8 ||
         d.v_format == BLOCKWISE_8BIT;
}

namespace {

using TensorList = std::vector<at::Tensor>;
using OptionalList = std::vector<std::optional<at::Tensor>>;
using Named = std::map<std::string, OptionalList>;  // name -> one tensor (or None) per parameter
using Shared = std::map<std::string, TensorList>;   // name -> tensors of the whole call (maps)
using Options = std::map<std::string, int64_t>;

constexpr const char* kFn = "hf_lowprec native step";

// Elements per block of work: a multiple of every vector width, large enough that a block's
// fixed cost (dispatch on dtypes, broadcasting the scalars) is negligible.
constexpr int64_t kBlock = 1 << 15;
// A bucket smaller than this runs on the calling thread (no parallel region to open).
constexpr int64_t kParallelMin = 1 << 15;

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool cpu_has_avx512bf16() { return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16"); }

const Table* table_for(int64_t isa) {
  switch (isa) {
    case kAvx512Bf16:
      TORCH_CHECK(cpu_has_avx512bf16(), "hf_lowprec native optimizer: the avx512_bf16 kernels need AVX512-BF16, "
                  "which this CPU lacks; unset HF_LOWPREC_CPU_ISA or set it to avx512, avx2 or scalar");
      return table_avx512bf16();
    case kAvx512:
      TORCH_CHECK(cpu_has_avx512(), "hf_lowprec native optimizer: the AVX-512 kernels need AVX512F/BW/VL/DQ, "
                  "which this CPU lacks; unset HF_LOWPREC_CPU_ISA or set it to avx2 or scalar");
      return table_avx512();
    case kAvx2:
      TORCH_CHECK(cpu_has_avx2(), "hf_lowprec native optimizer: the AVX2 kernels need AVX2 and F16C, which this CPU "
                  "lacks; unset HF_LOWPREC_CPU_ISA or set it to scalar");
      return table_avx2();
    case kScalar:
      return table_scalar();
    default:
      TORCH_CHECK(false, "hf_lowprec native optimizer: unknown ISA code ", isa);
  }
}

std::string best_isa() {
  return cpu_has_avx512bf16() ? "avx512_bf16" : cpu_has_avx512() ? "avx512" : cpu_has_avx2() ? "avx2" : "scalar";
}

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return F32;
    case at::kBFloat16: return BF16;
    case at::kHalf: return F16;
    case at::kFloat8_e4m3fn: return E4M3;
    case at::kFloat8_e5m2: return E5M2;
    case at::kByte: return U8;
    default: return -1;
  }
}

const char* dtype_name(int code) {
  static const char* const names[] = {"float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2",
                                      "float16 (scaled master)", "uint8"};
  return code >= 0 && code <= U8 ? names[code] : "unknown";
}

// The tags by the names the Python formats and rules declare (`native_name`).
const std::pair<const char*, int> kFormatNames[] = {
    {"plain", PLAIN}, {"pair", PAIR}, {"scaled", SCALED}, {"group_fp8", GROUP_FP8}, {"blockwise_8bit", BLOCKWISE_8BIT}};
const std::pair<const char*, int> kRuleNames[] = {{"nearest", NEAREST}, {"grow", GROW}, {"kahan", KAHAN},
                                                  {"stochastic_rounding", STOCHASTIC_ROUNDING}, {"master", MASTER},
                                                  {"scaled_master", SCALED_MASTER}};

template <size_t N>
int tag_of(const std::string& name, const std::pair<const char*, int> (&names)[N], const char* what) {
  std::string known;
  for (const auto& [text, tag] : names) {
    if (name == text) return tag;
    known += known.empty() ? text : std::string(", ") + text;
  }
  TORCH_CHECK(false, kFn, ": unknown ", what, " '", name, "'; the native kernels know ", known);
}

void check_tensor(const std::string& what, size_t index, const at::Tensor& t, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), kFn, ": ", what, "[", index, "] is on ", t.device(),
              "; the native kernels run on CPU tensors only (use the compiled path elsewhere)");
  TORCH_CHECK(t.is_contiguous(), kFn, ": ", what, "[", index, "] is not contiguous; pass .contiguous() tensors "
              "(or use the foreach reference, which takes any layout)");
  TORCH_CHECK(t.numel() == numel, kFn, ": ", what, "[", index, "] has ", t.numel(), " elements, expected ", numel,
              " (the parameter's, padded to whole groups for grouped formats)");
  TORCH_CHECK(dtype_code(t) >= 0, kFn, ": ", what, "[", index, "] has dtype ", t.scalar_type(),
              ", which the native kernels do not store");
}

// One value per group (GroupFP8's scale, exponent, centre; Blockwise8bit's absmax).
float* group_values(const std::string& what, size_t i, const at::Tensor& t, int64_t groups) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == groups, kFn,
              ": ", what, "[", i, "] must be a contiguous FP32 CPU tensor of ", groups, " values (one per group), got ",
              t.scalar_type(), " ", t.sizes());
  return t.data_ptr<float>();
}

float scalar_of(const std::string& what, size_t i, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.numel() == 1, kFn, ": ", what, "[", i,
              "] must be a one-element FP32 CPU tensor, got ", t.scalar_type(), " ", t.sizes());
  return t.data_ptr<float>()[0];
}

int64_t option(const Options& options, const std::string& name, int64_t fallback) {
  auto it = options.find(name);
  return it == options.end() ? fallback : it->second;
}

// The call's per-parameter tensors, taken by name; every name passed must be read.
struct Tensors {
  const Named& named;
  size_t n;
  std::set<std::string> read;

  const OptionalList* find(const std::string& name) {
    auto it = named.find(name);
    if (it == named.end()) return nullptr;
    TORCH_CHECK(it->second.size() == n, kFn, ": ", name, " has ", it->second.size(), " tensors, param has ", n,
                "; pass one per parameter");
    read.insert(name);
    return &it->second;
  }
  const at::Tensor& get(const std::string& name, size_t i) {
    const OptionalList* list = find(name);
    TORCH_CHECK(list != nullptr, kFn, ": the declared family reads '", name, "', which was not passed");
    TORCH_CHECK((*list)[i].has_value(), kFn, ": ", name, "[", i, "] is None; the declared family reads it");
    return *(*list)[i];
  }
  const at::Tensor* maybe(const std::string& name, size_t i) {
    const OptionalList* list = find(name);
    return list && (*list)[i] ? &*(*list)[i] : nullptr;
  }
  // An element tensor of the parameter's size (or padded to `numel`), checked.
  void* elements(const std::string& name, size_t i, int64_t numel, int* dtype) {
    const at::Tensor& t = get(name, i);
    check_tensor(name, i, t, numel);
    *dtype = dtype_code(t);
    return t.data_ptr();
  }
};

// A dynamic map's tables (formats.dynamic_map_lookup): 256 values, 255 midpoints + a sentinel,
// the code below each 16-bit key (65536 + 3 padding bytes), and the NaN code.
void set_map(const Shared& shared, const Options& options, const std::string& prefix, Moment& mo) {
  auto it = shared.find(prefix + "_map");
  TORCH_CHECK(it != shared.end() && it->second.size() == 3, kFn, ": ", prefix,
              "_map must be formats.dynamic_map_lookup's (values, midpoints, lookup)");
  const auto& values = it->second[0];
  const auto& mids = it->second[1];
  const auto& lookup = it->second[2];
  TORCH_CHECK(values.is_cpu() && values.scalar_type() == at::kFloat && values.is_contiguous() && values.numel() == 256 &&
                  mids.is_cpu() && mids.scalar_type() == at::kFloat && mids.is_contiguous() && mids.numel() == 256 &&
                  lookup.is_cpu() && lookup.scalar_type() == at::kByte && lookup.is_contiguous() &&
                  lookup.numel() == 65536 + 3,
              kFn, ": ", prefix, "_map tables must be 256 FP32, 256 FP32 and 65539 uint8 CPU tensors");
  const int64_t nan_code = option(options, prefix + "_map_nan", -1);
  TORCH_CHECK(nan_code >= 0 && nan_code < 256, kFn, ": ", prefix, "_map_nan must be in [0, 256), got ", nan_code);
  mo.map_values = values.data_ptr<float>();
  mo.map_mids = mids.data_ptr<float>();
  mo.map_lookup = lookup.data_ptr<uint8_t>();
  mo.map_nan = static_cast<uint32_t>(nan_code);
  mo.nonnegative = option(options, prefix + "_nonnegative", 0) != 0;
}

// One moment of parameter i, read by its format's names (formats.Format.keys(prefix)).
void fill_moment(Tensors& t, const Shared& shared, const Options& options, int tag, const std::string& prefix,
                 size_t i, const Row& r, Moment& mo) {
  const int64_t groups = (r.numel + r.group_size - 1) / r.group_size;
  const int64_t padded = tag == GROUP_FP8 || tag == BLOCKWISE_8BIT ? groups * r.group_size : r.numel;
  mo.payload = t.elements(prefix, i, padded, &mo.dtype);
  switch (tag) {
    case PAIR: {
      int error_dtype = -1;
      mo.error = t.elements(prefix + "_error", i, r.numel, &error_dtype);
      TORCH_CHECK(error_dtype == mo.dtype, kFn, ": ", prefix, "_error[", i, "] must have ", prefix, "'s dtype ",
                  dtype_name(mo.dtype));
      break;
    }
    case SCALED:
      mo.inv_scale = 1.0f / scalar_of(prefix + "_scale", i, t.get(prefix + "_scale", i));
      mo.nonnegative = option(options, prefix + "_nonnegative", 0) != 0;  // formats.Scaled.keep_nonzero
      break;
    case GROUP_FP8: {
      const char* suffixes[3] = {"_scale", "_exponent", "_center"};
      for (int k = 0; k < 3; ++k) mo.meta[k] = group_values(prefix + suffixes[k], i, t.get(prefix + suffixes[k], i), groups);
      mo.nonnegative = option(options, prefix + "_nonnegative", 0) != 0;  // formats.GroupFP8.keep_nonzero
      break;
    }
    case BLOCKWISE_8BIT:
      mo.meta[0] = group_values(prefix + "_absmax", i, t.get(prefix + "_absmax", i), groups);
      set_map(shared, options, prefix, mo);
      break;
    default:
      break;
  }
}

// The state the rule keeps beside θ (rules.Rule.stored_names).
void fill_rule(Tensors& t, int rule, size_t i, Row& r) {
  const char* name = rule == GROW ? "param_error" : rule == KAHAN ? "compensation" : rule == MASTER ? "master" : nullptr;
  if (name) {
    int dtype = -1;
    r.theta_state = t.elements(name, i, r.numel, &dtype);
    const int wanted = rule == MASTER ? F32 : r.param_dtype;
    TORCH_CHECK(dtype == wanted, kFn, ": ", name, "[", i, "] must be ", dtype_name(wanted), ", got ", dtype_name(dtype));
  } else if (rule == SCALED_MASTER) {
    TORCH_CHECK(r.param_dtype == F16, kFn, ": param[", i, "] has a master scale, so it must be an FP16 payload, got ",
                dtype_name(r.param_dtype));
    r.param_dtype = F16S;
    r.inv_param_scale = 1.0f / scalar_of("master_scale", i, t.get("master_scale", i));
  } else if (rule == STOCHASTIC_ROUNDING) {
    const at::Tensor& seed = t.get("seed", i);
    TORCH_CHECK(seed.device().is_cpu() && seed.scalar_type() == at::kLong && seed.numel() == 1, kFn, ": seed[", i,
                "] must be a one-element int64 CPU tensor, got ", seed.scalar_type(), " ", seed.sizes());
    // (index + seed·0x9E3779B9) mod 2^32 = index + (seed·0x9E3779B9 mod 2^32), as uint32.
    r.seed_mix = static_cast<uint32_t>(static_cast<uint64_t>(seed.data_ptr<int64_t>()[0]) * 0x9E3779B9ull);
  }
}

void fill_scalars(const at::Tensor& scalars, std::vector<Row>& rows) {
  TORCH_CHECK(scalars.device().is_cpu() && scalars.scalar_type() == at::kFloat && scalars.dim() == 2 &&
                  scalars.size(0) == static_cast<int64_t>(rows.size()) && scalars.size(1) == 6,
              kFn, ": scalars must be an FP32 CPU tensor of shape (", rows.size(), ", 6) (one row of ",
              "native.adamw_scalars per parameter), got ", scalars.scalar_type(), " ", scalars.sizes(), " on ",
              scalars.device());
  auto s = scalars.contiguous();
  const float* data = s.data_ptr<float>();
  for (size_t i = 0; i < rows.size(); ++i) std::memcpy(rows[i].scalars, data + 6 * i, 6 * sizeof(float));
}

// A call checked and read: the declaration, its table and one Row per parameter, and the
// tensors that receive new per-tensor scales after the step (m's, v's, the master's).
struct Call {
  Declaration d;
  const Table* table = nullptr;
  std::vector<Row> rows;
  std::vector<std::array<std::optional<at::Tensor>, 3>> scales;
  int64_t margin[3] = {0, 0, 0};
};

Call prepare(const std::string& m_format, const std::string& v_format, const std::string& rule, const Options& options,
             const Named& named, const Shared& shared, const at::Tensor& scalars, int64_t isa) {
  Call call;
  call.d = {tag_of(m_format, kFormatNames, "format"), tag_of(v_format, kFormatNames, "format"),
            tag_of(rule, kRuleNames, "rule")};
  const Declaration& d = call.d;
  const std::string label = "(" + m_format + ", " + v_format + ", " + rule + ")";
  auto params = named.find("param");
  TORCH_CHECK(params != named.end(), kFn, ": no 'param' tensors");
  Tensors t{named, params->second.size(), {}};
  int64_t group_size = 1;
  bool expand = false;
  if (grouped(d)) {
    TORCH_CHECK((d.m_format == GROUP_FP8 || d.m_format == BLOCKWISE_8BIT) && d.v_format == d.m_format, kFn, ": ", label,
                ": m and v must share one grouped format");
    group_size = option(options, "exp_avg_group_size", 0);
    TORCH_CHECK(group_size == option(options, "exp_avg_sq_group_size", 0) &&
                    option(options, "exp_avg_expand", 0) == option(options, "exp_avg_sq_expand", 0),
                kFn, ": ", label, ": m and v with different group layouts (group size, expansion)");
    TORCH_CHECK(group_size > 0 && group_size <= kMaxGroup && group_size % 16 == 0, kFn, ": ", label,
                ": the group size must be a multiple of 16 up to ", kMaxGroup, ", got ", group_size,
                "; use the compiled or reference path for other sizes");
    expand = option(options, "exp_avg_expand", 0) != 0;
  }
  call.margin[0] = option(options, "exp_avg_margin", 0);
  call.margin[1] = option(options, "exp_avg_sq_margin", 0);
  call.margin[2] = option(options, "master_scale_margin", 0);
  for (int64_t m : call.margin) TORCH_CHECK(m >= 0, kFn, ": margins must be >= 0, got ", m);
  for (size_t i = 0; i < t.n; ++i) {
    Row r;
    r.group_size = group_size;
    r.expand = expand;
    const at::Tensor& param = t.get("param", i);
    r.numel = param.numel();
    r.param = t.elements("param", i, r.numel, &r.param_dtype);
    r.grad = t.elements("grad", i, r.numel, &r.grad_dtype);
    const at::Tensor* grad_scale = t.maybe("grad_scale", i);
    const bool fp8_grad = r.grad_dtype == E4M3 || r.grad_dtype == E5M2;
    TORCH_CHECK(fp8_grad == (grad_scale != nullptr), kFn, ": grad[", i, "] is ", dtype_name(r.grad_dtype),
                "; an FP8 gradient needs its scale in grad_scale and any other gradient takes None");
    if (grad_scale) {
      r.grad_scale = scalar_of("grad_scale", i, *grad_scale);
      int exponent = 0;
      const float mantissa = std::frexp(r.grad_scale, &exponent);
      r.inv_grad_scale = 1.0f / r.grad_scale;
      // 1/s exact and normal: q·(1/s) is the correctly rounded q/s.
      r.grad_scale_pow2 = mantissa == 0.5f && std::isnormal(r.grad_scale) && std::isnormal(r.inv_grad_scale);
    }
    fill_moment(t, shared, options, d.m_format, "exp_avg", i, r, r.moment[0]);
    fill_moment(t, shared, options, d.v_format, "exp_avg_sq", i, r, r.moment[1]);
    fill_rule(t, d.rule, i, r);
    std::array<std::optional<at::Tensor>, 3> scale;
    if (d.m_format == SCALED) scale[0] = t.get("exp_avg_scale", i);
    if (d.v_format == SCALED) scale[1] = t.get("exp_avg_sq_scale", i);
    if (d.rule == SCALED_MASTER) scale[2] = t.get("master_scale", i);
    call.scales.push_back(scale);
    call.rows.push_back(r);
  }
  for (const auto& entry : named) {
    TORCH_CHECK(t.n == 0 || t.read.count(entry.first), kFn, ": ", label, " does not read '", entry.first,
                "'; pass the tensors of the declared family only (its composition's stored_names)");
  }
  fill_scalars(scalars, call.rows);
  call.table = table_for(isa);
  // The dtype combination, once per row, before any element is written.
  for (const Row& r : call.rows) {
    uint32_t scratch[3];
    TORCH_CHECK(call.table->step(d, two_passes(d) ? AMAX : STORE, r, 0, 0, scratch), kFn, ": no native kernel for ",
                label, " with θ ", dtype_name(r.param_dtype), ", g ", dtype_name(r.grad_dtype), ", m ",
                dtype_name(r.moment[0].dtype), ", v ", dtype_name(r.moment[1].dtype),
                " (the families and dtypes the kernels run are listed in kernels_impl.h, `Families`)");
  }
  return call;
}

// The found-inf flag: read once, after the arguments are checked and before anything is
// written; nonzero (NaN included) skips the whole step.
bool step_skipped(const std::optional<at::Tensor>& found_inf) {
  if (!found_inf) return false;
  TORCH_CHECK(found_inf->device().is_cpu() && found_inf->numel() == 1 && at::isFloatingType(found_inf->scalar_type()),
              kFn, ": found_inf must be a one-element floating CPU tensor (nonzero skips the step), got ",
              found_inf->scalar_type(), " ", found_inf->sizes(), " on ", found_inf->device());
  // Read through the data pointer, not `item()`: the flag is a CPU tensor the kernel reads in
  // place, and `item()` would dispatch `_local_scalar_dense` (what the host-sync checks count).
  const at::Tensor flag = found_inf->to(at::kDouble).contiguous();
  return *flag.data_ptr<double>() != 0.0;
}

struct Block {
  int64_t row, begin, end;
};

// Blocks of about kBlock elements, each a multiple of `align` (a group) long.
std::vector<Block> blocks_of(const std::vector<Row>& rows, int64_t align) {
  const int64_t size = std::max<int64_t>(1, kBlock / align) * align;
  std::vector<Block> blocks;
  for (size_t r = 0; r < rows.size(); ++r)
    for (int64_t b = 0; b < rows[r].numel; b += size) blocks.push_back({static_cast<int64_t>(r), b, std::min(rows[r].numel, b + size)});
  return blocks;
}

// Runs one pass over every element of every row, the blocks spread over ATen's threads; pass
// AMAX leaves 3 amax bit patterns per block in `amax`.
void run_pass(const Call& call, int pass, const std::vector<Block>& blocks, std::vector<uint32_t>* amax) {
  if (amax) amax->assign(3 * blocks.size(), 0);
  int64_t total = 0;
  for (const auto& r : call.rows) total += r.numel;
  auto body = [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const Block& blk = blocks[b];
      call.table->step(call.d, pass, call.rows[blk.row], blk.begin, blk.end, amax ? amax->data() + 3 * b : nullptr);
    }
  };
  if (total < kParallelMin) {
    body(0, static_cast<int64_t>(blocks.size()));
  } else {
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, body);
  }
}

// fp8.scaled.pow2_scale: s = 2^clamp(e − 1 − margin, ±126) with ratio = F/amax = m·2^e
// (FP32 division, frexp exact); amax = 0, inf or NaN gives 1.
float pow2_scale(uint32_t amax_bits, float format_max_value, int64_t margin) {
  float amax;
  std::memcpy(&amax, &amax_bits, 4);
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  // F / amax as PyTorch evaluates a Python scalar over a tensor: (1/amax)·F, two FP32 roundings.
  float ratio = (1.0f / amax) * format_max_value;
  float clamped = std::min(ratio, std::numeric_limits<float>::max());
  int exponent = 0;
  std::frexp(clamped, &exponent);
  int64_t e = std::clamp<int64_t>(exponent - 1 - margin, -126, 126);
  return std::ldexp(1.0f, static_cast<int>(e));
}

float format_max_of(int d) {
  switch (d) {
    case E4M3: return 448.0f;
    case E5M2: return 57344.0f;
    case F16: case F16S: return 65504.0f;
    case BF16: return 3.3895313892515355e38f;
    default: return std::numeric_limits<float>::max();
  }
}


void step(const std::string& m_format, const std::string& v_format, const std::string& rule, const Options& options,
          const Named& tensors, const Shared& shared, const at::Tensor& scalars,
          const std::optional<at::Tensor>& found_inf, int64_t isa) {
  Call call = prepare(m_format, v_format, rule, options, tensors, shared, scalars, isa);
  if (step_skipped(found_inf)) return;  // checked, nothing written
  const auto blocks = blocks_of(call.rows, grouped(call.d) ? call.rows.empty() ? 1 : call.rows[0].group_size : 1);
  if (!two_passes(call.d)) return run_pass(call, STORE, blocks, nullptr);
  // Pass 1: the amax of the new m, v and θ (a per-tensor scale needs the whole tensor first).
  std::vector<uint32_t> amax;
  run_pass(call, AMAX, blocks, &amax);
  const size_t n = call.rows.size();
  std::vector<uint32_t> row_amax(3 * n, 0);
  for (size_t b = 0; b < blocks.size(); ++b)
    for (int k = 0; k < 3; ++k) row_amax[3 * blocks[b].row + k] = std::max(row_amax[3 * blocks[b].row + k], amax[3 * b + k]);
  for (size_t i = 0; i < n; ++i) {
    Row& r = call.rows[i];
    for (int k = 0; k < 2; ++k) {
      Moment& mo = r.moment[k];
      // FP32 storage keeps scale 1 (formats.Scaled).
      if (call.scales[i][k]) mo.new_scale = mo.dtype == F32 ? 1.0f : pow2_scale(row_amax[3 * i + k], format_max_of(mo.dtype), call.margin[k]);
    }
    if (call.scales[i][2]) r.new_param_scale = pow2_scale(row_amax[3 * i + 2], 65504.0f, call.margin[2]);
  }
  // Pass 2: recompute and store with the new scales (reads the old scales, kept in the rows).
  run_pass(call, STORE, blocks, nullptr);
  for (size_t i = 0; i < n; ++i) {
    const Row& r = call.rows[i];
    const float values[3] = {r.moment[0].new_scale, r.moment[1].new_scale, r.new_param_scale};
    for (int k = 0; k < 3; ++k)
      if (call.scales[i][k]) call.scales[i][k]->fill_(values[k]);
  }
}

// Why `step` would refuse these arguments (its first error), or "" when it would run them.
std::string check(const std::string& m_format, const std::string& v_format, const std::string& rule,
                  const Options& options, const Named& tensors, const Shared& shared, const at::Tensor& scalars,
                  int64_t isa) {
  try {
    prepare(m_format, v_format, rule, options, tensors, shared, scalars, isa);
  } catch (const c10::Error& error) {
    return error.what_without_backtrace();
  }
  return "";
}

}  // namespace
}  // namespace hfl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Native CPU optimizer kernels of hf_lowprec (see hf_lowprec.optim.native)";
  m.def("best_isa", &hfl::best_isa, "The widest instruction set this CPU runs: avx512_bf16, avx512, avx2 or scalar");
  m.def("step", &hfl::step, "One AdamW step of a declared (m format, v format, rule) family over a bucket");
  m.def("check", &hfl::check, "Why `step` would refuse these arguments, or an empty string");
}
