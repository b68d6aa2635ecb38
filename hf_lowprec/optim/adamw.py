"""The AdamW core: validation, the per-step scalars, the arithmetic and the step loop, once.

Every optimizer of `hf_lowprec.optim` is AdamW over a `Composition` (m format × v format × update
rule: `formats`, `rules`), whose step for one parameter is one pure function of tensors,
`Composition.step` (the arithmetic: `adamw_math`): run eagerly it is the reference, and
`dispatch` compiles it. `AdamW` is the `torch.optim.Optimizer` around it; a family is a subclass
that says which composition a parameter gets, in a few lines (`families`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from ..distributed import DTensor
from ..distributed import local_shard as _local
from ..distributed import sharded_like as _sharded_like
from ..numerics import LOW_PRECISION_DTYPES
from .dispatch import FusedMode, ParamStep, check_fused_mode, run_bucket
from .formats import Format, root
from .lowprec_optimizer import LowPrecisionOptimizer, seed_from_run
from .rules import Rule
from .scalars import (
    BETA2,
    DECAY,
    EPS,
    ONE_MINUS_BETA1,
    ONE_MINUS_BETA2,
    STEP,
    adamw_scalars,
    check_adamw_hyperparameters,
)
from .skipping import FlagPerDevice, StepCounts, check_found_inf, select_, step_count_on_device
from .torch_options import check_keyword_options, check_torch_group_options

__all__ = ["STATE_ROLES", "AdamW", "Composition", "adamw_math", "adamw_scalars", "check_adamw_hyperparameters"]

#: Where each state key's bytes go, for `hf_lowprec.memory` and the reports: the moments are
#: "optimizer", a gradient kept by the optimizer "gradient"; every other key (errors, scales,
#: block metadata, masters, compensations) is "extra", the readers' default.
STATE_ROLES: dict[str, str] = {"exp_avg": "optimizer", "exp_avg_sq": "optimizer", "grad": "gradient"}


def adamw_math(
    theta: torch.Tensor, g: torch.Tensor, m_old: torch.Tensor, v_old: torch.Tensor, scalars: torch.Tensor, max_v: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m₃₂, v₃₂, Δθ₃₂) from FP32 registers and the scalar vector `scalars`.

    The step of one parameter (`Composition.step`), each stored value rounded once:

        g  = decode(grad)                                    (FP8 payload / scale, or widened)
        θ  = rule.read(param)                                (the master, or the parameter)
        m₃₂ = m + (1 − β1)·(g − m)                           m, v decoded to FP32 registers
        v₃₂ = min(β2·v + ((1 − β2)·g)·g, max_v)
        Δθ = fl(−α·λ·θ) + (s·m₃₂)/(√v₃₂ + ε'),  s = −α·√c2/c1, ε' = max(ε·√c2, tiny)
        encode m₃₂, v₃₂; rule.apply(Δθ)

    with c1 = 1 − β1^t, c2 = 1 − β2^t folded into two scalars on the host in FP64 and rounded
    once to FP32 (`adamw_scalars`): m̂/(√v̂ + ε) = (m·√c2/c1)/(√v + ε·√c2). Every FP32 operation
    is rounded on its own (no lerp or addcmul, whose CPU kernels fuse a multiply-add), so the
    compiled function reproduces the eager one bit for bit. ε sits outside the root as in
    `torch.optim.AdamW`; decoupled weight decay is part of Δθ (so a compensated rule compensates
    it too); `tiny` (FP32's smallest normal) keeps v = 0 with ε = 0 from giving 0/0; max_v (the
    largest value v's storage holds) makes a finite gradient whose square overflows saturate v.
    """
    one_minus_beta1, beta2, one_minus_beta2, step_size, eps, decay = (
        scalars.select(0, i) for i in (ONE_MINUS_BETA1, BETA2, ONE_MINUS_BETA2, STEP, EPS, DECAY)
    )
    m = m_old + one_minus_beta1 * (g - m_old)
    v = torch.clamp(v_old * beta2 + one_minus_beta2 * g * g, max=max_v)
    return m, v, theta * decay + step_size * m / (root(v) + eps)


@dataclasses.dataclass(frozen=True)
class Composition:
    """An AdamW family for one parameter: how m and v are stored, how Δθ is applied."""

    m: Format
    v: Format
    rule: Rule

    @property
    def block(self) -> int:
        return math.lcm(self.m.block, self.v.block)

    def keys(self) -> tuple[str, ...]:
        return (*self.m.keys("exp_avg"), *self.v.keys("exp_avg_sq"), *self.rule.keys())

    def like_param(self) -> tuple[bool, ...]:
        """For param, grad, grad_scale and every stored tensor: has it the parameter's elements?"""
        return (True, True, False, *self.m.like_param, *self.v.like_param, *self.rule.like_param)

    def zeros(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.keys(), (*self.m.zeros(param), *self.v.zeros(param), *self.rule.zeros(param))))

    def stored(self, param: torch.Tensor, state: dict[str, Any]) -> list[torch.Tensor]:
        keys = (*self.m.keys("exp_avg"), *self.v.keys("exp_avg_sq"))
        return [state[k] for k in keys] + list(self.rule.stored(param, state))

    def stored_names(self) -> tuple[str, ...]:
        """The name of each tensor `stored` returns (the one order of a family's slots)."""
        return (*self.m.keys("exp_avg"), *self.v.keys("exp_avg_sq"), *self.rule.stored_names())

    def step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        grad_scale: torch.Tensor | None,
        *rest: Any,
        found_inf: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One AdamW step of one parameter, in place; returns Δθ₃₂ (the arithmetic: `adamw_math`).

        `rest` is the stored tensors of m, v and the rule, then the scalar vector and the seed.
        `found_inf`: None, or a 0-dim tensor; nonzero leaves every tensor untouched (the step runs
        into copies, selected away with `torch.where`: fused by the compiled path) and Δθ = 0.
        """
        *stored, scalars, seed = rest
        written = (param, *stored)
        if found_inf is not None:  # step into copies, then keep the old bits where it is set
            param, *stored = (None if tensor is None else tensor.clone() for tensor in written)
        split_m, split_v = len(self.m.suffixes), len(self.m.suffixes) + len(self.v.suffixes)
        m_stored, v_stored, rule_stored = stored[:split_m], stored[split_m:split_v], stored[split_v:]
        g = grad.float() if grad_scale is None else grad.float() / grad_scale
        theta = self.rule.read(param, *rule_stored)
        m_old, v_old = self.m.decode(*m_stored), self.v.decode(*v_stored)
        m, v, delta = adamw_math(theta, g, m_old, v_old, scalars, self.v.register_max(v_stored[0].dtype))
        # Every scale is chosen before anything is stored (`formats.Format.choose`).
        chosen = self.m.choose(m, *m_stored), self.v.choose(v, *v_stored)
        rule_chosen = self.rule.choose(delta, theta, param, *rule_stored)
        self.m.store_(m, chosen[0], *m_stored)
        self.v.store_(v, chosen[1], *v_stored)
        self.rule.apply_(delta, theta, param, *rule_stored, seed=seed, chosen=rule_chosen)
        if found_inf is not None:
            for original, stepped in zip(written, (param, *stored)):
                if original is not None:  # a tensor a row may lack (`rules.ScaledMasterFP8`)
                    select_(original, found_inf != 0, stepped)
            delta = torch.where(found_inf != 0, 0.0, delta)
        return delta


class AdamW(LowPrecisionOptimizer):
    """AdamW over a composition (m format × v format × update rule) chosen per parameter.

    Args:
        params: parameters or parameter groups (an ordered collection).
        lr, betas, eps, weight_decay: as in `torch.optim.AdamW`, defaults too (weight_decay=1e-2, decoupled).
        fused: "auto", "native", "compiled" or "reference": which implementation runs the
            step (`dispatch`); same bits on CPU. Not a group option: checkpoints are the same
            whichever path wrote them. Not torch's boolean either (None reads as "auto"); torch's
            other arguments are taken where they change nothing, else refused (`torch_options`).
        seed: for rules that round stochastically, the seed of the per-device generators
            (drawn from the global RNG when None); their states travel in `state_dict()`.
        extra options: the family's group options (`extra_options`).

    Subclasses implement `composition(param, group)`. State per parameter: `step` (int) and the tensors of
    the composition's `keys()`, created at the first step (or by `plan_state`). FSDP2: a DTensor parameter
    steps on its local shard with the same code (the update is element-wise); its parameter-shaped states
    are DTensors sharded like it (`distributed`). `paths_taken` counts, per parameter step, which
    implementation ran ("native", "compiled", "reference"). The optimizer validates its options, makes each
    parameter's state from the formats and the rule, steps buckets of parameters sharing a composition,
    tracks the lost arithmetic, and loads state back in its own dtypes. Skipped steps
    (`step(found_inf=flag)`) are decided on the device, without a host sync (`skipping`). A parameter
    written outside the step continues from its new value (`LowPrecisionOptimizer`, `rules.Rule.restart_`).
    """

    #: Parameter dtypes accepted (None: any floating dtype).
    param_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = LOW_PRECISION_DTYPES
    #: Group options beyond the AdamW hyper-parameters.
    extra_options: ClassVar[tuple[str, ...]] = ()
    dtype_advice: ClassVar[str] = (
        "cast the model with hf_lowprec.strategies.casting.cast_model(model, torch.bfloat16) (model.to would round "
        "its rotary frequencies too), or use PlainAdamW / torch.optim.AdamW for FP32 parameters"
    )
    state_roles: ClassVar[dict[str, str]] = STATE_ROLES

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        fused: FusedMode = "auto",
        seed: int | None = None,
        **extra_defaults: Any,
    ):
        fused, extra_defaults = check_keyword_options(type(self).__name__, fused, extra_defaults, self.extra_options)
        check_adamw_hyperparameters(type(self).__name__, lr, betas, eps, weight_decay)
        self.fused = check_fused_mode(type(self).__name__, fused)
        self.seed = seed_from_run() if seed is None else seed
        self._generators: dict[str, torch.Generator] = {}
        self.paths_taken: collections.Counter[str] = collections.Counter()
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **extra_defaults)
        super().__init__(params, defaults)

    # --- what a family declares -------------------------------------------------------------

    def composition(self, param: torch.Tensor, group: dict[str, Any]) -> Composition:
        """The formats of m and v and the update rule for `param` in `group`."""
        raise NotImplementedError

    def _check_group(self, group: dict[str, Any]) -> None:
        name = type(self).__name__
        check_adamw_hyperparameters(name, group["lr"], group["betas"], group["eps"], group["weight_decay"])
        check_torch_group_options(name, group)

    # --- parameter groups and state --------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        merged = {**self.defaults, **param_group}
        self._check_group(merged)
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError(
                f"{type(self).__name__}: parameters must be an ordered collection, not a set; "
                f"pass a list so that state_dict order is reproducible"
            )
        params = param_group["params"] = [params] if torch.is_tensor(params) else list(params)
        for index, param in enumerate(params):
            if not param.is_floating_point():
                raise ValueError(
                    f"{type(self).__name__} optimizes floating-point parameters, got {param.dtype} "
                    f"(parameter {index} of group {len(self.param_groups)})"
                )
            if self.param_dtypes is not None and param.dtype not in self.param_dtypes:
                allowed = " or ".join(str(d) for d in self.param_dtypes)
                raise ValueError(
                    f"{type(self).__name__} needs {allowed} parameters, got {param.dtype} "
                    f"(parameter {index} of group {len(self.param_groups)}); {self.dtype_advice}"
                )
        super().add_param_group(param_group)

    def group_of(self, param: torch.Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise ValueError(f"{type(self).__name__}: the parameter is not one this optimizer updates")

    def _options_of(self, param: torch.Tensor) -> dict[str, Any]:
        """`param`'s group, or the defaults for a tensor kept outside the groups (FP8ZeroAdamW's
        FP8 weights): what `composition` reads."""
        return next((g for g in self.param_groups if any(p is param for p in g["params"])), self.defaults)

    def plan_state(self, param: torch.Tensor, group: dict[str, Any] | None = None) -> dict[str, Any]:
        """The state `param` gets at its first step (zeros; a master copies the parameter)."""
        group = self.group_of(param) if group is None else group
        zeros = self.composition(param, group).zeros(_local(param.detach()))
        return {"step": 0, **{key: _sharded_like(value, param) for key, value in zeros.items()}}

    def init_states(self) -> None:
        """Create the state of every parameter that has none (zeros, step 0) as the first step
        would, and the generators of a stochastic rule: what a sharded checkpoint load
        (torch.distributed.checkpoint) fills in."""
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                state.update({} if state else self.plan_state(param, group))
                step_count_on_device(state, _local(param).device)
                if self.composition(param, group).rule.needs_seed and param.device.type != "meta":
                    self._generator(_local(param).device)

    def _complete_state(
        self, param: torch.Tensor, local: torch.Tensor, state: dict[str, Any], composition: Composition
    ) -> None:
        """Create the keys a composition needs that the state lacks: a group switched from
        Collage-light to plus starts δv at zero; an FP16 v saved before it had a scale gets
        s = 1, which reads the unscaled values correctly."""
        missing = [k for k in composition.keys() if k not in state]  # noqa: SIM118 (a method, not a dict)
        if missing:
            zeros = composition.zeros(local)
            for key in missing:
                value = zeros[key] if not key.endswith("_scale") else torch.ones((), device=local.device)
                state[key] = _sharded_like(value, param)

    def held_value(self, param: torch.Tensor) -> torch.Tensor:
        """The value this optimizer holds for `param` (θ + δθ, the master), FP64."""
        state = self.state.get(param, {})
        rule = self.composition(param, self._options_of(param)).rule
        self._restart_if_written(param, rule, state)
        if not isinstance(param, DTensor):
            return rule.held_value(param, state)
        local_state = {key: _local(value) for key, value in state.items()}
        return _sharded_like(rule.held_value(_local(param), local_state), param)

    def full_precision_value(self, param: torch.Tensor) -> torch.Tensor:
        """`held_value` rounded once to FP32, such that casting it back gives θ.

        θ is the round-to-nearest of θ + δθ, but the FP32 rounding can land exactly on a tie of
        the parameter's dtype; there the value moves one FP32 ulp towards θ, so loading the
        checkpoint into a BF16 model restores θ bit for bit.
        """
        value = super().full_precision_value(param)
        rule = self.composition(param, self._options_of(param)).rule
        if rule.compensation_key is None or param.dtype == value.dtype:
            return value
        value, theta = _local(value), _local(param).detach()  # element-wise: per shard under FSDP2
        value = torch.where(value.to(param.dtype) != theta, torch.nextafter(value, theta.float()), value)
        return _sharded_like(value, param)

    def seed_compensation(self, param: torch.Tensor, residual: torch.Tensor) -> None:
        """Start the compensation of `param` at `residual`, so θ + δθ is a wider value (a master rule:
        the master at θ + residual). From FP32: residual = r(θ₃₂ − r(θ₃₂)), and θ + δθ reproduces the
        FP32 weights to about 2p bits (16 for BF16) instead of p, and θ stays the nearest value of it
        (`rules.Rule.seed_`: a zero update leaves both). Call before the first step.
        """
        group = self.group_of(param)
        rule = self.composition(param, group).rule
        key = rule.compensation_key or rule.master_key
        if key is None:
            raise ValueError(f"{type(self).__name__} keeps no compensation to seed")
        if residual.shape != param.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != parameter shape {tuple(param.shape)}")
        if not self.state[param]:
            self.state[param] = self.plan_state(param, group)
        rule.seed_(_local(self.state[param][key]), _local(param.detach()), _local(residual))
        self._mark_written([param], rule)

    # --- the step --------------------------------------------------------------------------

    def _gradient(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """This step's gradient of `param` as (tensor, scale or None), or None to skip it."""
        if param.grad is None:
            return None
        if param.grad.is_sparse:
            raise ValueError(f"{type(self).__name__} does not support sparse gradients")
        return _local(param.grad), None

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    @torch.no_grad()
    def step(
        self, closure: Callable[[], float] | None = None, *, found_inf: torch.Tensor | None = None
    ) -> float | None:
        """Perform one optimization step; `closure` re-evaluates the loss, as in torch.optim.

        `found_inf`: a 0-dim float tensor on the parameters' device, nonzero to skip the step
        (a loss scaler's overflow flag): θ and every state stay as they were, decided on the
        device without a host sync (`skipping`).
        """
        check_found_inf(type(self).__name__, found_inf)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        flags = FlagPerDevice(found_inf)
        for group_index, group in enumerate(self.param_groups):
            buckets: dict[tuple[Composition, torch.device], list[tuple]] = {}
            for param in group["params"]:
                gradient = self._gradient(param)
                if gradient is None:
                    continue
                local = _local(param.detach())
                composition = self.composition(param, group)
                state = self.state[param]
                if "step" not in state:
                    # A state may already hold a handed-over gradient (FP8AdamW.set_fp8_grad).
                    state.update({k: v for k, v in self.plan_state(param, group).items() if k not in state})
                self._complete_state(param, local, state, composition)
                self._restart_if_written(param, composition.rule, state)
                buckets.setdefault((composition, local.device), []).append((param, local, gradient, state))
            for (composition, device), items in buckets.items():
                self._step_bucket(group_index, group, composition, device, items, flags.on(device))
        self._after_step()
        return loss

    def _step_bucket(
        self,
        group_index: int,
        group: dict[str, Any],
        composition: Composition,
        device: torch.device,
        items: list[tuple],
        found_inf: torch.Tensor | None = None,
    ) -> None:
        (beta1, beta2), counts = group["betas"], StepCounts([item[3] for item in items], device, found_inf)
        rows_scalars = counts.scalars(
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"]
        )
        seeds: list[torch.Tensor | None] = [None] * len(items)
        if composition.rule.needs_seed:
            # A skipped step still draws its seeds (the generator's state lives on the host): the
            # checkpointed generator state records the draw, so a resumed run continues bit for bit.
            generator = self._generator(device)
            drawn = torch.randint(0, 2**31 - 1, (len(items),), generator=generator, device=generator.device)
            seeds = list(drawn.to(device).unbind())
        rows = []
        for (param, local, (grad, grad_scale), state), scalars, seed in zip(items, rows_scalars, seeds):
            tensors = [local, grad, grad_scale, *(_local(t) for t in composition.stored(param, state))]
            rows.append(ParamStep(tensors, composition.like_param(), scalars, seed, found_inf))
        track = self.track_updates
        befores = [_local(self.held_value(item[0])) for item in items] if track else None
        updates = run_bucket(
            composition,
            _step_function(composition),
            composition.block,
            rows,
            self.fused,
            want_updates=track,
            counter=self.paths_taken,
        )
        # Counted once the bucket has stepped: a path that refuses to run leaves the state as it was.
        counts.advance()
        self._mark_written((item[0] for item in items), composition.rule)  # before `_track` reads them
        if befores is not None and updates is not None:
            for (param, local, _, _), before, update in zip(items, befores, updates):
                update = update.reshape(-1)[: local.numel()].view(local.shape)
                self._track(group_index, param, before, update)

    def _after_step(self) -> None:
        """Called once after every step (FP8AdamW forgets the FP8 gradients it was handed)."""

    # --- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        if self._generators:
            state_dict["generator_states"] = {key: g.get_state() for key, g in self._generators.items()}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        generator_states = state_dict.pop("generator_states", {})
        super().load_state_dict(state_dict)
        self._generators = {}
        for key, rng_state in generator_states.items():
            generator = torch.Generator(device=key)
            generator.set_state(rng_state.to(device="cpu", dtype=torch.uint8))
            self._generators[key] = generator


@functools.cache
def _step_function(composition: Composition) -> Callable[..., torch.Tensor]:
    """`composition.step` as a plain function (what `dispatch` compiles, once per composition)."""

    def adamw_step(*args: Any, found_inf: torch.Tensor | None = None) -> torch.Tensor:
        return composition.step(*args, found_inf=found_inf)

    return adamw_step
