"""`hf-lowprec plan`: per strategy, the predicted step time and tokens/s of a model on a named
GPU (and cluster), GPU-bound or host-bound, the model state and peak memory per GPU, the bytes
each GPU sends, ratios to bf16-mixed, what limits the step and which layers FP8 keeps in BF16
(`plan_rows`, `format_plan`). Each step is counted once on CPU (`counting`), then priced
(`roofline`, `communication`); `calibration_lines` says how far the model is from every step the
project has measured on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from ..engines import traffic as collectives
from ..strategies.registry import get_strategy
from .communication import GPUS_PER_NODE, communication
from .counting import ANCHOR, PEERS, TORCHAO, start_counts
from .gpus import GPU, MEASURED
from .models import (
    build_model,
    engine_refusal,
    layer_overrides,
    memory_plan,
    model_config,
    quiet,
    rule_options,
    uniform_depth,
)
from .roofline import predict, predict_measured

__all__ = [
    "ENGINE_STAGES",
    "GPU_PREVIEW",
    "SCALES",
    "calibration_lines",
    "format_plan",
    "gpu_preview",
    "plan_rows",
    "scaling_lines",
]

BASELINE = "bf16-mixed"
# The cluster sizes every plan prices (the batch per GPU kept), and those it searches for the
# point where communication overtakes compute.
SCALES = (8, 64, 512)
_POWERS = tuple(2**k for k in range(1, 10))
# What the main job's CPU rows are priced at on a GPU: its architecture at GPT-2 small's size.
_PREVIEW = ("gpt2", (8, 1024), "h100")
GPU_PREVIEW = "GPT-2 124M, batch 8×1024, eager, one H100"
# The ZeRO stage whose per-rank model state each engine holds past one GPU (`memory.zero_per_rank`):
# DDP none sharded; ZeRO-2 gradients and optimizer state, beside its flat weight partition; FSDP2 all.
ENGINE_STAGES = {"ddp": 0, "zero2": 2, "fsdp2": 3}


def _prepared(name: str, model: str, options: dict[str, Any], layers: int | None) -> torch.nn.Module:
    """`model` at `layers` decoder layers (None: the config's) as strategy `name` prepares it, on meta."""
    overrides = {} if layers is None else layer_overrides(model_config(model)[0], layers)
    with quiet("hf_lowprec.fp8"):
        return get_strategy(name, **options).prepare_model(build_model(model, **overrides))


def _kept_in_bf16(name: str, model: str, options: dict[str, Any]) -> list[str]:
    """Layers (and experts modules) an FP8 strategy keeps in high precision on `model`: its LM
    head, layers FP8 would not speed up (`options`: the rule's GPU and tokens), small ones."""
    if name == TORCHAO:  # the peer converts every linear layer but the LM head
        return ["lm_head"]
    if name == ANCHOR or not name.startswith(("fp8", "coat")):
        return []
    # What the conversion recorded (nn.Linear and GPT-2's Conv1D layers, experts modules alike), on
    # one block where all are alike, else on every block (DeepSeek-V3's first is dense: no experts).
    prepared = _prepared(name, model, options, 1 if uniform_depth(model) else None)
    return sorted({n.split(".")[-1] for n in prepared.__dict__.get("fp8_skipped_layers", {})})


def _fp8_weight_share(name: str, model: str, options: dict[str, Any], params: float) -> float:
    """The share of `model`'s `params` parameters that are FP8 GEMM weights (`FP8Linear`, experts) under
    strategy `name`: those FSDP2 gathers, and O3's ZeRO reduces and gathers, one byte each."""
    from ..fp8 import FP8Linear
    from ..fp8.experts import FP8Experts, expert_weight_names

    def elements(layers: int | None) -> int:
        prepared, count = _prepared(name, model, options, layers), 0
        for m in prepared.modules():
            if isinstance(m, FP8Linear):
                count += m.weight.numel()
            elif isinstance(m, FP8Experts):  # the experts' 3-D weights gather and reduce as FP8 too
                count += sum(getattr(m, n).numel() for n in expert_weight_names(m))
        return count

    if not name.startswith("fp8-lm"):
        return 0.0
    depth = uniform_depth(model)
    if depth > 2:  # blocks alike: two shallow models, scaled to the depth (as `memory_plan`)
        one, two = elements(1), elements(2)
        return (one + (depth - 1) * (two - one)) / params
    return elements(None) / params


def _root_share(model: str, params: float) -> float:
    """The share of `model`'s `params` parameters outside the blocks FSDP2 shards one by one
    (embeddings, final norm, an untied LM head): the root group, which stays gathered from
    forward to backward, so it is gathered once a step where each block is gathered twice."""
    from ..engines.fsdp2 import block_modules

    one = build_model(model, **layer_overrides(model_config(model)[0], 1))
    inside = {id(p) for block in block_modules(one) for p in block.parameters()}
    return sum(p.numel() for p in dict.fromkeys(one.parameters()) if id(p) not in inside) / params


def _wire_bytes(name: str, engine: str, fp8_share: float = 0.0, root_share: float = 0.0) -> tuple[float, float]:
    """(gradient bytes per parameter on the wire, weight bytes per parameter gathered) under
    `engine`: DDP all-reduces gradients in their dtype (1 B with FP8-LM's FP8 all-reduce hook);
    FSDP2 reduces in its policy's `reduce_dtype` and gathers in its `param_dtype`, the FP8 GEMM
    weights (`fp8_share` of the parameters) as E4M3, the blocks twice a step and the root group
    (`root_share`, never FP8) once, given as the mean of a gather pass over the two passes;
    ZeRO-2 reduces and gathers in the partitions' dtype, but for O3's FP8 weights, all-reduced
    (twice a reduce-scatter's bytes) and gathered as FP8."""
    if name in PEERS:  # FP32 weights: FP32 gradients; FSDP2 as torch users set it (BF16 gather)
        return 4.0, (2.0 - root_share) if engine == "fsdp2" else 4.0
    strategy = get_strategy(name)
    width = torch.empty((), dtype=strategy.param_dtype).element_size()
    if engine == "ddp":
        return (1.0 if strategy.ddp_comm_hook() is not None else float(width)), float(width)
    if engine == "fsdp2":
        rates = collectives.traffic(strategy)
        if rates.fsdp2_reduce_scatter is None:  # refused under FSDP2 (planned on one GPU only)
            return float(width), float(width)
        fp8 = fp8_share if strategy.engine_support().fsdp2_gathers_fp8 else 0.0
        other = rates.fsdp2_gather_other
        gather = fp8 * rates.fsdp2_gather_fp8_weights + (1 - fp8) * other - root_share * other / 2
        return float(rates.fsdp2_reduce_scatter), float(gather)
    if name == "fp8-lm-o3":  # FP8-LM's own ZeRO: its FP8 weights beside DeepSpeed's FP32 partitions
        return fp8_share * 2 * 1 + (1 - fp8_share) * 4.0, fp8_share * 1 + (1 - fp8_share) * 4.0
    return float(width), float(width)


def plan_rows(
    model: str,
    strategies: list[str],
    batch: tuple[int, int],
    gpu: GPU,
    gpus: int = 1,
    engine: str = "ddp",
    compiled_layers: bool = False,
) -> list[dict[str, Any]]:
    """One row per strategy (the peers `PEERS` may be among them): predictions on `gpu` for a
    per-GPU batch of `batch` = (sequences, tokens each) on `gpus` GPUs under `engine`. The ratios
    are to bf16-mixed's row, which is planned first where `strategies` lacks it."""
    model_config(model)
    if BASELINE not in strategies:
        strategies = [BASELINE, *strategies]
    counts = start_counts(strategies, model, batch, compiled_layers=compiled_layers, gpu=gpu)
    memory = {}
    # torch's recipe holds what bf16-mixed holds: FP32 weights, gradients and moments (16 B/param).
    names = list(dict.fromkeys(BASELINE if n in PEERS else n for n in strategies))
    tokens = batch[0] * batch[1]
    for row in memory_plan(model, names, gpus, ENGINE_STAGES[engine] if gpus > 1 else 0, gpu, tokens):
        memory[row["strategy"]] = row
    kept = {name: _kept_in_bf16(name, model, rule_options(name, gpu, tokens)) for name in strategies}
    params = memory[BASELINE]["num_params"]
    fp8_share = {n: _fp8_weight_share(n, model, rule_options(n, gpu, tokens), params) for n in strategies}
    root = _root_share(model, params) if engine == "fsdp2" else 0.0
    rows = []
    for name, count in counts().items():
        predicted = predict(count, gpu)
        state = memory[BASELINE if name in PEERS else name]
        params = state["num_params"]
        # `hf-lowprec memory`'s own per-rank figure (`zero_per_rank`), so the two cannot differ.
        per_gpu = state.get("per_rank_total", state["total"]) * params
        grads, weights = _wire_bytes(name, engine, fp8_share[name], root)
        traffic = communication(engine, gpus, params, grads, weights, gpu)
        step = max(predicted.step, traffic.seconds)
        # Past one machine: the same per-GPU batch on more GPUs (the compute of a step stays, the
        # traffic grows with the ring and crosses the network past a node).
        at = {n: communication(engine, n, params, grads, weights, gpu).seconds for n in _POWERS}
        # What is resident between steps (counted), sharded as the model state is, then the
        # step's own peak on top (activations, the gradients it allocates).
        share = per_gpu / (state["total"] * params)
        peak = count.resident_bytes * share + count.peak_bytes
        if engine == "ddp" and gpus > 1:
            # DDP's flat gradient buckets, in the parameters' dtypes, beside `p.grad` (the package
            # leaves `gradient_as_bucket_view` off): the parameters' bytes once more.
            peak += state["params"] * params
        limit = "communication" if traffic.seconds > predicted.step else predicted.limit
        rows.append(
            {
                "strategy": name,
                "step_ms": step * 1e3,
                "compute_ms": predicted.step * 1e3,
                "gpu_ms": predicted.gpu * 1e3,
                "host_ms": predicted.host * 1e3,
                "communication_ms": traffic.seconds * 1e3,
                "bound": "communication" if limit == "communication" else predicted.bound,
                "tokens_per_s": gpus * batch[0] * batch[1] / step,
                "kernels": count.total().kernels,
                "gigabytes": count.total().bytes / 1e9,
                "syncs": predicted.syncs,
                "model_state_gib": per_gpu / 2**30,
                "state_bytes_per_param": state["total"],
                "peak_gib": peak / 2**30,
                "sent_gb": traffic.bytes / 1e9,
                "limit": limit,
                "kept_in_bf16": kept[name],
                "step_ms_at_gpus": {n: max(predicted.step, at[n]) * 1e3 for n in SCALES},
                "communication_bound_from": next((n for n in _POWERS if at[n] > predicted.step), None),
                "fits": peak <= gpu.memory,
                "refused_past_one_gpu": engine_refusal(name, engine),  # None: the engine trains it
                # No FP8 layer on this model at this GPU and batch: its first step refuses the run
                # (`memory_plan`'s, from `fp8.refusal.no_fp8_layer`, the promise check's rule).
                "refused": None if name in PEERS else state["refused"],
            }
        )
    base = next(r for r in rows if r["strategy"] == BASELINE)
    for r in rows:
        r["speed_vs_bf16_mixed"] = base["step_ms"] / r["step_ms"]
        r["memory_vs_bf16_mixed"] = r["peak_gib"] / base["peak_gib"]
    return rows


def gpu_preview(strategies: list[str]) -> dict[str, float]:
    """{strategy: predicted step ms} for `GPU_PREVIEW`: what the main job prints beside its CPU rows."""
    from .gpus import GPUS

    model, batch, gpu = _PREVIEW
    with quiet():
        counts = start_counts(strategies, model, batch, compiled_layers=False, gpu=GPUS[gpu])()
    return {name: predict(count, GPUS[gpu]).step * 1e3 for name, count in counts.items()}


def format_plan(rows: list[dict[str, Any]], title: str) -> str:
    """The rows as a table, then one line per strategy on what limits it."""
    head = (
        f"{'strategy':<16} {'step ms':>8} {'tok/s':>9} {'× bf16-mixed':>12} {'bound':>6} {'kernels':>7} "
        f"{'GB moved':>8} {'state GiB':>9} {'peak GiB':>8} {'mem ×':>6} {'sent GB':>7}"
    )
    lines = [title, head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['strategy']:<16} {r['step_ms']:>8.1f} {r['tokens_per_s']:>9.3g} {r['speed_vs_bf16_mixed']:>12.2f} "
            f"{r['bound']:>6.6} {r['kernels']:>7} {r['gigabytes']:>8.0f} {r['model_state_gib']:>9.1f} "
            f"{r['peak_gib']:>8.1f} {r['memory_vs_bf16_mixed']:>6.2f} {r['sent_gb']:>7.1f}"
            + ("" if r["fits"] else "  does not fit")
            + ("  refused: no FP8 layer" if r["refused"] else "")
        )
    lines.append("")
    for r in rows:
        kept = f"; kept in BF16: {', '.join(r['kept_in_bf16'])}" if r["kept_in_bf16"] else ""
        refused = f"; the run would be refused before its first step: {r['refused']}" if r["refused"] else ""
        lines.append(f"{r['strategy']}: limited by {r['limit']}{kept}{refused}")
    return "\n".join(lines)


def scaling_lines(rows: list[dict[str, Any]], gpu: GPU, engine: str) -> list[str]:
    """Each strategy's step at `SCALES` GPUs under `engine`, and from how many GPUs
    communication, not compute, sets its pace."""
    counts = ", ".join(str(n) for n in SCALES)
    lines = [
        f"Past one machine ({engine}, the same batch per GPU; {gpu.link / 1e9:.0f} GB/s per GPU within a node "
        f"of {GPUS_PER_NODE}, {gpu.network / 1e9:.0f} GB/s between nodes): step ms at {counts} GPUs"
    ]
    for r in rows:
        if r["refused_past_one_gpu"]:
            lines.append(f"{r['strategy']:<16} not under {engine}: {r['refused_past_one_gpu']}")
            continue
        steps = "  ".join(f"{r['step_ms_at_gpus'][n]:>9.1f}" for n in SCALES)
        start = r["communication_bound_from"]
        pace = (
            f"communication sets the pace from {start} GPUs" if start else f"compute sets the pace up to {_POWERS[-1]}"
        )
        lines.append(f"{r['strategy']:<16} {steps}  {pace}")
    return lines


def calibration_lines() -> list[str]:
    """How far the roofline is from each step measured on a GPU (`gpus.MEASURED`)."""
    from .gpus import GPUS

    lines = []
    for row in MEASURED:
        predicted = predict_measured(row, GPUS[row.gpu]) * 1e3
        lines.append(
            f"{row.section} {row.row} on {row.gpu} ({row.date}, tree {row.tree}): measured {row.step_ms:.1f} ms, "
            f"model {predicted:.1f} ms ({predicted / row.step_ms - 1:+.0%})"
        )
    return lines
