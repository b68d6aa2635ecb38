"""FP8-LM / MS-AMP optimization levels O1 and O2 (FP8-LM §2; docs/strategies/fp8-lm.md).

O1: FP8 GEMMs, FP8 gradients with automatic scaling μ, FP8 all-reduce, FP32 AdamW. O2 adds
`hf_lowprec.optim.FP8AdamW` (E4M3 m, FP16 v, scaled FP16 masters) on the FP8 GEMM weights. The
pieces live in `hf_lowprec.fp8` and `hf_lowprec.optim`; this class only combines them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable
from typing import Any, Literal

import torch

from ..compiling import takes_gpu_path
from ..distributed import DTensor, any_rank, local_shard
from ..fp8 import (
    AllReduceStats,
    FP8CommState,
    FP8Linear,
    GradientAutoScaler,
    convert_to_fp8,
    fp8_allreduce_hook,
    quantize_gradient,
)
from ..fp8.cast import unscale_into
from ..fp8.experts import FP8Experts
from ..fp8.fused import gradient_roundtrip_, gradients_roundtrip_
from ..fp8.gradients import BackwardFP8Gradients, requantize_gradient
from ..fp8.linear import share_inputs_within
from ..fp8.scaled import FORMATS, get_master_scale
from ..fp8.scaling_recipes import SCALING_RECIPES, FP8LinearConfig, fp8_config
from ..optim import FP8AdamW, PlainAdamW
from .adopt import adopted_parameters, exact_embedding_scales
from .baselines import bf16_autocast
from .casting import fp32_module_patterns
from .fp8_rule import RULE_OPTIONS, FP8RuleOptions, converted_layout
from .interface import PrecisionStrategy
from .registry import register
from .support import EngineSupport

__all__ = ["FP8LM", "FP8LMOptions"]

F32 = torch.float32
_FP8_GRAD_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
logger = logging.getLogger(__name__)
# The `recipe` option's values: the names of the one recipes table.
ScalingRecipeName = Literal[tuple(SCALING_RECIPES)]  # type: ignore[valid-type]
# Why a finer recipe's weights gather with one scale per tensor: a shard cannot choose per-channel
# or per-block scales alone (GPT-2's Conv1D shards split every output channel; 128×128 blocks
# straddle shard edges), and agreeing them would take an all-reduce of one amax per channel or
# block per step; the tensorwise scale is agreed in the one all-reduce FP8-LM already makes.
_FSDP2_RECIPE_NOTE = (
    "recipe {recipe}: the weights all-gather as tensorwise E4M3 (one scale per weight, agreed over the "
    "ranks) and the layers use that FP8 weight; activations and gradients keep {recipe}'s scales"
)


@dataclasses.dataclass(frozen=True)
class FP8LMOptions(FP8RuleOptions):
    """Options of the FP8-LM strategies.

    Args:
        level: "O1" (FP8 GEMMs, gradients, communication) or "O2" (+ FP8 optimizer); fixed
            by the registered name.
        margin: scale margin in binades for every FP8 cast (MS-AMP default 0).
        grad_format: FP8 format of stored and communicated weight gradients.
        auto_scale_interval: clean steps before μ doubles (paper: 1000).
        auto_scale_threshold: saturated share above which μ halves (paper: 1e-5 = 0.001 %).
        exp_avg_sq_format: O2 second-moment storage; "e4m3" reproduces the FP8-LM Fig. 8 #4 ablation.
        recipe: FP8 scaling recipe of the GEMM operands (`hf_lowprec.fp8.scaling_recipes`): "tensorwise" (FP8-LM's,
            one scale per tensor), "rowwise" (per row / output channel), "blockwise" (1×128
            activations, 128×128 weights) or "mxfp8" (1×32 blocks, E8M0 scales).
        min_gemm_features: layers whose two dimensions are both below this stay in high
            precision (GEMMs too small to gain from FP8); 0 converts every eligible layer.

    With `fp8_layers`, `fp8_gpu` and `fp8_tokens`: which layers FP8 pays for (`FP8RuleOptions`).
    """

    level: Literal["O1", "O2"] = "O2"
    margin: int = 0
    grad_format: Literal["e4m3", "e5m2"] = "e4m3"
    auto_scale_interval: int = 1000
    auto_scale_threshold: float = 1e-5
    exp_avg_sq_format: Literal["fp16", "fp32", "bf16", "e4m3", "e5m2"] = "fp16"
    recipe: ScalingRecipeName = "tensorwise"
    min_gemm_features: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.level not in ("O1", "O2"):
            raise ValueError(f"level must be 'O1' or 'O2', got {self.level!r}")
        for name in ("margin", "auto_scale_interval", "min_gemm_features"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 0 <= self.margin <= 8:
            raise ValueError(f"margin must lie in [0, 8] binades, got {self.margin}")
        if self.min_gemm_features < 0:
            raise ValueError(f"min_gemm_features must be >= 0, got {self.min_gemm_features}")
        if self.auto_scale_interval < 1:
            raise ValueError(f"auto_scale_interval must be >= 1, got {self.auto_scale_interval}")
        if not 0.0 <= self.auto_scale_threshold < 1.0:
            raise ValueError(f"auto_scale_threshold must lie in [0, 1), got {self.auto_scale_threshold}")
        if self.grad_format not in _FP8_GRAD_FORMATS:
            raise ValueError(f"grad_format must be one of {sorted(_FP8_GRAD_FORMATS)}, got {self.grad_format!r}")
        if self.exp_avg_sq_format not in FORMATS:
            raise ValueError(f"exp_avg_sq_format must be one of {sorted(FORMATS)}, got {self.exp_avg_sq_format!r}")

    def unread_options(self) -> dict[str, str]:
        why = "exp_avg_sq_format applies to the O2 FP8 optimizer; O1 keeps FP32 states: drop exp_avg_sq_format"
        return super().unread_options() | ({"exp_avg_sq_format": why} if self.level == "O1" else {})


@register(
    "fp8-lm-o2",
    level="O2",
    summary="O1 + FP8 optimizer on FP8 GEMM weights (E4M3 m, FP16 v, scaled FP16 masters, FP8 gradients from backward on); FP32 masters and states elsewhere (6 bytes/param on FP8 GEMM weights, 7 on a GPU with the E4M3 weight its step writes, 16 elsewhere)",
)
@register(
    "fp8-lm-o1",
    level="O1",
    summary="FP8-LM O1: FP8 GEMMs (E4M3 forward, E5M2 output gradients), FP8 gradients with automatic scaling μ, FP8 all-reduce (DDP hook), FP32 AdamW",
)
class FP8LM(PrecisionStrategy):
    """FP8 linear layers, FP8 gradients with automatic scaling μ, FP8 all-reduce; O2 adds FP8AdamW."""

    Options = FP8LMOptions
    uses_fp8_gemm = True
    resume_safe_options = PrecisionStrategy.resume_safe_options | RULE_OPTIONS
    support = EngineSupport(
        zero_refusal=(
            "ZeRO reduces the gradients itself, in FP32 flat buckets, so the FP8 all-reduce with one shared "
            "scale per tensor would not run, and it would cut O2's scaled FP16 masters (one scale per "
            "tensor) into flat partitions; use fp8-lm-o3 with ZeRO stage 1 or 2 (FP8-LM's own ZeRO), or DDP"
        ),
        ddp_note="FP8 all-reduce with one shared power-of-two scale per tensor (the strategy's DDP communication hook)",
        fsdp2=True,
        fsdp2_note=(
            "FP8 all-gather of the FP8 GEMM weights (E4M3 payload + the whole weight's scale, agreed in one "
            "all-reduce of amaxes per step), BF16 all-gather elsewhere; FP32 reduce-scatter, then FP8 gradients "
            "with the global amax"
        ),
        fsdp2_gathers_fp8=True,
    )

    # The backward hooks on the FP8 weights hold the gradient scaler the comm state shares.
    prepared_state = ("fp8_layout", "_param_split", "scaler", "comm_state", "backward_grads")

    def __init__(self, name: str | None = None, **options: Any) -> None:
        super().__init__(name, **options)
        self._param_split = (0, 0)  # (FP8 GEMM weights, other trainable parameters) of the O2 model
        self.scaler = GradientAutoScaler(
            interval=self.options.auto_scale_interval, threshold=self.options.auto_scale_threshold
        )
        self.comm_state = FP8CommState(self.scaler, self.grad_dtype, self.options.margin)
        self._allreduced = False  # the FP8 all-reduce ran: its counts are logged, 0 in an interval without one
        self.backward_grads = BackwardFP8Gradients(self.scaler, self.grad_dtype, self.options.margin)

    def engine_support(self) -> EngineSupport:
        """The FSDP2 note says what O2's shards hold and how a finer recipe gathers."""
        support = self.support
        if not support.fsdp2:
            return support
        note = support.fsdp2_note
        if self.o2:
            note += (
                "; scaled FP16 masters, FP8AdamW moments and FP8 gradients sharded like the weights, each shard "
                "with its own power-of-two scales"
            )
        if not self.fp8_layer_config.recipe.whole_tensor:
            note += f"; {_FSDP2_RECIPE_NOTE.format(recipe=self.options.recipe)}"
        return dataclasses.replace(support, fsdp2_note=note)

    def fsdp2_mixed_precision(self) -> Any:
        """BF16 all-gather of what FP8 skips (as bf16-mixed; the FP8 weights gather as E4M3,
        `hf_lowprec.fp8.sharded_weight`), gradients reduced in FP32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def before_sharding(self, model: torch.nn.Module) -> None:
        """Before `fully_shard`: FP8 weights all-gather as E4M3 (`hf_lowprec.fp8.sharded_weight.wrap_fp8_weights`)."""
        from ..fp8.sharded_weight import wrap_fp8_weights

        if not self.fp8_layer_config.recipe.whole_tensor:
            logger.warning("FSDP2 FP8 all-gather: %s", _FSDP2_RECIPE_NOTE.format(recipe=self.options.recipe))
        self.weight_scales = wrap_fp8_weights(model, FP8Linear)

    def after_sharding(self, model: torch.nn.Module) -> None:
        """The FP8 weights' scales are agreed over the mesh's ranks; a load makes them stale.

        O2: each sharded FP8 weight keeps its layer's master scale (the optimizer reads it from
        the parameter, `get_master_scale`), now the scale of this rank's shard: FP8AdamW chooses
        it afresh from the shard's amax at every step, as it chooses the moments' scales.
        """
        from ..fp8.sharded_weight import collect_shards, link_master_scales

        link_master_scales(model, FP8Linear)
        scales = getattr(self, "weight_scales", None)
        if scales is None:
            return
        collect_shards(model, scales)
        if scales.shards:
            scales.group = next(p for p in model.parameters() if hasattr(p, "device_mesh")).device_mesh.get_group()
        model.register_load_state_dict_post_hook(lambda *_: scales.mark_stale())

    @property
    def o2(self) -> bool:
        return self.options.level == "O2"

    @property
    def param_dtype(self) -> torch.dtype:  # type: ignore[override]
        # O2's FP8 GEMM weights are scaled FP16 masters; every other parameter stays FP32.
        return torch.float32

    @property
    def compute_dtype(self) -> torch.dtype:  # type: ignore[override]
        # Linear GEMMs run in FP8 inside FP8Linear; everything else under BF16 autocast, as in
        # bf16-mixed (the LM head, attention matmuls; norms and the loss stay FP32 by autocast's rules).
        return torch.bfloat16

    def promised_param_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.float16) if self.o2 else (torch.float32,)

    @property
    def bytes_per_param(self) -> float:  # type: ignore[override]
        """O1: 16. O2: 6 on FP8 GEMM weights, 16 on the rest, averaged over the prepared model.
        Before a model is prepared, O2 reports 6 (the FP8 GEMM weights' figure, which large models
        approach); the tiny GPT-2 (vocabulary 1024) measures 10.3, GPT-2 124M 9.2 (embeddings)."""
        if not self.o2:
            return 16.0
        fp8, other = self._param_split
        total = fp8 + other
        return (6.0 * fp8 + 16.0 * other) / total if total else 6.0

    @property
    def grad_dtype(self) -> torch.dtype:
        return _FP8_GRAD_FORMATS[self.options.grad_format]

    def gradient_format(self, param: torch.Tensor) -> torch.dtype | None:
        """The FP8 format `param`'s gradient is quantized to each step (the startup report reads it):
        every gradient under O1 (written back into its FP32 `p.grad`), an FP8 GEMM weight's under O2."""
        return self.grad_dtype if not self.o2 or get_master_scale(param) is not None else None

    @property
    def fp8_layer_config(self) -> FP8LinearConfig:
        """The FP8 layers' configuration, from the options (one object for every layer)."""
        return fp8_config(self.options.recipe, self.options.margin)

    def convert_model(self, model: torch.nn.Module) -> torch.nn.Module:
        options = self.options
        rule = options.layer_rule(model)
        convert_to_fp8(model, config=self.fp8_layer_config, min_gemm_features=options.min_gemm_features, rule=rule)
        share_inputs_within(model)  # q/k/v and gate/up quantize their shared input once
        self.fp8_layout = converted_layout(self, model)
        if self.o2:
            # FP8-LM / MS-AMP: only trainable FP8 GEMM weights get the FP16 scaled master and the
            # FP8 optimizer; the other trainable parameters FP32 masters (an unscaled FP16 LayerNorm
            # gain at 1.0 could not take a 1e-4 update); frozen ones FP32 too, but a PEFT base's
            # or a fully frozen model's (`adopted_parameters`).
            widened = [p for p in adopted_parameters(model, autocast=True) if p.dtype != F32]
            for p in widened:
                p.data = p.data.float()
            if widened:  # an FP16 load (O2 promises FP16 too: adopt_loaded_dtypes left it)
                exact_embedding_scales(model)
            fp32_masters = _fp32_masters(model)
            for name, module in model.named_modules():
                if isinstance(module, FP8Linear) and module.weight.requires_grad:
                    if id(module.weight) in fp32_masters:
                        why = fp32_masters[id(module.weight)]
                        logger.warning("fp8-lm-o2: %s keeps an FP32 master, not a scaled FP16 one: %s", name, why)
                        continue
                    module.scale_master_weight(self.options.margin)
                elif isinstance(module, FP8Experts):  # the experts' 3-D weights: one master scale each
                    module.scale_master_weights(self.options.margin)
            fp8 = {id(p): p.numel() for p in model.parameters() if get_master_scale(p) is not None}
            self.backward_grads.attach(p for p in model.parameters() if id(p) in fp8)
            other = {id(p): p.numel() for p in model.parameters() if p.requires_grad and id(p) not in fp8}
            self._param_split = (sum(fp8.values()), sum(other.values()))
        return model

    def build_optimizer(self, param_groups: list[dict[str, Any]], **hyper: Any) -> torch.optim.Optimizer:
        if not self.o2:
            return PlainAdamW(param_groups, **hyper, fused=self.options.fused)
        # One group per user group (LR schedulers index them); the FP8 GEMM weights take E4M3 m,
        # FP16 v and their scaled FP16 masters, the rest FP32 masters and moments (`unscaled_format`).
        optimizer = FP8AdamW(
            param_groups,
            **hyper,
            exp_avg_sq_format=self.options.exp_avg_sq_format,
            margin=self.options.margin,
            unscaled_format="fp32",
            fused=self.options.fused,
        )
        self.backward_grads.owner = optimizer
        return optimizer

    def forward_context(self) -> contextlib.AbstractContextManager:
        # Both levels run everything outside the FP8 layers under BF16 autocast, as bf16-mixed
        # does; the FP8 layers keep their own numerics under it (only their output is rounded to BF16).
        return bf16_autocast()

    def clip_own_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> Any:
        """O2 clips the FP8 gradients kept by FP8AdamW with the FP32 ones (custom loops call
        `clip_grad_norm`, not `torch.nn.utils.clip_grad_norm_`, which sees only `p.grad`)."""
        return self.backward_grads.clip_grad_norm(parameters, max_norm, norm_type) if self.o2 else None

    def clip_own_grad_value(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        if self.o2:  # the FP8 gradients FP8AdamW keeps; the loop clamped p.grad
            self.backward_grads.clip_grad_value(parameters, clip_value)

    def ddp_comm_hook(self) -> tuple[FP8CommState, Any]:
        """(state, hook) for `ddp_model.register_comm_hook(*strategy.ddp_comm_hook())`."""
        if self.o2:  # the FP8 weights send prescaled gradients and take the reduced FP8 ones (`FP8CommState`)
            self.backward_grads.transport = self.comm_state.prescale
            self.comm_state.store = self.backward_grads.store_reduced
        return self.comm_state, fp8_allreduce_hook

    def process_gradients(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Store gradients as FP8 (scale μ·2^k, or from the all-reduce's N·μ·s_g), then update μ;
        returns the step's skip flag (a 0-dim device tensor, 1.0 for inf/NaN), no host sync.

        O1 writes the FP8 values of every gradient back into its FP32 `p.grad`. O2 has handed each
        FP8 GEMM weight's gradient to FP8AdamW in backward (`BackwardFP8Gradients`; under DDP the
        FP8 all-reduce did) and frees its `p.grad`; the others keep FP32 gradients and masters. A
        gradient that came out of the FP8 all-reduce otherwise is re-encoded from its current values
        (`requantize_gradient`): clipping may have scaled it. Every gradient is quantized whatever
        the flag (the decision stays on the device): on a skipped step the quantizations made here
        do not count towards μ, and μ moves only if the all-reduce or backward recorded counts
        (their saturation was real even if the step is not), as before.
        """
        everything = [p for g in optimizer.param_groups for p in g["params"]]
        params = [p for p in everything if p.grad is not None and not self.backward_grads.release_reduced(p)]
        device = everything[0].device
        comm_scales = self.comm_state.grad_scales
        found_inf = self.nonfinite_gradients([p.grad for p in params], device)  # the clip's norm, or read
        stored = self.backward_grads.nonfinite(everything)
        if stored is not None:
            found_inf = torch.maximum(found_inf, stored.float())
        # Each FSDP2 rank checked its shards: every rank takes the same decision (an all-reduce).
        found_inf = any_rank(found_inf, [p.grad for p in params], self._data_parallel_group)
        recorded_before = self.scaler.pending
        # Under FSDP2 the reduced gradient shards take the whole gradients' scales (one all-reduce).
        sharded = self._quantize_sharded_gradients(params, found_inf)
        roundtrip = []  # O1: the FP8 values written back into p.grad, with the quantization
        for p in params:
            if self.o2 and get_master_scale(p) is None:
                continue
            scale = comm_scales.pop(id(p), None)
            if not self.o2 and scale is None and id(p) not in sharded and p.grad.is_contiguous():
                roundtrip.append(p)
                continue
            if id(p) in sharded:
                payload, scale = sharded[id(p)]
            elif scale is None:
                payload, scale, saturated = quantize_gradient(
                    p.grad, self.scaler.mu_for(p.grad), self.grad_dtype, self.options.margin
                )
                self.scaler.record(saturated, p.numel(), unless=found_inf)
            else:
                payload, scale = requantize_gradient(p.grad, scale, self.grad_dtype, self.options.margin)
            if self.o2:
                optimizer.set_fp8_grad(p, payload, scale)
                p.grad = None
            else:
                unscale_into(local_shard(p.grad), payload, scale)
        comm_scales.clear()
        self._roundtrip(roundtrip, found_inf)
        if self.o2:
            self.backward_grads.discard_where(found_inf, everything)
        self.scaler.update(unless=None if recorded_before else found_inf)
        return found_inf

    def _roundtrip(self, params: list[torch.Tensor], found_inf: torch.Tensor) -> None:
        """O1: each gradient replaced by its FP8 values; one graph for all of them on a GPU
        (`fused.gradients_roundtrip_`), one per gradient elsewhere (the same bits)."""
        if not params:
            return
        grads, margin = [p.grad for p in params], self.options.margin
        mus = [self.scaler.mu_for(g) for g in grads]
        if takes_gpu_path(grads[0].device):
            counts = gradients_roundtrip_(grads, mus, self.grad_dtype, margin)
        else:
            counts = [gradient_roundtrip_(g, mu, self.grad_dtype, margin) for g, mu in zip(grads, mus)]
        for p, saturated in zip(params, counts):
            self.scaler.record(saturated, p.numel(), unless=found_inf)

    def _quantize_sharded_gradients(
        self, params: list[torch.Tensor], found_inf: torch.Tensor
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        if not any(isinstance(p.grad, DTensor) for p in params):
            return {}
        from ..fp8.sharded_weight import quantize_sharded_gradients

        mu = self.scaler.mu_for(local_shard(params[0].grad))
        out, saturated = quantize_sharded_gradients(params, mu, self.grad_dtype, self.options.margin)
        self.scaler.record(saturated, sum(p.numel() for p in params), unless=found_inf)
        return out

    def guarded_step_state(self) -> list[torch.Tensor]:
        """The gradient scaler's device state (μ, clean steps, last saturated share), which the
        guard restores after a step it skips as an outlier (`hf_lowprec.guard.Guard.keep`)."""
        scaler = self.scaler
        return [scaler._mu, scaler._clean_steps, scaler._last_share]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        scaler = self.scaler.state_dict()
        state.update(grad_mu=scaler["mu"], grad_clean_steps=scaler["clean_steps"])
        state["allreduce_stats"] = self.comm_state.stats.counts()  # since the last log
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "grad_mu" in state:
            self.scaler.load_state_dict({"mu": state["grad_mu"], "clean_steps": state["grad_clean_steps"]})
        self.comm_state.stats = AllReduceStats(*state.get("allreduce_stats", ()))

    def metrics(self) -> dict[str, float]:
        stats, self.comm_state.stats = self.comm_state.stats, AllReduceStats()  # counts per logging interval
        self._allreduced = self._allreduced or stats.numel > 0
        out = {
            **super().metrics(),
            "precision/fp8_grad_mu": self.scaler.mu,
            "precision/fp8_grad_saturated_share": self.scaler.last_saturated_share,
        }
        if self._allreduced:
            out["precision/fp8_allreduce_underflow"] = float(stats.underflow)
            out["precision/fp8_allreduce_overflow"] = float(stats.overflow)
        return out


def _fp32_masters(model: torch.nn.Module) -> dict[int, str]:
    """id(weight) → why, for the FP8 layers' weights that keep an FP32 master: one a module other
    than an FP8 layer holds too (a tied `nn.Linear` subclass, which would read the payload as the
    real weight), and one the model keeps in FP32 in an FP16 load (`fp32_module_patterns`: T5 casts
    its `wo` input to `wo.weight.dtype`, which would overflow FP16)."""
    fp8 = {id(m.weight): name for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    patterns = fp32_module_patterns(model, torch.float16)  # the masters' dtype: transformers' FP16 rule
    out = {i: "the model keeps it in FP32" for i, name in fp8.items() if any(k in f"{name}.weight" for k in patterns)}
    for name, module in model.named_modules():
        if not isinstance(module, (FP8Linear, FP8Experts)):
            for attr, p in module.named_parameters(recurse=False):
                if id(p) in fp8:
                    out[id(p)] = f"its weight is also {name}.{attr} ({type(module).__name__}), kept in high precision"
    return out
