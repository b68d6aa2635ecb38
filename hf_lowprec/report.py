"""What is actually active: the startup report, the promise check and the silent-precision guard.

Low-precision training fails most often through precision nobody asked for and nobody sees: FP8
that silently fell back to BF16, BF16 weights stepped by a plain AdamW that drops updates below
half an ulp, FP32 parameters left under a pure-BF16 strategy. `describe` reads the model and
optimizer as they are (not as the strategy says), `format_report` prints a compact table, and
`promise_violations` lists where the two disagree (bytes per parameter: `memory`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

from . import hardware, report_rows
from .checkpoints.fp8_published import PUBLISHED_ATTR
from .memory import (
    ADOPTED_ATTR,
    DEFAULT_STATE_ROLES,
    describe_dtypes,
    elements_by_dtype,
    kept_in_fp32,
    plan_model_state,
    state_dtypes,
    trainable_parameters,
    unwrap_optimizer,
    zero_per_rank,
)

__all__ = [
    "SilentPrecisionWarning",
    "PrecisionPromiseError",
    "ReportedStrategy",
    "check_promises",
    "describe",
    "format_report",
    "plan_model_state",
    "promise_violations",
    "silent_precision_problem",
    "slow_fp16_warning",
    "stepped_dtype_error",
    "warn_slow_fp16_once",
    "zero_per_rank",
]

logger = logging.getLogger(__name__)

# Strategies that fix the silent loss of BF16/FP16 updates under a plain AdamW.
FIXING_STRATEGIES = ("collage-plus", "bf16-kahan", "bf16-sr", "bf16-mixed")
# What to use instead of FP16 where FP16 GEMMs are slow: the FP32-master and the 12-byte BF16 answers.
BF16_INSTEAD_OF_FP16 = ("bf16-mixed", "collage-plus")
_SLOW_FP16_WARNED: set[str] = set()  # strategy names already warned about in this process


class ReportedStrategy(Protocol):
    """What the report reads of a strategy (`strategies.interface.PrecisionStrategy` has it): named
    here, so that the report imports no strategy, not even for type checkers, and they may call it."""

    @property
    def name(self) -> str: ...
    @property
    def options(self) -> Any: ...  # a dataclass
    @property
    def param_dtype(self) -> torch.dtype: ...
    @property
    def compute_dtype(self) -> torch.dtype: ...
    @property
    def bytes_per_param(self) -> float: ...
    @property
    def uses_fp8_gemm(self) -> bool: ...
    @property
    def frozen_in_fp8(self) -> bool: ...  # its forward's GEMMs are FP8 ones (COAT's with its activations)
    def promised_param_dtypes(self) -> tuple[torch.dtype, ...]: ...
    def ddp_comm_hook(self) -> tuple[Any, Callable] | None: ...
    def forward_context(self) -> Any: ...  # its autocast, if any: what a module's operation computes in


class SilentPrecisionWarning(UserWarning):
    """Low-precision trainable parameters stepped by a plain AdamW: small updates vanish."""


class PrecisionPromiseError(RuntimeError):
    """What is active differs from what the precision strategy promises."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _master_weights(strategy: ReportedStrategy, inner: Any, params: list[torch.Tensor]) -> str:
    roles = {**DEFAULT_STATE_ROLES, **(getattr(inner, "state_roles", {}) or {})}
    sample = next((p for p in params if inner.state.get(p)), None)
    state = inner.state.get(sample) if sample is not None else None
    if state is None and sample is None and params and hasattr(inner, "plan_state"):
        # Under DeepSpeed the groups hold its flat partitions, not the model's parameters.
        group = next((g for g in inner.param_groups if any(q is params[0] for q in g["params"])), None)
        if group is not None:
            sample, state = params[0], inner.plan_state(params[0], group)
    dtypes = sorted({_dtype_name(p.dtype) for p in params})
    composition = getattr(inner, "composition", None)
    if composition is not None and sample is not None and hasattr(inner, "_options_of"):
        # An hf_lowprec AdamW says what completes the parameter: its update rule's state.
        rule = composition(sample, inner._options_of(sample)).rule
        if rule.master_key is not None:
            return f"separate master {rule.master_key} (fp32); the {'/'.join(dtypes)} parameters are its copy"
        if rule.compensation_key is not None:
            return f"parameter + compensation {rule.compensation_key} ({'/'.join(dtypes)}), value held = their sum"
        return f"the parameters themselves ({'/'.join(dtypes)})"
    if state:
        # A parameter-shaped extra state in the parameter's dtype is a compensation component
        # (the value held is their sum); in another dtype it is a separate master copy.
        shaped = {
            k: v
            for k, v in state.items()
            if torch.is_tensor(v) and roles.get(k, "extra") in ("extra", "master") and v.shape == sample.shape
        }
        masters = [f"{k} ({_dtype_name(v.dtype)})" for k, v in shaped.items() if v.dtype != sample.dtype]
        components = [k for k, v in shaped.items() if v.dtype == sample.dtype]
        if masters:
            return f"separate master {', '.join(masters)}; the {'/'.join(dtypes)} parameters are its copy"
        if components:
            return f"parameter + compensation {', '.join(components)} ({'/'.join(dtypes)}), value held = their sum"
    return f"the parameters themselves ({'/'.join(dtypes)})"


def describe(
    strategy: ReportedStrategy,
    model: torch.nn.Module,
    optimizer: Any | None = None,
    *,
    deepspeed_stage: int | None = None,
    ddp: bool = False,
) -> dict[str, Any]:
    """What is active for `strategy` on `model` and `optimizer`, read from the live objects.

    Args:
        deepspeed_stage: the ZeRO stage when DeepSpeed runs the model.
        ddp: whether the model is wrapped in DistributedDataParallel (the strategy's
            communication hook applies).

    Returns:
        a JSON-serialisable dict: strategy and options, per module type its parameter and
        compute dtypes, FP8 layers converted and skipped (with reasons), optimizer state dtypes
        and roles, master weights, gradient dtype and communication, model-state bytes/param
        and GiB, and the list of promise violations (empty when all is as promised).
    """
    from .fp8 import FP8Linear

    params = trainable_parameters(model)
    module_rows = report_rows.module_rows(strategy, model)

    from .fp8.convert import fp8_layer_configs
    from .fp8.experts import FP8Experts, weight_gemm_share

    fp8_layers = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    fp8_experts = [n for n, m in model.named_modules() if isinstance(m, FP8Experts)]
    skipped = dict(model.__dict__.get("fp8_skipped_layers", {}))
    share = weight_gemm_share(model)

    report: dict[str, Any] = {
        "strategy": strategy.name,
        "options": dataclasses.asdict(strategy.options),
        "promised": {
            "param_dtype": _dtype_name(strategy.param_dtype),
            "compute_dtype": _dtype_name(strategy.compute_dtype),
            "bytes_per_param": float(strategy.bytes_per_param),
        },
        "modules": module_rows,
        "fp8": {
            "converted": len(fp8_layers),
            "converted_layers": fp8_layers,
            # What the layers hold, not the options: layers converted before the strategy keep their own.
            "configs": fp8_layer_configs(model),
            "experts": fp8_experts,
            "skipped": skipped,
            "rule": model.__dict__.get(
                "fp8_rule", ""
            ),  # where FP8 pays (`fp8.payoff`), or why every layer is converted
            # Per token, LM head and routers left out (`fp8.experts.weight_gemm_share`).
            "weight_gemm_share": round(share["share"], 4),
            "experts_gemm_share": round(share["experts_share"], 4),
        },
        "adopted": dict(model.__dict__.get(ADOPTED_ATTR, {})),
        "fp8_checkpoint": dict(collections.Counter(model.__dict__.get(PUBLISHED_ATTR, {}).get("layers", {}).values())),
        # Elements per dtype, the dtype holding most first (as a recipe's result counts them).
        "trainable_param_dtypes": {_dtype_name(d): n for d, n in elements_by_dtype(params).items()},
    }
    if optimizer is not None:
        inner = unwrap_optimizer(optimizer)
        roles = {**DEFAULT_STATE_ROLES, **(getattr(inner, "state_roles", {}) or {})}
        owned = {id(p) for p in params}
        holds = any(id(p) in owned for g in inner.param_groups for p in g["params"])
        # Over every parameter (O2: E4M3 moments on its FP8 weights), or DeepSpeed's partitions
        # where they replaced the model's parameters in the groups; "dtype": most elements'.
        counted = params if holds else [p for g in inner.param_groups for p in g["params"]]
        report["optimizer"] = {
            "class": type(inner).__name__,
            "states": {
                k: {"dtype": max(counts, key=counts.get), "dtypes": counts, "role": roles.get(k, "extra")}
                for k, counts in state_dtypes(inner, counted).items()
            },
        }
        report["master_weights"] = _master_weights(strategy, inner, params)
        unread = getattr(strategy.options, "unread_options", dict)()
        if report["options"].get("seed", 0) is None and "seed" not in unread and hasattr(inner, "seed"):
            report["options"]["seed"] = inner.seed  # the stochastic-rounding seed drawn from the run's
        if holds:
            plan = plan_model_state(model, optimizer)
            report["memory"] = {
                **{k: round(v, 4) for k, v in plan.items() if k != "num_params"},
                "num_params": int(plan["num_params"]),
                "gib": round(plan["total"] * plan["num_params"] / 2**30, 4),
            }
        else:  # DeepSpeed: the optimizer steps flat partitions, whose bytes are per rank
            report["memory"] = {
                "note": "the optimizer steps DeepSpeed's partitions; per-rank bytes: "
                "hf_lowprec.partition.partition_report"
            }
        gradients = report_rows.gradient_facts(strategy, inner, params) if holds else None
    else:
        gradients = None
    hook = strategy.ddp_comm_hook()
    if deepspeed_stage is not None:
        comm = f"DeepSpeed ZeRO stage {deepspeed_stage}"
    elif hook is not None:
        comm = f"{getattr(hook[1], '__name__', 'custom')} (DDP communication hook)" + (
            "" if ddp else ", when under DDP"
        )
    else:
        comm = "DDP all-reduce in the gradient dtype" if ddp else "none (single process)"
    # Without the optimizer (or with DeepSpeed's partitions in it): `p.grad`, in the parameters' dtypes.
    report["gradients"] = {
        **(gradients or {"dtype": sorted({_dtype_name(p.dtype) for p in params})}),
        "communication": comm,
    }
    report["violations"] = promise_violations(strategy, model)
    return report


def promise_violations(strategy: ReportedStrategy, model: torch.nn.Module) -> list[str]:
    """Where the prepared `model` breaks what `strategy` promises (empty list: all kept)."""
    from .fp8.refusal import no_fp8_layer

    out: list[str] = []
    promised = set(strategy.promised_param_dtypes())
    wrong = collections.Counter()
    examples: dict[torch.dtype, str] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype not in promised and not kept_in_fp32(p):
            wrong[p.dtype] += p.numel()
            examples.setdefault(p.dtype, name)
    for dtype, count in wrong.items():
        out.append(
            f"{count:,} trainable parameter elements are {_dtype_name(dtype)} (e.g. {examples[dtype]}), "
            f"but {strategy.name!r} promises {', '.join(sorted(_dtype_name(d) for d in promised))}"
        )
    # A published FP8 layer kept frozen in FP8 (fp8.blocks) counts: the base of a LoRA run.
    refusal = no_fp8_layer(
        model, strategy.name, uses_fp8_gemm=strategy.uses_fp8_gemm, frozen_in_fp8=strategy.frozen_in_fp8
    )
    out += [refusal] if refusal else []
    return out


def check_promises(strategy: ReportedStrategy, model: torch.nn.Module, dtypes_only: bool = False) -> None:
    """Raise PrecisionPromiseError naming every broken promise (before training starts); `dtypes_only`: those of the parameters' dtypes."""
    problems = [
        p for p in promise_violations(strategy, model) if not dtypes_only or "trainable parameter elements" in p
    ]
    if problems:
        dtypes = any("trainable parameter elements" in p for p in problems)  # the advice is about dtypes
        raise PrecisionPromiseError(
            f"precision strategy {strategy.name!r} is not what is active; training stopped before the first step:\n  - "
            + "\n  - ".join(problems)
            + (
                "\nprepare_model (run by hf_lowprec.Trainer and the Accelerate plugin) adopts FP32, BF16 and FP16 "
                "parameters as loaded: these were cast after it (e.g. model.half() after prepare_model: remove it), "
                "or are a dtype no strategy trains (float64, float8: load the model in FP32, BF16 or FP16)."
                if dtypes
                else ""
            )
        )


def stepped_dtype_error(
    strategy: ReportedStrategy, changed: list[tuple[torch.Tensor, torch.dtype]]
) -> PrecisionPromiseError:
    """The PrecisionPromiseError for parameters whose dtype changed since the optimizer stepped them
    (`changed`: (parameter, dtype it was stepped in)): what `check_promises` says before the first step."""
    counts: dict[tuple[torch.dtype, torch.dtype], int] = collections.Counter()
    for param, before in changed:
        counts[(before, param.dtype)] += param.numel()
    problems = [
        f"{count:,} trainable parameter elements are {_dtype_name(now)}, but {strategy.name!r} stepped them in "
        f"{_dtype_name(before)} (promising {', '.join(sorted(_dtype_name(d) for d in strategy.promised_param_dtypes()))})"
        for (before, now), count in counts.items()
    ]
    return PrecisionPromiseError(
        f"precision strategy {strategy.name!r} is not what is active; training stopped before this step "
        "(nothing was updated):\n  - "
        + "\n  - ".join(problems)
        + "\nThe strategy's optimizer steps each parameter in the dtype prepare_model gave it: these were cast "
        "since (e.g. model.half() or model.to(torch.bfloat16) between steps, or in a callback): remove the cast."
    )


def silent_precision_problem(model: torch.nn.Module, optimizer: Any) -> str | None:
    """The warning text when BF16/FP16 trainable parameters meet a plain torch Adam/AdamW, else None."""
    inner = unwrap_optimizer(optimizer)
    if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
        return None
    low: collections.Counter = collections.Counter()
    for p in trainable_parameters(model):
        if p.dtype in (torch.bfloat16, torch.float16):
            low[p.dtype] += p.numel()
    if not low:
        return None
    dtype, count = low.most_common(1)[0]
    return (
        f"{count:,} trainable parameter elements are {_dtype_name(dtype)} and are stepped by a plain "
        f"{type(inner).__name__}: every update below half an ulp of its weight is rounded away "
        f"(in BF16, an update 256x smaller than its weight is lost). Set precision_strategy to one of "
        f"{', '.join(repr(s) for s in FIXING_STRATEGIES)} (bf16-mixed keeps FP32 weights)."
    )


def slow_fp16_warning(strategy: ReportedStrategy, model: torch.nn.Module) -> str | None:
    """The warning text when `strategy` computes in FP16 on a CPU whose FP16 GEMMs are slow, else None.

    Slow means `hardware.fp16_gemm_slowdown` (a timed FP16 vs BF16 matmul, once per process)
    is at least `hardware.SLOW_FP16_RATIO`; the probe runs only for FP16-compute strategies.
    """
    if strategy.compute_dtype != torch.float16:
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cpu":
        return None
    ratio = hardware.fp16_gemm_slowdown(device.type)
    if ratio < hardware.SLOW_FP16_RATIO:
        return None
    if math.isinf(ratio):
        speed = "cannot run FP16 matmuls at all"
    else:
        speed = f"runs FP16 matmuls ~{ratio:.0f}x slower than BF16"
    return (
        f"precision strategy {strategy.name!r} computes in FP16, and this CPU {speed} (no native FP16 "
        f"arithmetic; measured by a timed matmul): training will be that much slower. The BF16 strategies "
        f"train at full speed here: {', '.join(repr(s) for s in BF16_INSTEAD_OF_FP16)} (FP32 masters, "
        f"16 bytes/param; BF16 weights that keep small updates, 12 bytes/param)."
    )


def warn_slow_fp16_once(strategy: ReportedStrategy, model: torch.nn.Module) -> str | None:
    """Log `slow_fp16_warning` as a warning, once per strategy name and process; the text or None."""
    if strategy.name in _SLOW_FP16_WARNED:
        return None
    text = slow_fp16_warning(strategy, model)
    if text is not None:
        _SLOW_FP16_WARNED.add(strategy.name)
        logger.warning("%s", text)
    return text


def _fmt_bytes(value: float) -> str:
    return f"{value:.2f}" if not math.isnan(value) else "-"


def format_report(report: dict[str, Any]) -> str:
    """A compact multi-line table of `describe`'s result for the logs."""
    lines = [f"hf_lowprec: precision strategy {report['strategy']!r}"]
    options = dict(report["options"].items())
    lines.append(f"  options: {options}")
    width = max((len(r["type"]) for r in report["modules"]), default=6)
    lines.append(f"  {'module':<{width}}  {'n':>4}  {'params':<16} compute")
    for row in report["modules"]:
        tied = row.get("tied", [])
        lines.append(
            f"  {row['type']:<{width}}  {row['count']:>4}  {'/'.join(row['param_dtypes']):<16} "
            f"{', '.join(row['compute'])}"
            + (f"; tied: {', '.join(tied[:2])}{f' and {len(tied) - 2} more' if len(tied) > 2 else ''}" if tied else "")
        )
    fp8 = report["fp8"]
    if fp8["converted"] or fp8["skipped"]:
        configs = "; ".join(f"{n} with {c}" for c, n in fp8.get("configs", {}).items())
        held = f" ({configs})" if configs else ""
        lines.append(f"  FP8 layers: {fp8['converted']} converted{held}, {len(fp8['skipped'])} kept high precision")
        if fp8.get("rule"):
            lines.append(f"    rule: {fp8['rule']}")
        for name, reason in fp8["skipped"].items():
            lines.append(f"    kept {name}: {reason}")
    if fp8.get("experts"):
        lines.append(
            f"  MoE: {len(fp8.get('experts', []))} experts modules with FP8 grouped GEMMs; experts are "
            f"{fp8['experts_gemm_share']:.0%} of the weight GEMMs; routers kept in high precision"
        )
    if fp8["converted"] or fp8.get("experts"):
        lines.append(
            f"  FP8 share of weight-GEMM multiply-adds per token (LM head and routers left out): "
            f"{fp8['weight_gemm_share']:.1%}"
        )
    for dtype, n in report.get("adopted", {}).items():  # +2 bytes per element over the 16-bit load
        lines.append(f"  parameters loaded as {dtype}: FP32 made of {n} elements (exact), +{2 * n / 1e6:.1f} MB")
    published = report.get("fp8_checkpoint", {})
    if published:
        kinds = ", ".join(f"{n} {kind}" for kind, n in published.items())
        lines.append(f"  FP8 checkpoint: {sum(published.values())} layers from their stored values: {kinds}")
    if "optimizer" in report:
        states = ", ".join(
            f"{k} {describe_dtypes(v['dtypes'])} ({v['role']})" for k, v in report["optimizer"]["states"].items()
        )
        lines.append(f"  optimizer: {report['optimizer']['class']}: {states}")
        lines.append(f"  master weights: {report['master_weights']}")
    grads = report["gradients"]
    lines.append(f"  gradients: {report_rows.gradient_text(grads)}; communication: {grads['communication']}")
    if "note" in report.get("memory", {}):
        lines.append(f"  model state: {report['memory']['note']}")
    elif "memory" in report:
        m = report["memory"]
        lines.append(
            f"  model state: {_fmt_bytes(m['total'])} bytes/param (params {_fmt_bytes(m['params'])}, grads "
            f"{_fmt_bytes(m['grads'])}, optimizer {_fmt_bytes(m['optimizer_states'])}, extra "
            f"{_fmt_bytes(m['extra'])}) = {m['gib']:.3f} GiB for {m['num_params']:,} parameters"
        )
    for role, facts in report.get("frozen_models", {}).items():
        lines.append(
            f"  frozen {role} model: {_fmt_bytes(facts['blocks_bytes_per_param'])} bytes/param in its decoder "
            f"blocks ({facts['storage']}), {facts['bytes'] / 1e6:.1f} MB in all"
        )
    for problem in report["violations"]:
        lines.append(f"  BROKEN PROMISE: {problem}")
    return "\n".join(lines)
