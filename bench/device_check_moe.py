"""Section `moe` of the device check (bench/device_check.py): a Mixture-of-Experts model end to end.

The model is Qwen3-MoE-shaped, from config: hidden 1024, 8 layers, 16 heads (8 key/value heads),
64 experts of width 512 with top-4 routing, vocabulary 32000, untied head: 0.90 B parameters,
of which 0.81 B are expert weights; batch 4 × 2048 tokens. Eager (no compile: the rows compare
the GEMMs, and a compile of each row would not fit the section's budget). Per row: the model
built on the device from seed 0, prepared by the strategy, two warm-up steps, then five steps
with no host sync between them; tokens/s over those five, `torch.cuda.max_memory_allocated`
since the model was built, and the share of weight-GEMM multiply-adds in FP8 (the startup
report's). Ratios are to the first row that ran, bf16-mixed.

Rows: bf16-mixed (FP32 masters, transformers' own experts implementation), bf16-pure (BF16
weights: the experts run BF16 `grouped_mm`, the peer the FP8 grouped GEMM must beat),
fp8-lm-o2 (tensorwise: native forward, emulated backward on Hopper), fp8-lm-o2 with the
rowwise recipe (native forward and backward on Hopper), then, as the budget allows, coat (its
FP8 activations packed by compiled graphs) and fp16-als (FP16 weights, BF16 grouped GEMMs).
"""

from __future__ import annotations

import argparse
from typing import Any

from device_check_e2e import timed_steps
from device_common import Report, cuda_or_say, measured_rows, predicted_ms, prediction_check, profiled_step

ROWS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("bf16-mixed", "bf16-mixed", {}),
    ("bf16-pure", "bf16-pure", {}),
    ("fp8-lm-o2", "fp8-lm-o2", {}),  # experts in FP8 only where the rule says FP8 pays (fp8.payoff)
    ("fp8-lm-o2 all-FP8 rowwise", "fp8-lm-o2", {"recipe": "rowwise", "fp8_layers": "all"}),
    ("coat", "coat", {}),
    ("fp16-als", "fp16-als", {}),
)
BATCH, SEQ, WARMUP, TIMED = 4, 2048, 2, 5


def moe_config(smoke: bool) -> Any:
    from hf_lowprec.testing.moe import moe_config as tiny

    if smoke:
        return tiny("qwen3_moe", vocab=512, hidden=64, intermediate=32, experts=8, top_k=2, layers=2)
    return tiny(
        "qwen3_moe",
        vocab=32000,
        hidden=1024,
        intermediate=512,
        experts=64,
        top_k=4,
        layers=8,
        heads=16,
        max_position_embeddings=SEQ,
    )


def measure(label: str, name: str, options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    import hf_lowprec
    from hf_lowprec.report import describe

    cuda = args.device == "cuda"
    batch, seq = (2, 32) if args.smoke else (BATCH, SEQ)
    warmup, timed = (1, 2) if args.smoke else (WARMUP, TIMED)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    config = moe_config(args.smoke)
    config.use_cache = False  # training builds no KV cache
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    strategy = hf_lowprec.get_strategy(name, **options)
    model = strategy.prepare_model(model)
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-4, weight_decay=0.01)
    share = describe(strategy, model)["fp8"]["weight_gemm_share"]
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)

    def step() -> Any:
        with strategy.forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        strategy.scale_loss(loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    warm, seconds, loss = timed_steps(step, warmup, timed, cuda)
    profiled = profiled_step(step)
    predicted = predicted_ms("moe", label) if cuda and not args.smoke else None
    return {
        **profiled,
        "predicted ms": predicted,
        "prediction": prediction_check(predicted, 1e3 * seconds / timed),
        "row": label,
        "parameters": params,
        "fp8 share": share,
        "tokens/s": batch * seq * timed / seconds,
        "step ms": 1e3 * seconds / timed,
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "warm-up s": warm,
        "loss": loss.float().item(),
    }


def run_moe(args: argparse.Namespace, context: dict[str, Any]) -> None:

    columns = ["row", "tokens/s", "× bf16-mixed", "× bf16-pure", "peak GiB", "memory × bf16-mixed", "fp8 share"]
    columns += ["step ms", "predicted ms", "prediction", "device busy ms", "launches", "warm-up s", "loss", "note"]
    title = "MoE end to end: Qwen3-MoE-shaped 0.90 B (64 experts, top-4), batch 4×2048, eager"
    report = Report(args.out, "moe", title + (" (smoke: toy sizes)" if args.smoke else ""), columns, context)
    if not cuda_or_say(args, report):
        return
    results: dict[str, dict[str, Any]] = {}
    for label, result in measured_rows(report, ROWS, measure, args, reserve=15):
        if not results:
            report.note(f"{result['parameters'] / 1e9:.2f} B parameters")
        results[label] = result
        base = results.get("bf16-mixed", result)
        peer = results.get("bf16-pure")
        row = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
        row["× bf16-mixed"] = round(result["tokens/s"] / base["tokens/s"], 3)
        row["× bf16-pure"] = round(result["tokens/s"] / peer["tokens/s"], 3) if peer else ""
        row["memory × bf16-mixed"] = round(result["peak GiB"] / base["peak GiB"], 3)
        if label.startswith("fp8") and peer:
            row["note"] = (
                "faster than BF16 grouped_mm"
                if result["tokens/s"] > peer["tokens/s"]
                else "slower than BF16 grouped_mm"
            )
        report.add(row)
    report.finish()
