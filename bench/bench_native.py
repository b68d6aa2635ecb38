"""Native CPU optimizer kernels (`hf_lowprec.optim.native`) against torch's fused AdamW, same run.

A benchmark, not a test: nothing here asserts on time. 50.4M parameters as 12 tensors of
2048² (well out of cache), 2 threads, gradients present; for each candidate, 4 warm-up steps
then 7 timed steps, each timed step next to a step of option D (`torch.optim.AdamW(fused=True)`,
FP32 weights, gradients and states), alternately, so that background load on a shared machine
slows both alike. Reported per candidate: its median and range, D's median and range over the
steps interleaved with it, the ratio D/candidate of the medians (above 1 = faster than D), and
GB/s over the ideal bytes (each stored tensor read once and written once):

| optimizer | reads | writes | B/param |
|---|---|---|---|
| D: torch fused AdamW FP32; DeepSpeedCPUAdam FP32 | g, m, v, θ: 16 | m, v, θ: 12 | 28 |
| master weights (BF16 θ, FP32 master and m, v) | g 2, θ₃₂ 4, m 4, v 4: 14 | θ₃₂, m, v: 12, θ 2 | 28 |
| collage-plus (BF16) | g, m, v, δv, θ, δθ: 12 | m, v, δv, θ, δθ: 10 | 22 |
| bf16-fp32states; DeepSpeedCPUAdam BF16/FP32 | g, θ: 4 + m, v: 8 | θ: 2 + m, v: 8 | 22 |
| collage-light, bf16-kahan (BF16) | g, m, v, θ, δθ: 10 | m, v, θ, δθ: 8 | 18 |
| bf16-pure, bf16-sr; DeepSpeedCPUAdam BF16/BF16; torch fused BF16 | g, m, v, θ: 8 | m, v, θ: 6 | 14 |
| FP8AdamW (FP16 θ·s, E4M3 g·s, E4M3 m, FP16 v) | g 1, m 1, v 2, θ 2: 6 | m 1, v 2, θ 2: 5 | 11 |
| COAT (FP32 θ and g, E4M3 m and v, groups of 128) | g 4, θ 4, m 1, v 1 (+ metadata): 10 | θ 4, m 1, v 1: 6 | 16 |
| collage-8bit (BF16 θ, δθ; 8-bit m, v in blocks of 256) | g 2, θ 2, δθ 2, m 1, v 1: 8 | θ 2, δθ 2, m 1, v 1: 6 | 14 |

FP8AdamW's two passes (amax, then recompute and store) read g, m, v, θ twice: 17 bytes move;
the table's GB/s uses the ideal 11.

Native rows run the widest ISA of this CPU (`native.isa()`); when that is AVX-512, the AVX2
kernels are timed beside them, forced with HF_LOWPREC_CPU_ISA=avx2. Peers: DeepSpeedCPUAdam
(FP32; BF16 weights with FP32 states; BF16 weights and states, `fp32_optimizer_states=False`;
its op is JIT-built once into TORCH_EXTENSIONS_DIR) and torch fused AdamW on BF16 weights and
states. `uptime` is printed before and after: the machine may be shared.

Usage: python bench/bench_native.py [--only NAME,...] [--tensors 12] [--side 2048]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions"))

from hf_lowprec.optim import native  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
WARMUP, TIMED = 4, 7
GOALS = {
    "bf16-pure": 1.9,
    "bf16-sr": 1.7,
    "collage-light": 1.45,
    "bf16-kahan": 1.45,
    "collage-plus": 1.15,
    "bf16-fp32states": 1.2,
    "fp8adamw": 1.5,
    "coat": 1.0,
}


def _tensors(count: int, side: int, dtype: torch.dtype, fill: str = "randn", seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        if fill == "zeros":
            out.append(torch.zeros(side, side, dtype=dtype))
        elif fill == "square":
            out.append((torch.randn(side, side, generator=generator) * 1e-3).square_().to(dtype))
        else:
            out.append((torch.randn(side, side, generator=generator) * 1e-2).to(dtype))
    return out


class Native:
    """A bucket of native-kernel state and the call that steps it."""

    def __init__(self, family: str, count: int, side: int, isa_env: str | None):
        self.family, self.isa_env, self.step_count = family, isa_env, 0
        bf16, fp32 = torch.bfloat16, torch.float32
        t = lambda dtype, fill="randn", seed=0: _tensors(count, side, dtype, fill, seed)  # noqa: E731
        if family == "fp8adamw":
            from hf_lowprec.fp8.scaled import pow2_scale, quantize

            real = t(fp32)
            self.master_scales = [pow2_scale(r.abs().amax(), torch.float16) for r in real]
            self.params = [quantize(r, s, torch.float16) for r, s in zip(real, self.master_scales)]
            grads = t(fp32, seed=1)
            self.grad_scales = [pow2_scale(g.abs().amax(), torch.float8_e4m3fn) for g in grads]
            self.grads = [quantize(g, s, torch.float8_e4m3fn) for g, s in zip(grads, self.grad_scales)]
            del real, grads
            self.m = [x.to(torch.float8_e4m3fn) for x in t(fp32, seed=2)]
            self.v = [x.to(torch.float16) for x in t(fp32, "square", 3)]
            self.m_scales = [torch.ones(()) for _ in range(count)]
            self.v_scales = [torch.ones(()) for _ in range(count)]
            return
        if family == "coat":
            from hf_lowprec.optim.coat_adamw import FP8GroupState

            self.params, self.grads = t(fp32), t(fp32, seed=1)
            self.states = [[FP8GroupState.zeros(p.shape, device="cpu") for _ in range(2)] for p in self.params]
            return
        if family == "collage-8bit":
            from hf_lowprec.optim.formats import Blockwise8bit

            self.params, self.grads = t(bf16), t(bf16, seed=1)
            self.errors = [(p.float() * 1e-3).to(bf16) for p in self.params]
            self.m = [Blockwise8bit(True).zeros(p) for p in self.params]
            self.v = [Blockwise8bit(False).zeros(p) for p in self.params]
            return
        param_dtype = bf16
        moment_dtype = fp32 if family in ("bf16-fp32states", "master") else bf16
        self.params = t(param_dtype)
        self.grads = t(bf16, seed=1)
        self.m = t(moment_dtype, seed=2)
        self.v = t(moment_dtype, "square", 3)
        if family in ("collage-light", "collage-plus", "bf16-kahan"):
            self.errors = [(p.float() * 1e-3).to(bf16) for p in self.params]
        if family == "collage-plus":
            self.v_errors = [(v.float() * 1e-3).to(bf16) for v in self.v]
        if family == "master":
            self.masters = [p.float() for p in self.params]

    def step(self) -> None:
        if self.isa_env:
            os.environ[native.ISA_ENV] = self.isa_env
        try:
            self.step_count += 1
            scalars = native.adamw_scalars([self.step_count] * len(self.params), **HYPER)
            f = self.family
            if f in ("bf16-pure", "bf16-fp32states"):
                native.adamw_step(self.params, self.grads, self.m, self.v, scalars)
            elif f == "bf16-sr":
                seeds = torch.randint(0, 2**31 - 1, (len(self.params),))
                native.sr_step(self.params, self.grads, self.m, self.v, scalars, seeds)
            elif f == "collage-light":
                native.collage_step(self.params, self.errors, self.grads, self.m, self.v, None, scalars)
            elif f == "collage-plus":
                native.collage_step(self.params, self.errors, self.grads, self.m, self.v, self.v_errors, scalars)
            elif f == "bf16-kahan":
                native.kahan_step(self.params, self.errors, self.grads, self.m, self.v, scalars)
            elif f == "master":
                native.master_step(self.params, self.masters, self.grads, self.m, self.v, scalars)
            elif f == "fp8adamw":
                native.fp8_adamw_step(
                    self.params,
                    self.master_scales,
                    self.grads,
                    self.grad_scales,
                    self.m,
                    self.m_scales,
                    self.v,
                    self.v_scales,
                    scalars,
                )
            elif f == "coat":
                native.coat_step(
                    self.params, None, self.grads, [s[0] for s in self.states], [s[1] for s in self.states], scalars
                )
            elif f == "collage-8bit":
                native.eightbit_step(
                    self.params,
                    self.errors,
                    self.grads,
                    [c for c, _ in self.m],
                    [a for _, a in self.m],
                    [c for c, _ in self.v],
                    [a for _, a in self.v],
                    scalars,
                )
            else:
                raise ValueError(f)
        finally:
            if self.isa_env:
                os.environ.pop(native.ISA_ENV, None)


def _torch_adamw(count: int, side: int, dtype: torch.dtype) -> Callable[[], None]:
    params = [p.requires_grad_() for p in _tensors(count, side, dtype)]
    for p, g in zip(params, _tensors(count, side, dtype, seed=1)):
        p.grad = g
    opt = torch.optim.AdamW(
        params,
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        fused=True,
    )
    return opt.step


def _deepspeed(count: int, side: int, dtype: torch.dtype, fp32_states: bool) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    params = [torch.nn.Parameter(p) for p in _tensors(count, side, dtype)]
    for p, g in zip(params, _tensors(count, side, dtype, seed=1)):
        p.grad = g
    opt = DeepSpeedCPUAdam(
        params,
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        adamw_mode=True,
        fp32_optimizer_states=fp32_states,
    )
    return opt.step


def _time(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _interleaved(candidate: Callable[[], None], reference: Callable[[], None]) -> tuple[list[float], list[float]]:
    for _ in range(WARMUP):
        reference()
        candidate()
    cand, ref = [], []
    for _ in range(TIMED):
        ref.append(_time(reference))
        cand.append(_time(candidate))
    return cand, ref


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "uptime unavailable"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=12)
    parser.add_argument("--side", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated row names to run (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, side = args.tensors, args.side
    numel = n * side * side
    reason = native.native_unavailable()
    best = native.isa() if reason is None else "unavailable"
    print(
        f"# {numel / 1e6:.1f}M parameters ({n} x {side}^2), {args.threads} threads, torch {torch.__version__}, "
        f"native ISA {best}{'' if reason is None else ' (' + reason + ')'}"
    )
    print(f"# load before: {_uptime()}")

    families = [
        ("bf16-pure", 14),
        ("bf16-sr", 14),
        ("collage-light", 18),
        ("bf16-kahan", 18),
        ("collage-plus", 22),
        ("bf16-fp32states", 22),
        ("master", 28),
        ("fp8adamw", 11),
        ("coat", 16),
        ("collage-8bit", 14),
    ]
    rows: list[tuple[str, Callable[[], Callable[[], None]], int, str | None]] = []
    if reason is None:
        isas = [(best, None)] + ([("avx2", "avx2")] if best == "avx512" else [])
        for isa_name, env in isas:
            for family, nbytes in families:
                if family == "coat" and not hasattr(native, "coat_step"):
                    continue
                rows.append(
                    (
                        f"native {family} [{isa_name}]",
                        lambda f=family, e=env: Native(f, n, side, e).step,
                        nbytes,
                        family,
                    )
                )
    rows += [
        ("torch fused AdamW BF16/BF16", lambda: _torch_adamw(n, side, torch.bfloat16), 14, None),
        ("DeepSpeedCPUAdam FP32", lambda: _deepspeed(n, side, torch.float32, True), 28, None),
        ("DeepSpeedCPUAdam BF16/FP32 states", lambda: _deepspeed(n, side, torch.bfloat16, True), 22, None),
        ("DeepSpeedCPUAdam BF16/BF16", lambda: _deepspeed(n, side, torch.bfloat16, False), 14, None),
    ]
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if only:
        rows = [r for r in rows if any(o in r[0] for o in only)]

    reference = _torch_adamw(n, side, torch.float32)
    print("| optimizer | ms median (range) | D ms median (range) | D/candidate | goal | GB/s (ideal B/param) |")
    print("|---|---|---|---|---|---|")
    for name, make, nbytes, family in rows:
        try:
            step = make()
        except Exception as error:  # a peer that is missing or fails: listed as such
            print(f"| {name} | unavailable: {type(error).__name__}: {str(error).splitlines()[0][:100]} | | | | |")
            continue
        cand, ref = _interleaved(step, reference)
        c_med, r_med = statistics.median(cand), statistics.median(ref)
        goal = GOALS.get(family or "")
        goal_text = f"≥ {goal:.2f}×" if goal else ""
        print(
            f"| {name} | {c_med * 1e3:.1f} ({min(cand) * 1e3:.1f}–{max(cand) * 1e3:.1f}) | "
            f"{r_med * 1e3:.1f} ({min(ref) * 1e3:.1f}–{max(ref) * 1e3:.1f}) | {r_med / c_med:.2f}× | {goal_text} | "
            f"{numel * nbytes / c_med / 1e9:.1f} ({nbytes}) |",
            flush=True,
        )
        del step
        gc.collect()
    print(f"# load after: {_uptime()}")


if __name__ == "__main__":
    main()
