// Python entry points of the native CPU optimizer kernels: argument checks, ISA choice, blocks
// over ATen's thread pool (OpenMP in PyTorch's CPU builds), and FP8AdamW's per-tensor scales.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "native.h"

namespace hfl {
namespace {

using TensorList = std::vector<at::Tensor>;
using OptionalList = std::vector<std::optional<at::Tensor>>;

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

void check_tensor(const char* fn, const char* what, size_t index, const at::Tensor& t, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", what, "[", index, "] is on ", t.device(),
              "; the native kernels run on CPU tensors only (use the compiled path elsewhere)");
  TORCH_CHECK(t.is_contiguous(), fn, ": ", what, "[", index, "] is not contiguous; pass .contiguous() tensors "
              "(or use the foreach reference, which takes any layout)");
  TORCH_CHECK(t.numel() == numel, fn, ": ", what, "[", index, "] has ", t.numel(), " elements, the parameter ",
              numel, "; every tensor of a row must have the parameter's size");
  TORCH_CHECK(dtype_code(t) >= 0, fn, ": ", what, "[", index, "] has dtype ", t.scalar_type(),
              ", which the native kernels do not store");
}

void check_lengths(const char* fn, size_t n, std::initializer_list<std::pair<const char*, size_t>> lists) {
  for (const auto& item : lists) {
    TORCH_CHECK(item.second == n, fn, ": ", item.first, " has ", item.second, " tensors, params has ", n,
                "; pass one of each per parameter");
  }
}

void fill_scalars(const char* fn, const at::Tensor& scalars, std::vector<Row>& rows) {
  TORCH_CHECK(scalars.device().is_cpu() && scalars.scalar_type() == at::kFloat && scalars.dim() == 2 &&
                  scalars.size(0) == static_cast<int64_t>(rows.size()) && scalars.size(1) == 6,
              fn, ": scalars must be an FP32 CPU tensor of shape (", rows.size(), ", 6) (one row of ",
              "native.adamw_scalars per parameter), got ", scalars.scalar_type(), " ", scalars.sizes(), " on ",
              scalars.device());
  auto s = scalars.contiguous();
  const float* data = s.data_ptr<float>();
  for (size_t i = 0; i < rows.size(); ++i) std::memcpy(rows[i].scalars, data + 6 * i, 6 * sizeof(float));
}

// The found-inf flag: read once, after the arguments are checked and before anything is
// written; nonzero (NaN included) skips the whole step.
bool step_skipped(const char* fn, const std::optional<at::Tensor>& found_inf) {
  if (!found_inf) return false;
  TORCH_CHECK(found_inf->device().is_cpu() && found_inf->numel() == 1 && at::isFloatingType(found_inf->scalar_type()),
              fn, ": found_inf must be a one-element floating CPU tensor (nonzero skips the step), got ",
              found_inf->scalar_type(), " ", found_inf->sizes(), " on ", found_inf->device());
  // Read through the data pointer, not `item()`: the flag is a CPU tensor the kernel reads in
  // place, and `item()` would dispatch `_local_scalar_dense` (what the host-sync checks count).
  const at::Tensor flag = found_inf->to(at::kDouble).contiguous();
  return *flag.data_ptr<double>() != 0.0;
}

struct Block {
  int64_t row, begin, end;
};

// Blocks of about kBlock elements, each a multiple of `align` (COAT's group size) long.
std::vector<Block> blocks_of(const std::vector<Row>& rows, int64_t align = 1) {
  const int64_t size = std::max<int64_t>(1, kBlock / align) * align;
  std::vector<Block> blocks;
  for (size_t r = 0; r < rows.size(); ++r)
    for (int64_t b = 0; b < rows[r].numel; b += size) blocks.push_back({static_cast<int64_t>(r), b, std::min(rows[r].numel, b + size)});
  return blocks;
}

// Runs `fn` over every element of every row, the blocks spread over ATen's threads.
void run_rows(const char* fn_name, RangeFn fn, const std::vector<Row>& rows, std::vector<uint32_t>* amax = nullptr,
              int64_t align = 1) {
  auto blocks = blocks_of(rows, align);
  if (amax) amax->assign(3 * blocks.size(), 0);
  int64_t total = 0;
  for (const auto& r : rows) total += r.numel;
  // Check the dtype combination once per row before any element is written.
  for (const auto& r : rows) {
    uint32_t scratch[3];
    TORCH_CHECK(fn(r, 0, 0, scratch), fn_name, ": unsupported dtype combination (param ", r.param_dtype,
                ", grad ", r.grad_dtype, ", moments ", r.moment_dtype, "/", r.exp_avg_sq_dtype,
                "); see hf_lowprec.optim.native for the supported ones");
  }
  auto body = [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const Block& blk = blocks[b];
      fn(rows[blk.row], blk.begin, blk.end, amax ? amax->data() + 3 * b : nullptr);
    }
  };
  if (total < kParallelMin) {
    body(0, static_cast<int64_t>(blocks.size()));
  } else {
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, body);
  }
}

Row base_row(const char* fn, size_t i, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m,
             const at::Tensor& v) {
  const int64_t n = param.numel();
  check_tensor(fn, "params", i, param, n);
  check_tensor(fn, "grads", i, grad, n);
  check_tensor(fn, "exp_avgs", i, m, n);
  check_tensor(fn, "exp_avg_sqs", i, v, n);
  TORCH_CHECK(m.scalar_type() == v.scalar_type(), fn, ": exp_avgs[", i, "] is ", m.scalar_type(),
              " but exp_avg_sqs[", i, "] is ", v.scalar_type(), "; both moments must share one dtype");
  Row r;
  r.param = param.data_ptr();
  r.grad = grad.data_ptr();
  r.exp_avg = m.data_ptr();
  r.exp_avg_sq = v.data_ptr();
  r.param_dtype = dtype_code(param);
  r.grad_dtype = dtype_code(grad);
  r.moment_dtype = r.exp_avg_sq_dtype = dtype_code(m);
  r.numel = n;
  return r;
}

void adamw_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                const TensorList& exp_avg_sqs, const at::Tensor& scalars, const std::optional<at::Tensor>& found_inf, int64_t isa) {
  const char* fn = "adamw_step";
  check_lengths(fn, params.size(), {{"grads", grads.size()}, {"exp_avgs", exp_avgs.size()}, {"exp_avg_sqs", exp_avg_sqs.size()}});
  std::vector<Row> rows;
  for (size_t i = 0; i < params.size(); ++i) rows.push_back(base_row(fn, i, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]));
  fill_scalars(fn, scalars, rows);
  if (step_skipped(fn, found_inf)) return;  // checked, nothing written
  run_rows(fn, table_for(isa)->adamw, rows);
}

void collage_step(const TensorList& params, const TensorList& param_errors, const TensorList& grads,
                  const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
                  const std::optional<TensorList>& exp_avg_sq_errors, const at::Tensor& scalars, const std::optional<at::Tensor>& found_inf, int64_t isa) {
  const char* fn = "collage_step";
  check_lengths(fn, params.size(), {{"param_errors", param_errors.size()}, {"grads", grads.size()},
                                    {"exp_avgs", exp_avgs.size()}, {"exp_avg_sqs", exp_avg_sqs.size()}});
  if (exp_avg_sq_errors) check_lengths(fn, params.size(), {{"exp_avg_sq_errors", exp_avg_sq_errors->size()}});
  std::vector<Row> rows;
  for (size_t i = 0; i < params.size(); ++i) {
    Row r = base_row(fn, i, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]);
    check_tensor(fn, "param_errors", i, param_errors[i], r.numel);
    TORCH_CHECK(param_errors[i].scalar_type() == params[i].scalar_type(), fn, ": param_errors[", i,
                "] must have the parameter's dtype ", params[i].scalar_type());
    r.theta_state = param_errors[i].data_ptr();
    if (exp_avg_sq_errors) {
      const auto& e = (*exp_avg_sq_errors)[i];
      check_tensor(fn, "exp_avg_sq_errors", i, e, r.numel);
      TORCH_CHECK(e.scalar_type() == exp_avg_sqs[i].scalar_type(), fn, ": exp_avg_sq_errors[", i,
                  "] must have the second moment's dtype ", exp_avg_sqs[i].scalar_type());
      r.v_error = e.data_ptr();
    }
    rows.push_back(r);
  }
  fill_scalars(fn, scalars, rows);
  if (step_skipped(fn, found_inf)) return;  // checked, nothing written
  const Table* t = table_for(isa);
  run_rows(fn, exp_avg_sq_errors ? t->collage_plus : t->collage_light, rows);
}

void kahan_step(const TensorList& params, const TensorList& compensations, const TensorList& grads,
                const TensorList& exp_avgs, const TensorList& exp_avg_sqs, const at::Tensor& scalars, const std::optional<at::Tensor>& found_inf, int64_t isa) {
  const char* fn = "kahan_step";
  check_lengths(fn, params.size(), {{"compensations", compensations.size()}, {"grads", grads.size()},
                                    {"exp_avgs", exp_avgs.size()}, {"exp_avg_sqs", exp_avg_sqs.size()}});
  std::vector<Row> rows;
  for (size_t i = 0; i < params.size(); ++i) {
    Row r = base_row(fn, i, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]);
    check_tensor(fn, "compensations", i, compensations[i], r.numel);
    TORCH_CHECK(compensations[i].scalar_type() == params[i].scalar_type(), fn, ": compensations[", i,
                "] must have the parameter's dtype ", params[i].scalar_type());
    r.theta_state = compensations[i].data_ptr();
    rows.push_back(r);
  }
  fill_scalars(fn, scalars, rows);
  if (step_skipped(fn, found_inf)) return;  // checked, nothing written
  run_rows(fn, table_for(isa)->kahan, rows);
}

void sr_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
             const TensorList& exp_avg_sqs, const at::Tensor& scalars, const at::Tensor& seeds, const std::optional<at::Tensor>& found_inf, int64_t isa) {
  const char* fn = "sr_step";
  check_lengths(fn, params.size(), {{"grads", grads.size()}, {"exp_avgs", exp_avgs.size()}, {"exp_avg_sqs", exp_avg_sqs.size()}});
  TORCH_CHECK(seeds.device().is_cpu() && seeds.scalar_type() == at::kLong &&
                  seeds.numel() == static_cast<int64_t>(params.size()),
              fn, ": seeds must be an int64 CPU tensor with one seed per parameter (", params.size(), "), got ",
              seeds.scalar_type(), " ", seeds.sizes(), " on ", seeds.device());
  auto s = seeds.contiguous();
  const int64_t* seed = s.data_ptr<int64_t>();
  std::vector<Row> rows;
  for (size_t i = 0; i < params.size(); ++i) {
    Row r = base_row(fn, i, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]);
    // (index + seed·0x9E3779B9) mod 2^32 = index + (seed·0x9E3779B9 mod 2^32), as uint32.
    r.seed_mix = static_cast<uint32_t>(static_cast<uint64_t>(seed[i]) * 0x9E3779B9ull);
    rows.push_back(r);
  }
  fill_scalars(fn, scalars, rows);
  if (step_skipped(fn, found_inf)) return;  // checked, nothing written
  run_rows(fn, table_for(isa)->sr, rows);
}

void master_step(const TensorList& params, const TensorList& masters, const TensorList& grads,
                 const TensorList& exp_avgs, const TensorList& exp_avg_sqs, const at::Tensor& scalars, const std::optional<at::Tensor>& found_inf, int64_t isa) {
  const char* fn = "master_step";
  check_lengths(fn, params.size(), {{"masters", masters.size()}, {"grads", grads.size()},
                                    {"exp_avgs", exp_avgs.size()}, {"exp_avg_sqs", exp_avg_sqs.size()}});
  std::vector<Row> rows;
  for (size_t i = 0; i < params.size(); ++i) {
    Row r = base_row(fn, i, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]);
    check_tensor(fn, "masters", i, masters[i], r.numel);
    TORCH_CHECK(masters[i].scalar_type() == at::kFloat && exp_avgs[i].scalar_type() == at::kFloat, fn,
                ": masters and moments must be FP32 (MasterWeightAdamW), got ", masters[i].scalar_type(), " and ",
                exp_avgs[i].scalar_type());
    r.theta_state = masters[i].data_ptr();
    rows.push_back(r);
  }
  fill_scalars(fn, scalars, rows);
  if (step_skipped(fn, found_inf)) return;  // checked, nothing written
  run_rows(fn, table_for(isa)->master, rows);
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

float scalar_of(const char* fn, const char* what, size_t i, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.numel() == 1, fn, ": ", what, "[", i,
              "] must be a one-element FP32 CPU tensor, got ", t.scalar_type(), " ", t.sizes());
  return t.data_ptr<float>()[0];
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

void fp8_adamw_step(const TensorList& params, const OptionalList& master_scales, const TensorList& grads,
                    const OptionalList& grad_scales, const TensorList& exp_avgs, const TensorList& exp_avg_scales,
                    const TensorList& exp_avg_sqs, const TensorList& exp_avg_sq_scales, const at::Tensor& scalars,
                    int64_t margin, const std::optional<at::Tensor>& found_inf, int64_t isa) {
  const char* fn = "fp8_adamw_step";
  const size_t n = params.size();
  check_lengths(fn, n, {{"master_scales", master_scales.size()}, {"grads", grads.size()},
                        {"grad_scales", grad_scales.size()}, {"exp_avgs", exp_avgs.size()},
                        {"exp_avg_scales", exp_avg_scales.size()}, {"exp_avg_sqs", exp_avg_sqs.size()},
                        {"exp_avg_sq_scales", exp_avg_sq_scales.size()}});
  TORCH_CHECK(margin >= 0, fn, ": margin must be >= 0, got ", margin);
  std::vector<Row> rows;
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = params[i].numel();
    check_tensor(fn, "params", i, params[i], numel);
    check_tensor(fn, "grads", i, grads[i], numel);
    check_tensor(fn, "exp_avgs", i, exp_avgs[i], numel);
    check_tensor(fn, "exp_avg_sqs", i, exp_avg_sqs[i], numel);
    Row r;
    r.numel = numel;
    r.param = params[i].data_ptr();
    r.grad = grads[i].data_ptr();
    r.exp_avg = exp_avgs[i].data_ptr();
    r.exp_avg_sq = exp_avg_sqs[i].data_ptr();
    r.param_dtype = dtype_code(params[i]);
    if (master_scales[i]) {
      TORCH_CHECK(r.param_dtype == F16, fn, ": params[", i, "] has a master scale, so it must be an FP16 payload, got ",
                  params[i].scalar_type());
      r.param_dtype = F16S;
      r.inv_param_scale = 1.0f / scalar_of(fn, "master_scales", i, *master_scales[i]);
    }
    r.grad_dtype = dtype_code(grads[i]);
    const bool fp8_grad = r.grad_dtype == E4M3 || r.grad_dtype == E5M2;
    TORCH_CHECK(fp8_grad == grad_scales[i].has_value(), fn, ": grads[", i, "] is ", grads[i].scalar_type(),
                "; an FP8 gradient needs its scale in grad_scales and any other gradient takes None");
    if (fp8_grad) {
      r.grad_scale = scalar_of(fn, "grad_scales", i, *grad_scales[i]);
      int exponent = 0;
      const float mantissa = std::frexp(r.grad_scale, &exponent);
      r.inv_grad_scale = 1.0f / r.grad_scale;
      // 1/s exact and normal: q·(1/s) is the correctly rounded q/s.
      r.grad_scale_pow2 = mantissa == 0.5f && std::isnormal(r.grad_scale) && std::isnormal(r.inv_grad_scale);
    }
    r.moment_dtype = dtype_code(exp_avgs[i]);
    r.exp_avg_sq_dtype = dtype_code(exp_avg_sqs[i]);
    r.inv_m_scale = 1.0f / scalar_of(fn, "exp_avg_scales", i, exp_avg_scales[i]);
    r.inv_v_scale = 1.0f / scalar_of(fn, "exp_avg_sq_scales", i, exp_avg_sq_scales[i]);
    rows.push_back(r);
  }
  fill_scalars(fn, scalars, rows);
  if (step_skipped(fn, found_inf)) return;  // checked, nothing written
  const Table* table = table_for(isa);
  // Pass 1: the amax of the new m, v and θ (the scales need the whole tensor first).
  std::vector<uint32_t> amax;
  run_rows(fn, table->fp8_amax, rows, &amax);
  auto blocks = blocks_of(rows);
  std::vector<uint32_t> row_amax(3 * n, 0);
  for (size_t b = 0; b < blocks.size(); ++b)
    for (int k = 0; k < 3; ++k) row_amax[3 * blocks[b].row + k] = std::max(row_amax[3 * blocks[b].row + k], amax[3 * b + k]);
  for (size_t i = 0; i < n; ++i) {
    Row& r = rows[i];
    // FP32 storage keeps scale 1 (fp8_adamw._requantize_).
    r.new_m_scale = r.moment_dtype == F32 ? 1.0f : pow2_scale(row_amax[3 * i], format_max_of(r.moment_dtype), margin);
    r.new_v_scale = r.exp_avg_sq_dtype == F32 ? 1.0f : pow2_scale(row_amax[3 * i + 1], format_max_of(r.exp_avg_sq_dtype), margin);
    if (r.param_dtype == F16S) r.new_param_scale = pow2_scale(row_amax[3 * i + 2], 65504.0f, margin);
  }
  // Pass 2: recompute and store with the new scales (reads the old scales, kept in the rows).
  run_rows(fn, table->fp8_store, rows);
  for (size_t i = 0; i < n; ++i) {
    exp_avg_scales[i].fill_(rows[i].new_m_scale);
    exp_avg_sq_scales[i].fill_(rows[i].new_v_scale);
    if (master_scales[i]) master_scales[i]->fill_(rows[i].new_param_scale);
  }
}


void check_meta(const char* fn, const char* what, size_t i, const at::Tensor& t, int64_t groups) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == groups, fn,
              ": ", what, "[", i, "] must be a contiguous FP32 CPU tensor of ", groups, " values (one per group), got ",
              t.scalar_type(), " ", t.sizes());
}

void coat_step(const TensorList& params, const std::optional<TensorList>& param_errors, const TensorList& grads,
               const TensorList& m_payloads, const TensorList& m_scales, const TensorList& m_exponents,
               const TensorList& m_centers, const TensorList& v_payloads, const TensorList& v_scales,
               const TensorList& v_exponents, const TensorList& v_centers, const at::Tensor& scalars,
               int64_t group_size, bool expand, const std::optional<at::Tensor>& found_inf, int64_t isa) {
  const char* fn = "coat_step";
  const size_t n = params.size();
  check_lengths(fn, n, {{"grads", grads.size()}, {"exp_avg payloads", m_payloads.size()},
                        {"exp_avg scales", m_scales.size()}, {"exp_avg exponents", m_exponents.size()},
                        {"exp_avg centers", m_centers.size()}, {"exp_avg_sq payloads", v_payloads.size()},
                        {"exp_avg_sq scales", v_scales.size()}, {"exp_avg_sq exponents", v_exponents.size()},
                        {"exp_avg_sq centers", v_centers.size()}});
  if (param_errors) check_lengths(fn, n, {{"param_errors", param_errors->size()}});
  TORCH_CHECK(group_size > 0 && group_size <= kMaxGroup && group_size % 16 == 0, fn, ": group_size must be a ",
              "multiple of 16 up to ", kMaxGroup, " (COAT uses 128), got ", group_size,
              "; use the reference path for other sizes");
  std::vector<Row> rows;
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = params[i].numel();
    const int64_t groups = (numel + group_size - 1) / group_size;
    check_tensor(fn, "params", i, params[i], numel);
    check_tensor(fn, "grads", i, grads[i], numel);
    check_tensor(fn, "exp_avg payloads", i, m_payloads[i], groups * group_size);
    check_tensor(fn, "exp_avg_sq payloads", i, v_payloads[i], groups * group_size);
    check_meta(fn, "exp_avg scales", i, m_scales[i], groups);
    check_meta(fn, "exp_avg exponents", i, m_exponents[i], groups);
    check_meta(fn, "exp_avg centers", i, m_centers[i], groups);
    check_meta(fn, "exp_avg_sq scales", i, v_scales[i], groups);
    check_meta(fn, "exp_avg_sq exponents", i, v_exponents[i], groups);
    check_meta(fn, "exp_avg_sq centers", i, v_centers[i], groups);
    Row r;
    r.numel = numel;
    r.param = params[i].data_ptr();
    r.grad = grads[i].data_ptr();
    r.exp_avg = m_payloads[i].data_ptr();
    r.exp_avg_sq = v_payloads[i].data_ptr();
    r.param_dtype = dtype_code(params[i]);
    r.grad_dtype = dtype_code(grads[i]);
    r.moment_dtype = dtype_code(m_payloads[i]);
    r.exp_avg_sq_dtype = dtype_code(v_payloads[i]);
    TORCH_CHECK(r.moment_dtype == E4M3 && (r.exp_avg_sq_dtype == E4M3 || r.exp_avg_sq_dtype == E5M2), fn,
                ": COAT stores m as float8_e4m3fn and v as float8_e4m3fn or float8_e5m2, got ",
                m_payloads[i].scalar_type(), " and ", v_payloads[i].scalar_type());
    const bool low = r.param_dtype == BF16 || r.param_dtype == F16;
    TORCH_CHECK(low == static_cast<bool>(param_errors), fn, ": params[", i, "] is ", params[i].scalar_type(),
                "; BF16/FP16 parameters need their δθ in param_errors, FP32 parameters take None");
    if (param_errors) {
      check_tensor(fn, "param_errors", i, (*param_errors)[i], numel);
      TORCH_CHECK((*param_errors)[i].scalar_type() == params[i].scalar_type(), fn, ": param_errors[", i,
                  "] must have the parameter's dtype");
      r.theta_state = (*param_errors)[i].data_ptr();
    }
    r.m_meta[0] = m_scales[i].data_ptr<float>();
    r.m_meta[1] = m_exponents[i].data_ptr<float>();
    r.m_meta[2] = m_centers[i].data_ptr<float>();
    r.v_meta[0] = v_scales[i].data_ptr<float>();
    r.v_meta[1] = v_exponents[i].data_ptr<float>();
    r.v_meta[2] = v_centers[i].data_ptr<float>();
    r.group_size = group_size;
    r.expand = expand;
    rows.push_back(r);
  }
  fill_scalars(fn, scalars, rows);
  if (step_skipped(fn, found_inf)) return;  // checked, nothing written
  run_rows(fn, table_for(isa)->coat, rows, nullptr, group_size);
}

// One dynamic map's tables (formats.dynamic_map_lookup): values (256 FP32), midpoints + sentinel
// (256 FP32), the code below each 16-bit key (65536 + 3 padding bytes, uint8), the NaN code.
void set_map(const char* fn, Row& r, int map, const TensorList& tables, int64_t nan_code) {
  TORCH_CHECK(tables.size() == 3, fn, ": a map is (values, midpoints, lookup), got ", tables.size(), " tensors");
  const auto& values = tables[0];
  const auto& mids = tables[1];
  const auto& base = tables[2];
  TORCH_CHECK(values.is_cpu() && values.scalar_type() == at::kFloat && values.is_contiguous() && values.numel() == 256 &&
                  mids.is_cpu() && mids.scalar_type() == at::kFloat && mids.is_contiguous() && mids.numel() == 256 &&
                  base.is_cpu() && base.scalar_type() == at::kByte && base.is_contiguous() && base.numel() == 65536 + 3,
              fn, ": map tables must be formats.dynamic_map_lookup's (256 FP32, 256 FP32, 65539 uint8 CPU tensors)");
  TORCH_CHECK(nan_code >= 0 && nan_code < 256, fn, ": the NaN code must be in [0, 256), got ", nan_code);
  r.map_values[map] = values.data_ptr<float>();
  r.map_mids[map] = mids.data_ptr<float>();
  r.map_base[map] = base.data_ptr<uint8_t>();
  r.map_nan[map] = static_cast<uint32_t>(nan_code);
}

void eightbit_step(const TensorList& params, const TensorList& param_errors, const TensorList& grads,
                   const TensorList& m_codes, const TensorList& m_absmax, const TensorList& v_codes,
                   const TensorList& v_absmax, const at::Tensor& scalars, int64_t block_size,
                   const TensorList& m_map, int64_t m_nan, const TensorList& v_map, int64_t v_nan, const std::optional<at::Tensor>& found_inf, int64_t isa) {
  const char* fn = "eightbit_step";
  const size_t n = params.size();
  check_lengths(fn, n, {{"param_errors", param_errors.size()}, {"grads", grads.size()}, {"m_codes", m_codes.size()},
                        {"m_absmax", m_absmax.size()}, {"v_codes", v_codes.size()}, {"v_absmax", v_absmax.size()}});
  TORCH_CHECK(block_size > 0 && block_size <= kMaxGroup && block_size % 16 == 0, fn, ": block_size must be a ",
              "multiple of 16 up to ", kMaxGroup, " (the default is 256), got ", block_size,
              "; use the compiled or reference path for other sizes");
  std::vector<Row> rows;
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = params[i].numel();
    const int64_t blocks = (numel + block_size - 1) / block_size;
    check_tensor(fn, "params", i, params[i], numel);
    check_tensor(fn, "param_errors", i, param_errors[i], numel);
    check_tensor(fn, "grads", i, grads[i], numel);
    check_tensor(fn, "m_codes", i, m_codes[i], blocks * block_size);
    check_tensor(fn, "v_codes", i, v_codes[i], blocks * block_size);
    check_meta(fn, "m_absmax", i, m_absmax[i], blocks);
    check_meta(fn, "v_absmax", i, v_absmax[i], blocks);
    TORCH_CHECK(param_errors[i].scalar_type() == params[i].scalar_type(), fn, ": param_errors[", i,
                "] must have the parameter's dtype ", params[i].scalar_type());
    Row r;
    r.numel = numel;
    r.param = params[i].data_ptr();
    r.theta_state = param_errors[i].data_ptr();
    r.grad = grads[i].data_ptr();
    r.exp_avg = m_codes[i].data_ptr();
    r.exp_avg_sq = v_codes[i].data_ptr();
    r.param_dtype = dtype_code(params[i]);
    r.grad_dtype = dtype_code(grads[i]);
    r.moment_dtype = dtype_code(m_codes[i]);
    r.exp_avg_sq_dtype = dtype_code(v_codes[i]);
    r.m_meta[0] = m_absmax[i].data_ptr<float>();
    r.v_meta[0] = v_absmax[i].data_ptr<float>();
    r.group_size = block_size;
    set_map(fn, r, 0, m_map, m_nan);
    set_map(fn, r, 1, v_map, v_nan);
    rows.push_back(r);
  }
  fill_scalars(fn, scalars, rows);
  if (step_skipped(fn, found_inf)) return;  // checked, nothing written
  run_rows(fn, table_for(isa)->eightbit, rows, nullptr, block_size);
}

}  // namespace
}  // namespace hfl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Native CPU optimizer kernels of hf_lowprec (see hf_lowprec.optim.native)";
  m.def("best_isa", &hfl::best_isa, "The widest instruction set this CPU runs: avx512_bf16, avx512, avx2 or scalar");
  m.def("adamw_step", &hfl::adamw_step);
  m.def("collage_step", &hfl::collage_step);
  m.def("kahan_step", &hfl::kahan_step);
  m.def("sr_step", &hfl::sr_step);
  m.def("master_step", &hfl::master_step);
  m.def("fp8_adamw_step", &hfl::fp8_adamw_step);
  m.def("coat_step", &hfl::coat_step);
  m.def("eightbit_step", &hfl::eightbit_step);
}
