"""The step ledger at the device check's shapes (issues #66, #69; docs/planning.md): per strategy
and peer (`torch-amp`, `torchao-float8` from build/bench-site), kernels, GB moved, GEMM TFLOPs by
width, host syncs, and the predicted H200 step, GPU-bound or host-bound; markdown on stdout.

    python bench/bench_ledger.py [--strategies a,b] [--gpu h200] [--smoke]

Counted on CPU with fake tensors (not timed: the same on a loaded machine). Models: `llama-0.63b`,
decoder layers compiled (`e2e`), `qwen3-moe-0.9b` eager (`moe`), batch 4×2048. `--smoke`: two rows.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch
from bench_e2e import ensure_torchao

import hf_lowprec
from hf_lowprec.planning.counting import ANCHOR, TORCHAO, count_scaled
from hf_lowprec.planning.gpus import gpu_named
from hf_lowprec.planning.roofline import predict

SHAPES = (("llama-0.63b", True), ("qwen3-moe-0.9b", False))
# The operand widths as docs/benchmarks.md names them: FP8 is E4M3 (forward) and E5M2 (backward) together.
WIDTHS = {
    torch.bfloat16: "BF16",
    torch.float16: "FP16",
    torch.float32: "FP32",
    torch.float8_e4m3fn: "FP8",
    torch.float8_e5m2: "FP8",
}


def by_width(flops: dict[torch.dtype, int]) -> dict[str, int]:
    """{width name: FLOPs} of a ledger's {operand dtype: FLOPs}, in `WIDTHS` order."""
    out: dict[str, int] = {}
    for dtype in sorted(flops, key=lambda d: list(WIDTHS).index(d) if d in WIDTHS else len(WIDTHS)):
        name = WIDTHS.get(dtype, str(dtype).removeprefix("torch."))
        out[name] = out.get(name, 0) + flops[dtype]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    why_not = ensure_torchao()  # torchao 0.18 in build/bench-site, as bench_e2e.py's compiled table has it
    peers = [ANCHOR] + ([TORCHAO] if why_not is None else [])
    parser.add_argument("--strategies", default=",".join([*peers, *hf_lowprec.available_strategies()]))
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    names = [ANCHOR, "fp8-lm-o2"] if args.smoke else args.strategies.split(",")
    if why_not is not None:
        print(f"(no {TORCHAO} row: {why_not})")
    gpu = gpu_named(args.gpu)
    logging.getLogger("hf_lowprec").setLevel(logging.ERROR)
    for model, compiled in SHAPES[:1] if args.smoke else SHAPES:
        print(f"\n{model}, batch 4x2048, {'decoder layers compiled' if compiled else 'eager'}, predicted on {gpu.name}")
        print("| strategy | kernels | of them eager | graphs | GB moved | TFLOPs (width) | syncs | step ms | bound |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name in names:
            try:
                count = count_scaled(name, model, (4, 2048), compiled_layers=compiled, gpu=gpu)
            except Exception as error:  # a row that fails is a finding, not a crash
                print(f"| {name} | error: {type(error).__name__}: {str(error).splitlines()[0][:120]} |", flush=True)
                continue
            total, p = count.total(), predict(count, gpu)
            flops = ", ".join(f"{n / 1e12:.1f} {w}" for w, n in by_width(total.flops).items())
            print(
                f"| {name} | {total.kernels} | {total.eager} | {total.graphs} | {total.bytes / 1e9:.0f} | {flops} | "
                f"{total.syncs} | {p.step * 1e3:.1f} | {p.bound} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
