"""Evidence for the blockwise 8-bit state format (`formats.Blockwise8bit`, strategy collage-8bit).

    python bench/eightbit_evidence.py [--steps 200]

1. State error: tiny GPT-2 trained with FP32 `torch.optim.AdamW` for `--steps` steps; its real
   m and v (every 2-D weight) are stored in each format and read back. Reported: the norm-wise
   relative error of m and of v, and of the AdamW direction m/(√v + ε) computed from the stored
   pair, against the FP32 values (FP64 arithmetic). Rows: our blockwise 8-bit, the 8-bit states
   of torchao (`OptimState8bit`) and bitsandbytes (`quantize_blockwise`) where installed, and,
   for scale, BF16, FP8AdamW's per-tensor E4M3/FP16 and COAT's per-group E4M3.
2. Fidelity: `python -m hf_lowprec.demo --strategies bf16-mixed,collage-8bit ...` (run
   separately; its command is printed here).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_lowprec.optim.formats import Blockwise8bit, GroupFP8, Plain, Scaled

EPS = 1e-8


def trained_states(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=128, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 256, (8, 64), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [
        (s["exp_avg"].reshape(-1), s["exp_avg_sq"].reshape(-1))
        for p, s in optimizer.state.items()
        if p.dim() == 2 and p.numel() % 256 == 0
    ]


def through(fmt, x: torch.Tensor) -> torch.Tensor:
    """x stored in an hf_lowprec format and decoded."""
    stored = fmt.zeros(x)
    values = x.view(-1, fmt.block) if fmt.block > 1 else x
    fmt.encode_(values.clone(), *stored)
    return fmt.decode(*stored).reshape(-1)[: x.numel()]


def torchao_8bit(signed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    from torchao.optim.subclass_8bit import OptimState8bit

    def run(x: torch.Tensor) -> torch.Tensor:
        state = OptimState8bit.zeros(x.shape, signed=signed, block_size=256, device=x.device)
        state.copy_(x)
        return state.dequantize()

    return run


def bnb_8bit(signed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    import bitsandbytes.functional as F

    code = F.create_dynamic_map(signed=signed)

    def run(x: torch.Tensor) -> torch.Tensor:
        payload, state = F.quantize_blockwise(x, code=code, blocksize=256)
        return F.dequantize_blockwise(payload, state)

    return run


ROWS: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = [
    (
        "hf_lowprec blockwise 8-bit (collage-8bit)",
        lambda x: through(Blockwise8bit(True), x),
        lambda x: through(Blockwise8bit(False), x),
    ),
    ("torchao AdamW8bit states", torchao_8bit(True), torchao_8bit(False)),
    ("bitsandbytes AdamW8bit states", bnb_8bit(True), bnb_8bit(False)),
    (
        "BF16 (bf16-pure, collage-light)",
        lambda x: through(Plain(torch.bfloat16), x),
        lambda x: through(Plain(torch.bfloat16), x),
    ),
    (
        "FP8AdamW: E4M3 m, FP16 v, per tensor",
        lambda x: through(Scaled(torch.float8_e4m3fn), x),
        lambda x: through(Scaled(torch.float16), x),
    ),
    (
        "COAT: per-group E4M3, expansion",
        lambda x: through(GroupFP8(torch.float8_e4m3fn), x),
        lambda x: through(GroupFP8(torch.float8_e4m3fn), x),
    ),
]


def relative(approx: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    num = sum(float((a.double() - e.double()).square().sum()) for a, e in zip(approx, exact))
    den = sum(float(e.double().square().sum()) for e in exact)
    return (num / den) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)
    states = trained_states(args.steps)
    ms, vs = [m for m, _ in states], [v for _, v in states]
    directions = [m.double() / (v.double().sqrt() + EPS) for m, v in states]
    numel = sum(m.numel() for m in ms)
    print(
        f"1. State error after {args.steps} FP32 AdamW steps of a 2-layer GPT-2 (d=128): {len(ms)} weights, "
        f"{numel / 1e6:.2f}M elements; norm-wise relative error against the FP32 states\n"
    )
    print("| storage of m, v | m | v | m/(√v + ε) |")
    print("|---|---|---|---|")
    for name, encode_m, encode_v in ROWS:
        try:
            qm, qv = [encode_m(m) for m in ms], [encode_v(v) for v in vs]
        except Exception as error:  # a peer that is not installed or does not run here
            print(f"| {name} | not run: {type(error).__name__}: {str(error).splitlines()[0][:60]} | | |")
            continue
        qd = [m.double() / (v.double().clamp(min=0).sqrt() + EPS) for m, v in zip(qm, qv)]
        print(f"| {name} | {relative(qm, ms):.2e} | {relative(qv, vs):.2e} | {relative(qd, directions):.2e} |")
    print(
        "\n2. Fidelity: OMP_NUM_THREADS=1 python -m hf_lowprec.demo --steps 1000 --lr 1e-3 --threads 1 "
        "--strategies bf16-mixed,collage-8bit,collage-light,bf16-pure"
    )


if __name__ == "__main__":
    main()
