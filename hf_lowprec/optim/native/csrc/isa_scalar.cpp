// The scalar build: the kernels with one lane, for CPUs without AVX2 (and HF_LOWPREC_CPU_ISA=scalar).
#include "native.h"

namespace {
using namespace hfl;
#include "traits_scalar.h"
using V = VS;
#include "kernels_impl.h"
}  // namespace

const hfl::Table* hfl::table_scalar() {
  static const Table table = make_table("scalar");
  return &table;
}
