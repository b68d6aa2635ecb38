"""Section `e2e` of the device check (bench/device_check.py): one model, trained end to end per row.

The model is Llama-style, from config, large enough for FP8 GEMMs to matter on one GPU: hidden
2048, intermediate 8192, 8 layers, 16 heads (8 key/value heads), vocabulary 32000, untied head:
0.63 B parameters; batch 4 × 2048 tokens. Each decoder layer is `torch.compile`d (inductor):
regional compilation, as torchtitan compiles, one graph serving the eight layers, so a row
costs the compile of one layer. Per row: the model built on the device from seed 0, prepared
(by the strategy, or by torchao), three warm-up steps (compilation), then ten steps with no host
sync between them; tokens/s over those ten, and `torch.cuda.max_memory_allocated` since the
model was built (weights, gradients, optimizer states, activations). Ratios are to bf16-mixed,
measured first in the same process.

Each row also gets the step ms the step ledger predicted for this GPU (`make device-bundle`
counts them into the bundle: docs/planning.md), and one more step under `torch.profiler`:
kernels launched and the device's busy time, beside the measured step (host-bound when the
device idles), and the five longest kernels (in the JSON).

The torch-amp row is torch's own recipe (autocast over FP32 weights, `AdamW(fused=True)`), what
bf16-mixed and collage-plus must match. The torchao row is the peer a user would pick: `convert_to_float8_training` with the
"tensorwise" recipe (dynamic per-tensor scales) on every Linear but the LM head (the package's
FP8 strategies keep the head too), FP32 weights under BF16 autocast, `AdamW(fused=True)`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from device_common import Report, cuda_or_say, measured_rows, predicted_ms, prediction_check, profiled_step

TORCHAO = "torchao float8"
# torch autocast over FP32 weights with AdamW(fused=True): what `bf16=True` with
# `optim="adamw_torch_fused"` runs (`hf_lowprec.planning.counting.ANCHOR`).
TORCH_AMP = "torch-amp"
# The headline rows first: a section cut by its budget keeps them.
ROWS = ("bf16-mixed", "fp8-lm-o2", TORCHAO, TORCH_AMP, "coat", "collage-plus", "fp8-lm-o1")
# (tokens/s at least, peak memory at most), as ratios to bf16-mixed: the goals.
GOALS = {"fp8-lm-o2": (1.2, 0.75), "coat": (1.0, 0.65), "collage-plus": (1.0, 0.85)}
# Rows whose goal is torch's own recipe: at least this share of torch-amp's tokens/s (issue #66).
AMP_GOALS = {"bf16-mixed": 0.98, "collage-plus": 0.98}
BATCH, SEQ, WARMUP, TIMED = 4, 2048, 3, 10


def llama_config(smoke: bool) -> Any:
    from transformers import LlamaConfig

    if smoke:
        return LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )


def prepare(name: str, model: Any, device: str) -> tuple[Any, Any, Callable[[], Any], Callable[[Any], Any]]:
    """(model, optimizer, forward context, loss scaling) of a row."""
    import torch

    if name == TORCH_AMP:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        return model, optimizer, lambda: torch.autocast(device, dtype=torch.bfloat16), lambda loss: loss
    if name != TORCHAO:
        import hf_lowprec

        strategy = hf_lowprec.get_strategy(name)
        model = strategy.prepare_model(model)
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-4, weight_decay=0.01)
        return model, optimizer, strategy.forward_context, strategy.scale_loss
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn != "lm_head")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    return model, optimizer, lambda: torch.autocast(device, dtype=torch.bfloat16), lambda loss: loss


def timed_steps(step: Callable[[], Any], warmup: int, timed: int, cuda: bool) -> tuple[float, float, Any]:
    """(warm-up seconds, seconds of the `timed` steps after them, the last step's result): the
    device synchronised once after each phase, never between steps."""
    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warm = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(timed):
        result = step()
    sync()
    return warm, time.perf_counter() - start, result


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    cuda = args.device == "cuda"
    batch, seq = (2, 32) if args.smoke else (BATCH, SEQ)
    warmup, timed = (1, 2) if args.smoke else (WARMUP, TIMED)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    config = llama_config(args.smoke)
    # No KV cache in training: with one, each compiled layer guards on its own layer of the cache,
    # eight graphs per model (the first H200 run); without, transformers reads the position ids on
    # the host once per step (a packed-sequence check), the same for every row.
    config.use_cache = False
    with torch.device(args.device):
        model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model, optimizer, context, scale_loss = prepare(name, model, args.device)
    for layer in model.model.layers:
        layer.compile(backend="eager" if args.smoke else "inductor")
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)

    # CUDA events around each optimizer step (no sync: read after the last one) split a slow
    # step into forward + backward and optimizer (the first H200 run: fp8-lm-o2 at 0.43×).
    marks: list[tuple[Any, Any]] = []

    def step() -> Any:
        with context():
            loss = model(input_ids=ids, labels=ids).loss
        scale_loss(loss).backward()
        if cuda:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            after.record()
            marks.append((before, after))
        return loss.detach()

    compile_s, seconds, loss = timed_steps(step, warmup, timed, cuda)
    optimizer_ms = sum(b.elapsed_time(a) for b, a in marks[-timed:]) / timed if cuda else float("nan")
    # Where the time goes: one more step under the profiler (launches, device busy time).
    profiled = profiled_step(step)
    predicted = predicted_ms("e2e", name) if cuda and not args.smoke else None
    return {
        **profiled,
        "predicted ms": predicted,
        "prediction": prediction_check(predicted, 1e3 * seconds / timed),
        "row": name,
        "parameters": params,
        "tokens/s": batch * seq * timed / seconds,
        "step ms": 1e3 * seconds / timed,
        "optimizer ms": optimizer_ms,
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "warm-up s": compile_s,
        "loss": loss.float().item(),
        "steps": (warmup, timed),
    }


def goal(name: str, speed: float, memory: float, torchao_speed: float | None) -> str:
    if name not in GOALS:
        return ""
    fast, small = GOALS[name]
    parts = [f"≥{fast}× tokens/s {'met' if speed >= fast else 'missed'}"]
    parts.append(f"≤{small}× memory {'met' if memory <= small else 'missed'}")
    if name == "fp8-lm-o2" and torchao_speed is not None:
        parts.append(f"≥ torchao's tokens/s {'met' if speed >= torchao_speed else 'missed'}")
    return "; ".join(parts)


def run_e2e(args: argparse.Namespace, context: dict[str, Any]) -> None:

    columns = ["row", "tokens/s", "× bf16-mixed", "peak GiB", "memory × bf16-mixed", "step ms", "optimizer ms"]
    columns += ["predicted ms", "prediction", "device busy ms", "launches", "warm-up s"]
    columns += ["loss", "goal"]
    title = "End to end: Llama-style 0.63 B, batch 4×2048, decoder layers torch.compile'd"
    report = Report(args.out, "e2e", title + (" (smoke: toy sizes)" if args.smoke else ""), columns, context)
    if not cuda_or_say(args, report):
        return
    results: dict[str, dict[str, Any]] = {}
    for name, result in measured_rows(report, [(row,) for row in ROWS], measure, args, reserve=20, column="goal"):
        if not results:
            warmup, timed = result.pop("steps")
            report.note(f"{result['parameters'] / 1e9:.2f} B parameters; {timed} timed steps after {warmup} warm-up")
        result.pop("steps", None)
        results[name] = result
        base = results.get("bf16-mixed", result)
        speed = result["tokens/s"] / base["tokens/s"]
        memory = result["peak GiB"] / base["peak GiB"]
        torchao = results.get(TORCHAO)
        row = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
        row |= {"× bf16-mixed": round(speed, 3), "memory × bf16-mixed": round(memory, 3)}
        row["goal"] = goal(name, speed, memory, torchao and torchao["tokens/s"] / base["tokens/s"])
        report.add(row)
    amp = results.get(TORCH_AMP)
    for name, least in AMP_GOALS.items():  # bf16-mixed runs before torch-amp: judged at the end
        if amp is not None and name in results:
            share = results[name]["tokens/s"] / amp["tokens/s"]
            report.note(
                f"{name}: ≥{least}× torch-amp's tokens/s {'met' if share >= least else 'missed'} ({share:.3f}×)"
            )
    report.finish()
