"""The guard: a run that watches itself for low-precision failures and acts (docs/guard.md).

`precision_options={"guard": True}` (or a dict of `GuardConfig`'s fields) on any strategy: `Guard`
watches the loss, the gradient norm, non-finite gradients and each FP8 layer's flushed inputs on
the device, skips outlier steps, rolls back after repeated faults and raises flushing FP8 layers.
With no fault, a guarded run computes the same bits as an unguarded one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch

from .distributed import any_rank, local_shard
from .fp8.raised import config_named, finer

logger = logging.getLogger("hf_lowprec")

__all__ = ["Guard", "GuardConfig", "guard_config", "guard_metrics", "guard_state", "load_guard_state"]

_COUNTS = "guard_counts"


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """Thresholds of the guard (what each does: `Guard`; docs/guard.md, "Options"). Defaults
    follow OLMo-core's skip-step optimizer (a window of 128 steps, 6 spreads)."""

    window: int = 128
    warmup: int = 20
    z_threshold: float = 6.0
    rollback_after: int = 3
    snapshot_every: int = 50
    max_flushed: float = 0.01
    max_rollbacks: int = 10

    def __post_init__(self) -> None:
        for name in ("window", "warmup", "rollback_after", "snapshot_every", "max_rollbacks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"guard option {name!r} must be a positive integer, got {value!r}")
        for name, low, high in (("z_threshold", 0.0, math.inf), ("max_flushed", 0.0, 1.0)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low < value <= high:
                raise ValueError(f"guard option {name!r} must be a number in ({low}, {high}], got {value!r}")
        if self.warmup > self.window:
            raise ValueError(f"guard option 'warmup' ({self.warmup}) must not exceed 'window' ({self.window})")


def guard_config(value: Any) -> GuardConfig | None:
    """The `guard` option as a config: False → off, True → defaults, a dict → its fields.
    Anything else, or an unknown field, raises an error naming the valid fields."""
    if value is False:
        return None
    if value is True:
        return GuardConfig()
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(GuardConfig)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"guard has no option(s) {unknown}; valid: {sorted(fields)}")
        return GuardConfig(**value)
    raise ValueError(
        f"option 'guard' must be true, false or a dict of {sorted(GuardConfig.__annotations__)}, got {value!r}"
    )


class Guard:
    """The guard of one strategy and its model.

    Watch, on the device, with no host sync inside a step:

    - the training loss (a forward hook on the prepared model reads `output.loss` in training
      mode; micro-batches of one optimizer step are averaged) and the global gradient norm, each
      against its running mean and spread over the last `window` accepted steps (z-scores, as
      OLMo-core's skip-step optimizer does);
    - non-finite gradients (the strategy's own `found_inf`);
    - per FP8 layer, the share of its non-zero inputs that its E4M3 casts flush to zero
      (`fp8.raised.flush_counts`, added into a buffer on the layer at each forward).

    Act, in escalating order:

    1. a step whose loss or gradient norm lies more than `z_threshold` spreads above its mean
       (after the first `warmup` steps) is skipped on the device, through the same flag that
       skips a non-finite step, agreed over the data-parallel ranks (`judge`);
    2. at each `check` (the Trainer's logging steps, where it reads the device anyway; or by
       hand in a custom loop) the host reads the counters: after `rollback_after` faulty steps
       (outliers or non-finite) since the last snapshot, the model, the optimizer state and the
       strategy's scales are restored from an in-memory snapshot, and the run goes on with the
       next batches; a check with no fault since the last takes a new snapshot every
       `snapshot_every` steps;
    3. an FP8 layer that flushed more than `max_flushed` of its inputs since the last check is
       raised one step (tensorwise → rowwise → BF16, `fp8.raised.finer`).

    Every action is logged as one warning naming what and why, counted in `precision/guard_*`
    metrics, and saved with the strategy's state: a resumed run re-raises the same layers. The
    guard is bounded: after `max_rollbacks` rollbacks, or once every FP8 layer is BF16 and still
    faulting, it says so and stops acting (the run goes on, as it would without the guard).
    """

    def __init__(self, config: GuardConfig, strategy: Any) -> None:
        self.config = config
        self.strategy = strategy
        self.model: torch.nn.Module | None = None
        self.layers: dict[str, torch.nn.Module] = {}
        self.raised: dict[str, str] = {}  # layer name → recipe it was raised to
        self.actions: list[dict[str, Any]] = []
        self.steps = 0  # optimizer steps seen (host: known without reading the device)
        self.rollbacks = 0
        self.stopped = ""
        self._faults_seen = 0.0  # faulty steps counted at the last check (host copy)
        self._faults_since_snapshot = 0.0
        self.optimizer: torch.optim.Optimizer | None = None  # the inner optimizer (StrategyOptimizer sets it)
        self._snapshot: dict[str, Any] | None = None
        self._snapshot_step = -1
        self._device_state: dict[str, torch.Tensor] | None = None
        self._pending_loss: list[torch.Tensor] = []
        self._hook: Any = None
        self._last_flushed: dict[str, float] = {}

    # --- attach -------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        """Watch `model`: its loss, and the input cast of each FP8 layer."""
        from .fp8 import FP8Linear

        self.model = model
        if self._hook is not None:
            self._hook.remove()
        self._hook = model.register_forward_hook(self._observe_loss)
        for name, module in model.named_modules():
            if isinstance(module, FP8Linear):
                self.layers[name] = module
                if module._buffers.get(_COUNTS) is None:
                    device = module.weight.device if module.weight.device.type != "meta" else None
                    counts = torch.zeros(2, dtype=torch.int64, device=device)
                    module.register_buffer(_COUNTS, counts, persistent=False)
        for name, recipe in self.raised.items():  # raised before a resume: raise them again
            self._set_recipe(name, recipe)

    def _observe_loss(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        loss = getattr(output, "loss", None)
        if module.training and torch.is_grad_enabled() and torch.is_tensor(loss) and loss.dim() == 0:
            self._pending_loss.append(loss.detach().float())

    # --- the step (no host sync) ---------------------------------------------------------
    def _state(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self._device_state is None or self._device_state["loss"].device != device:
            w = self.config.window
            self._device_state = {
                "loss": torch.zeros(w, device=device),
                "norm": torch.zeros(w, device=device),
                "valid": torch.zeros(w, device=device),
                "faults": torch.zeros((), device=device),
                "outliers": torch.zeros((), device=device),
                "last_z": torch.zeros(2, device=device),
            }
        return self._device_state

    def keep(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the strategy's step state that its gradient processing updates even on a
        skipped step (FP8-LM's gradient scale μ and its clean-step count:
        `guarded_step_state`), taken before it: an outlier step puts them back, so that it
        leaves no trace, while a non-finite step still moves them as the strategy decides."""
        state = getattr(self.strategy, "guarded_step_state", None)
        return [(t, t.clone()) for t in state()] if state is not None and not self.stopped else []

    def judge(
        self,
        optimizer: torch.optim.Optimizer,
        found_inf: torch.Tensor,
        kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """This step's skip flag: `found_inf` or an outlier loss / gradient norm, agreed over the
        ranks; the window takes the step's values unless it is skipped; an outlier step restores
        `kept` (see `keep`). No host sync."""
        if self.stopped:  # the run goes on as an unguarded one would
            self._pending_loss = []
            self.steps += 1
            return found_inf
        params = [p for g in optimizer.param_groups for p in g["params"]]
        device = found_inf.device
        state = self._state(device)
        norm = self._grad_norm(params, device)
        losses, self._pending_loss = self._pending_loss, []
        loss = torch.stack([t.to(device) for t in losses]).mean() if losses else None
        values = torch.stack([loss if loss is not None else torch.zeros((), device=device), norm])
        outlier = torch.zeros((), device=device)
        if self.steps >= self.config.warmup:
            valid = state["valid"]
            count = valid.sum().clamp(min=1.0)
            history = torch.stack([state["loss"], state["norm"]])
            mean = (history * valid).sum(1) / count
            spread = (((history - mean[:, None]) ** 2 * valid).sum(1) / count).sqrt()
            z = (values - mean) / spread.clamp(min=torch.finfo(torch.float32).tiny)
            if loss is None:  # no loss seen (a trainer that computes it outside the model)
                z = torch.stack([torch.zeros_like(z[1]), z[1]])
            state["last_z"].copy_(z)
            outlier = ((z > self.config.z_threshold) | ~torch.isfinite(values)).any().float()
            outlier = outlier * (valid.sum() >= self.config.warmup).float()  # after `warmup` accepted steps
            outlier = any_rank(outlier, params, getattr(self.strategy, "_data_parallel_group", None))
        skip = torch.maximum(found_inf, outlier)
        undo = outlier * (1.0 - found_inf)
        for tensor, before in kept or ():
            tensor.copy_(torch.where(undo > 0, before, tensor))
        slot = self.steps % self.config.window
        keep = 1.0 - skip
        state["loss"][slot] = torch.where(skip > 0, state["loss"][slot], values[0])
        state["norm"][slot] = torch.where(skip > 0, state["norm"][slot], values[1])
        state["valid"][slot] = torch.maximum(state["valid"][slot] * skip, keep)
        state["faults"].add_(skip)
        state["outliers"].add_(undo)
        self.steps += 1
        return skip

    def _grad_norm(self, params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The global gradient norm as the strategy clips it (FP8 and FP16 gradients included),
        else of the local gradients (under ZeRO and FSDP2: of this rank's shards)."""
        own = self.strategy.clip_own_grad_norm(params, math.inf)
        if own is not None:
            return own.float().to(device)
        grads = [local_shard(p.grad) for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=device)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)).float())

    # --- at a check (host reads allowed) ------------------------------------------------
    def check(self) -> list[dict[str, Any]]:
        """Read the counters and act: roll back, raise layers, snapshot. Reads the device (a
        sync): the Trainer calls it at logging steps. Returns the actions taken."""
        taken: list[dict[str, Any]] = []
        if self._device_state is None or self.model is None or self.stopped:
            return taken
        faults = float(self._device_state["faults"].item())
        new_faults, self._faults_seen = faults - self._faults_seen, faults
        taken += self._raise_layers()
        if self.stopped:  # raising the last layers stopped it
            return taken
        since_snapshot = self._faults_since_snapshot + new_faults
        self._faults_since_snapshot = since_snapshot
        if since_snapshot >= self.config.rollback_after and self._snapshot is not None:
            if self.rollbacks >= self.config.max_rollbacks:
                self._stop(f"{self.rollbacks} rollbacks done, the limit (max_rollbacks)")
            else:
                taken.append(self._rollback(int(since_snapshot)))
        elif new_faults == 0 and self.steps - self._snapshot_step >= self.config.snapshot_every:
            self._take_snapshot()
        return taken

    def _raise_layers(self) -> list[dict[str, Any]]:
        taken: list[dict[str, Any]] = []
        watched = [(n, layer) for n, layer in self.layers.items() if layer._buffers.get(_COUNTS) is not None]
        if not watched:
            return taken
        buffers = [layer._buffers[_COUNTS] for _, layer in watched]
        read = torch.stack(buffers).tolist()  # one read for every layer
        for counts in buffers:
            counts.zero_()
        for (name, layer), (flushed, nonzero) in zip(watched, read):
            share = flushed / nonzero if nonzero else 0.0
            self._last_flushed[name] = share
            if share <= self.config.max_flushed or layer.config.raised:
                continue
            before = layer.recipe
            after = finer(layer.config, (layer.in_features, layer.out_features)).name
            self._set_recipe(name, after)
            taken.append(
                self._act(
                    "raise",
                    f"{name}: {before} → {after}",
                    f"its E4M3 input cast flushed {share:.1%} of the non-zero inputs to zero since the last "
                    f"check (max_flushed {self.config.max_flushed:.1%})",
                )
            )
        if self.layers and all(layer.config.raised for layer in self.layers.values()) and not self.stopped:
            if any(a["action"] == "raise" for a in taken):
                self._stop("every FP8 layer runs in BF16 now: there is no precision left to raise")
        return taken

    def _set_recipe(self, name: str, recipe: str) -> None:
        layer = self.layers.get(name)
        if layer is None:
            return
        layer.set_config(config_named(layer.config, recipe))
        self.raised[name] = recipe

    def _take_snapshot(self) -> None:
        """Copies of every parameter and buffer, the optimizer state and the strategy's scales
        (device to device; the host waits only for the strategy's counters)."""
        assert self.model is not None
        tensors = {n: t.detach().clone() for n, t in _named_tensors(self.model)}
        optimizer = self.optimizer
        state = {}
        if optimizer is not None:
            state = {
                id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                for p, s in optimizer.state.items()
            }
        scales = {k: v for k, v in self.strategy.state_dict().items() if k not in ("skipped_steps", "guard")}
        self._snapshot = {"tensors": tensors, "optimizer": state, "strategy": scales}
        self._snapshot_step = self.steps
        self._faults_since_snapshot = 0.0

    def _rollback(self, faults: int) -> dict[str, Any]:
        assert self.model is not None and self._snapshot is not None
        snapshot = self._snapshot
        with torch.no_grad():
            for name, tensor in _named_tensors(self.model):
                saved = snapshot["tensors"].get(name)
                if saved is not None and saved.shape == tensor.shape:
                    tensor.copy_(saved)
            optimizer = self.optimizer
            if optimizer is not None:
                for p, s in optimizer.state.items():
                    for k, v in snapshot["optimizer"].get(id(p), {}).items():
                        if torch.is_tensor(v) and torch.is_tensor(s.get(k)):
                            s[k].copy_(v)
                        else:
                            s[k] = v
        current = self.strategy.state_dict()
        self.strategy.load_state_dict({**current, **snapshot["strategy"]})
        self.rollbacks += 1
        self._faults_since_snapshot = 0.0
        back = self.steps - self._snapshot_step
        return self._act(
            "rollback",
            f"restored the state of {back} step(s) ago (step {self._snapshot_step}); the run goes on with the next batches",
            f"{faults} faulty step(s) (outliers or non-finite) since that snapshot (rollback_after {self.config.rollback_after})",
        )

    def _act(self, action: str, what: str, why: str) -> dict[str, Any]:
        record = {"step": self.steps, "action": action, "what": what, "why": why}
        self.actions.append(record)
        logger.warning("guard at step %d: %s %s, because %s", self.steps, action, what, why)
        return record

    def _stop(self, why: str) -> None:
        self.stopped = why
        self._act("stop", "the guard takes no further action", why)

    # --- metrics and state ---------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """`precision/guard_*` for the logs (call after `check`, which has read the device)."""
        state = self._device_state
        out = {
            "precision/guard_faulty_steps": self._faults_seen,
            "precision/guard_rollbacks": float(self.rollbacks),
            "precision/guard_raised_layers": float(len(self.raised)),
        }
        if state is not None:
            out["precision/guard_outlier_steps"] = float(state["outliers"].item())
            z_loss, z_norm = state["last_z"].tolist()
            out["precision/guard_loss_z"] = z_loss
            out["precision/guard_grad_norm_z"] = z_norm
        if self._last_flushed:
            out["precision/guard_flushed_max"] = max(self._last_flushed.values())
        return out

    def state_dict(self) -> dict[str, Any]:
        state = self._device_state
        return {
            "steps": self.steps,
            "rollbacks": self.rollbacks,
            "raised": dict(self.raised),
            "actions": list(self.actions),
            "stopped": self.stopped,
            "faults_seen": self._faults_seen,
            "faults_since_snapshot": self._faults_since_snapshot,
            "window": None if state is None else {k: v.tolist() for k, v in state.items()},
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.steps = int(saved.get("steps", 0))
        self.rollbacks = int(saved.get("rollbacks", 0))
        self.actions = list(saved.get("actions", []))
        self.stopped = str(saved.get("stopped", ""))
        self._faults_seen = float(saved.get("faults_seen", 0.0))
        self._faults_since_snapshot = float(saved.get("faults_since_snapshot", 0.0))
        window = saved.get("window")
        if window is not None:
            device = self._device_state["loss"].device if self._device_state is not None else _device_of(self.model)
            self._device_state = {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in window.items()}
            if len(window["loss"]) != self.config.window:  # resumed with another `window`: the counters
                # carry over, the history starts again (outliers judged after `warmup` new steps)
                for key in ("loss", "norm", "valid"):
                    self._device_state[key] = torch.zeros(self.config.window, device=device)
                logger.info(
                    "guard: resumed with window %d (saved: %d): its history starts again",
                    self.config.window,
                    len(window["loss"]),
                )
        for name, recipe in dict(saved.get("raised", {})).items():
            self._set_recipe(name, recipe)
            self.raised[name] = recipe
        if self.raised:
            listed = ", ".join(f"{n} ({r})" for n, r in self.raised.items())
            logger.info("guard: resumed with the layers it raised before: %s", listed)


def guard_state(guard: Guard | None) -> dict[str, Any]:
    """The strategy state's "guard" entry (none without a guard)."""
    return {"guard": guard.state_dict()} if guard is not None else {}


def load_guard_state(guard: Guard | None, saved: dict[str, Any] | None) -> None:
    """Restore a saved guard; a run without one is told which layers the saved one had raised."""
    if not saved:
        return
    if guard is not None:
        guard.load_state_dict(saved)
    elif saved.get("raised"):
        logger.warning(
            "the checkpoint's guard had raised layers %s; this run has no guard: they run as the strategy converts them",
            saved["raised"],
        )


def guard_metrics(guard: Guard | None) -> dict[str, float]:
    """At a logging step: the guard checks (and acts), then its metrics."""
    if guard is None:
        return {}
    guard.check()
    return guard.metrics()


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is None or id(t) in seen or name.endswith(_COUNTS):
            continue
        seen.add(id(t))
        out.append((name, t))
    return out


def _device_of(model: torch.nn.Module | None) -> torch.device:
    if model is None:
        return torch.device("cpu")
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
