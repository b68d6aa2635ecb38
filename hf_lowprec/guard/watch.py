"""`Guard`: watches one strategy's run on the device and acts at checks (docs/guard.md)."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ..distributed import any_rank, local_shard
from ..fp8.raised import config_named, finer
from .judging import REASONS, fresh_window, gather, settle, step_ranges, weigh
from .snapshots import restore_snapshot, take_snapshot
from .thresholds import GuardConfig

logger = logging.getLogger("hf_lowprec")

__all__ = ["Guard"]


def _device_of(model: torch.nn.Module | None) -> torch.device:
    if model is None:
        return torch.device("cpu")
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


class Guard:
    """The guard of one strategy and its model.

    Watch, on the device, with no host sync inside a step:

    - the training loss (a forward hook on the prepared model reads `output.loss` in training
      mode; micro-batches of one optimizer step are averaged) and the global gradient norm, each
      against its running mean and spread over the last `window` finite steps, outliers included
      (z-scores, as OLMo-core's skip-step optimizer does: a moved loss level becomes the norm);
    - non-finite gradients (the strategy's own `found_inf`);
    - per FP8 layer, the share of its non-zero inputs that its E4M3 casts flush to zero (counted
      by the layer's input cast, `FP8Linear.flush_now`, and collected after each training forward
      of the model in one graph, `judging.gather`).

    Act, in escalating order:

    1. a step whose loss or gradient norm lies more than `z_threshold` spreads above its mean
       (after the first `warmup` steps) is skipped on the device, through the same flag that
       skips a non-finite step, agreed over the data-parallel ranks (`judge`);
    2. at each `check` (the Trainer's logging steps, where it reads the device anyway; or by
       hand in a custom loop) the host reads the counters: after `rollback_after` faulty steps
       (outliers or non-finite) since the last snapshot, the model, the optimizer state and the
       strategy's scales are restored from an in-memory snapshot, and the run goes on with the
       next batches; a check with no fault since the last takes a new snapshot every
       `snapshot_every` steps, and each checkpoint save is a snapshot point (`saving`);
    3. an FP8 layer that flushed more than `max_flushed` of its inputs since the last check is
       raised one step (tensorwise → rowwise → BF16, `fp8.raised.finer`).

    Every action is logged as one warning naming what and why, counted in `precision/guard_*`
    metrics, and saved with the strategy's state: a resumed run re-raises the same layers. The
    guard is bounded: after `max_rollbacks` rollbacks, or once every FP8 layer is BF16 and still
    faulting, it says so and stops acting (the run goes on, as it would without the guard)."""

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
        self._flushing_seen = 0.0  # of which skipped because their FP8 casts flushed
        self._outliers_seen = 0.0  # of which skipped as outliers
        self._faults_since_snapshot = 0.0
        self.optimizer: torch.optim.Optimizer | None = None  # the inner optimizer (StrategyOptimizer sets it)
        self._snapshot: dict[str, Any] | None = None
        self._snapshot_step = -1
        self._snapshot_due = False  # a save is a snapshot point: taken before the next step or check
        self._device_state: dict[str, torch.Tensor] | None = None
        self._loss_sum: torch.Tensor | None = None  # Σ loss of this step's micro-batches, on the device
        self._losses_seen = 0  # how many (host)
        self._loss_shares = False  # each over the step's items (`num_items_in_batch`): their sum is its loss
        self._hook: Any = None
        self._last_flushed: dict[str, float] = {}
        # [flushed, non-zero] per watched layer (rows in `layers` order), on the device: [0] this
        # step's sums (zeroed by `weigh`), [1] the sums since the last check (zeroed by `check`).
        # One tensor: a model compiled whole traces the gathering hook, and aot_autograd refuses
        # two mutated inputs that share storage (its compiler may allocate two zero tensors as one).
        self._flushes: torch.Tensor | None = None
        self._gathered = False  # counts collected after a forward of the model in this step (host)
        self._checked_step = 0  # `steps` at the previous check

    # --- attach -------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        """Watch `model`: its loss, and the input cast of each FP8 layer."""
        from ..fp8 import FP8Linear

        self.model = model
        if self._hook is not None:
            self._hook.remove()
        self._hook = model.register_forward_hook(self._observe_loss, with_kwargs=True)
        for name, module in model.named_modules():
            if isinstance(module, FP8Linear):
                self.layers[name] = module
                module.watch_flushes = True  # its training forwards count their flushed inputs
        self._flushes = None
        for name, recipe in self.raised.items():  # raised before a resume: raise them again
            self._set_recipe(name, recipe)

    def detach(self) -> None:  # stop watching the model: an equal strategy took it over (`strategies.prepared`)
        self._hook = self._hook.remove() if self._hook is not None else None

    def _observe_loss(self, module: torch.nn.Module, args: Any, kwargs: dict, output: Any) -> None:
        """A training forward: its loss joins the step's sum (on the device; the host counts the
        micro-batches, so the step's graph is the same whatever their number), and a norm noted before it belongs to an earlier step
        (DeepSpeed steps inside backward, before the loop clips and notes): forgotten. A loss over
        the step's `num_items_in_batch` (the Trainer's) is a share of the step's: the sum is judged."""
        if not (module.training and torch.is_grad_enabled()):
            return
        self._gather_flushes()
        self.strategy.take_grad_norm()
        loss = getattr(output, "loss", None)
        if torch.is_tensor(loss) and loss.dim() == 0:
            if self._loss_sum is None or self._loss_sum.device != loss.device:
                self._loss_sum = torch.zeros((), device=loss.device)
            self._loss_sum.add_(loss.detach())
            self._losses_seen += 1
            self._loss_shares = kwargs.get("num_items_in_batch") is not None

    def _gather_flushes(self) -> None:
        """The flush counts this forward's FP8 layers left (`FP8Linear.flush_now`) into the
        step's and the check's sums: one graph for all of them (each rank its own, not agreed)."""
        layers = list(self.layers.values())
        counts = [layer.flush_now for layer in layers]
        present = next((c for c in counts if c is not None), None)
        if present is None:
            return
        device = present.device
        if self._flushes is None or self._flushes.device != device:
            self._flushes = torch.zeros(2, len(layers), 2, dtype=torch.int64, device=device)
        # A layer that did not run in this forward counts [0, 0] (a fresh tensor: rare).
        none = [torch.zeros(2, dtype=torch.int64, device=device) for c in counts if c is None][:1]
        gather(self._flushes, [c if c is not None else none[0] for c in counts])
        self._gathered = True
        for layer in layers:
            layer.flush_now = None

    # --- the step (no host sync) ---------------------------------------------------------
    def _state(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self._device_state is None or self._device_state["loss"].device != device:
            self._device_state = fresh_window(self.config.window, self.steps, device)
        return self._device_state

    def keep(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the strategy's step state that its gradient processing updates even on a
        skipped step (FP8-LM's gradient scale μ and its clean-step count:
        `guarded_step_state`), taken before it: an outlier step puts them back, while a
        non-finite step still moves them as the strategy decides. An FP16 loss scale is updated
        after the step, from its gradients' range, and moves on an outlier too (docs/guard.md)."""
        self._take_due_snapshot()
        state = getattr(self.strategy, "guarded_step_state", None)
        return [(t, t.clone()) for t in state()] if state is not None and not self.stopped else []

    def judge(
        self,
        optimizer: torch.optim.Optimizer,
        found_inf: torch.Tensor,
        kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """This step's skip flag: `found_inf`, an outlier loss or gradient norm, or FP8 casts that
        flushed (a step whose gradient saw inputs cast to zero is faulty from the first step on),
        agreed over the ranks in one all-reduce; the window takes the step's finite values (an
        outlier's too, not a non-finite or flushing step's); a step the guard skips restores
        `kept` (see `keep`). No host sync: two compiled graphs (`judging`), and the norm the
        loop's clipping measured where it clipped."""
        if not self._gathered:  # no forward of the watched model this step (a loop that called a
            self._gather_flushes()  # submodule): the counts its layers left, the last micro-batch's
        self._gathered = False
        for layer in self.layers.values():  # left by a recomputed forward (activation checkpointing)
            layer.flush_now = None
        if self.stopped:  # the run goes on as an unguarded one would
            self._drop_losses()
            self.steps += 1
            return found_inf
        params = [p for g in optimizer.param_groups for p in g["params"]]
        device = found_inf.device
        state = self._state(device)
        norm = self._grad_norm(params, device)
        losses = self._loss_sum if self._losses_seen and self._loss_sum is not None else None
        micro_batches = 1 if self._loss_shares else self._losses_seen  # shares sum to the step's loss
        # No autograd: a model compiled whole may hand over a loss sum that requires grad, which
        # in-place copies would pass on to the window (and `weigh` would compile again for it).
        with torch.no_grad():
            reasons, values = weigh(
                state,
                losses,
                norm,
                self._flushes,
                micro_batches=micro_batches,
                judged=self.steps >= self.config.warmup,
                z_threshold=self.config.z_threshold,
                warmup=self.config.warmup,
                max_flushed=self.config.max_flushed,
            )
            self._losses_seen = 0  # `weigh` set the sum to 0
            reasons = any_rank(reasons, params, getattr(self.strategy, "_data_parallel_group", None))
            skip = settle(state, found_inf, reasons, values, kept or [])
        self.steps += 1
        return skip

    def _drop_losses(self) -> None:
        if self._losses_seen and self._loss_sum is not None:
            self._loss_sum.zero_()
        self._losses_seen = 0

    def _grad_norm(self, params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The global gradient norm before clipping: the one the loop's clipping measured this step
        (`note_grad_norm`: no launch here), else measured as the strategy clips (FP8 and FP16
        gradients included), else of the local gradients (under ZeRO and FSDP2: this rank's shards)."""
        seen = self.strategy.take_grad_norm()
        if seen is not None:
            return seen.float().to(device)
        own = self.strategy.clip_own_grad_norm(params, math.inf)
        if own is not None:
            return own.float().to(device)
        grads = [local_shard(p.grad) for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=device)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)).float())

    # --- at a check (host reads allowed) ------------------------------------------------
    def check(self) -> list[dict[str, Any]]:
        """Read the counters and act: name the steps skipped since the last check, raise layers,
        roll back, snapshot. Reads the device (a sync): the Trainer calls it at logging steps.
        Returns the actions taken."""
        taken: list[dict[str, Any]] = []
        if self._device_state is None or self.model is None:
            return taken
        if self.stopped:  # no action, but the flushed shares logged are the layers' own since the
            self._read_flushed()  # last check (0 once BF16), not the ones that raised them
            return taken
        self._take_due_snapshot()
        state = self._device_state
        read = torch.cat([state["faults"].view(1), state["flushing"].view(1), state["outliers"].view(1), state["why"]])
        faults, flushing, outliers, *why = read.tolist()
        new_faults, self._faults_seen = faults - self._faults_seen, faults
        new_flushing, self._flushing_seen = flushing - self._flushing_seen, flushing
        new_outliers, self._outliers_seen = outliers - self._outliers_seen, outliers
        taken += self._name_skips(why, {2: new_outliers, 3: new_flushing})
        self._checked_step = self.steps
        taken += self._raise_layers()
        if self.stopped:  # raising the last layers stopped it
            return taken
        # Steps skipped because their casts flushed left no trace (and their layers are raised
        # now): a rollback is for faults that may have reached the state.
        since_snapshot = self._faults_since_snapshot + new_faults - new_flushing
        self._faults_since_snapshot = since_snapshot
        if since_snapshot >= self.config.rollback_after and self._snapshot is not None:
            if self.rollbacks >= self.config.max_rollbacks:
                self._stop(f"{self.rollbacks} rollbacks done, the limit (max_rollbacks)")
            else:
                taken.append(self._rollback(int(since_snapshot)))
        elif new_faults == 0 and self.steps - self._snapshot_step >= self.config.snapshot_every:
            self._take_snapshot()
        return taken

    def _name_skips(self, why: list[float], counted: dict[int, float]) -> list[dict[str, Any]]:
        """One "skip" action per reason the guard skipped steps for since the last check (outliers,
        flushing casts), naming the steps the ring of the last `window` still holds and counting
        the earlier ones (`counted`: skips per reason since the last check); the strategy's own
        non-finite skips are counted only. Steps are named as the Trainer's `global_step` after
        them (1 for the first; `self.steps` counts them), the ring's slots from 0."""
        window = self.config.window
        first = max(self._checked_step, self.steps - window)
        by_reason: dict[int, list[int]] = {r: [] for r, n in counted.items() if n > 0}
        for slot in range(first, self.steps):
            reason = int(why[slot % window])
            if reason in REASONS:
                by_reason.setdefault(reason, []).append(slot + 1)
        taken = []
        for reason, steps in sorted(by_reason.items()):
            earlier = int(counted.get(reason, 0)) - len(steps)
            named = f"step(s) {step_ranges(steps)}" if steps else "no step the window still holds"
            if earlier > 0:
                named += f" and {earlier} earlier one(s) (before step {first + 1})"
            what = f"{named}: the weights and optimizer state never took them"
            taken.append(self._act("skip", what, REASONS[reason].format(self.config)))
        return taken

    def _read_flushed(self) -> list[tuple[str, torch.nn.Module, float]]:
        """(name, layer, share of its non-zero inputs flushed since the last check) of every
        watched layer, read at once; the sums start again. A layer raised to BF16 casts
        nothing, so its share is 0."""
        if self._flushes is None:
            return []
        read = self._flushes[1].tolist()  # one read for every layer
        self._flushes[1].zero_()
        shares = []
        for (name, layer), (flushed, nonzero) in zip(self.layers.items(), read):
            share = flushed / nonzero if nonzero else 0.0
            self._last_flushed[name] = share
            shares.append((name, layer, share))
        return shares

    def _raise_layers(self) -> list[dict[str, Any]]:
        taken: list[dict[str, Any]] = []
        for name, layer, share in self._read_flushed():
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
        assert self.model is not None
        self._snapshot = take_snapshot(self.model, self.optimizer, self.strategy)
        self._snapshot_step = self.steps
        self._faults_since_snapshot = 0.0

    def saving(self) -> None:
        """A checkpoint save (the optimizer's `state_dict`) is a snapshot point: the snapshot is
        taken before the next step or check changes the state, in this run and in a run resumed
        from the checkpoint alike, so the two roll back to the same state (docs/guard.md). Not
        before the first step: Accelerate's `prepare` round-trips the state dict, and saves nothing."""
        if self.steps > 0 and not self.stopped:
            self._snapshot, self._snapshot_due, self._snapshot_step = None, True, self.steps
            self._faults_since_snapshot = 0.0

    def _take_due_snapshot(self) -> None:
        if self._snapshot_due and self.model is not None and not self.stopped:
            self._take_snapshot()
            self._snapshot_due = False

    def _rollback(self, faults: int) -> dict[str, Any]:
        assert self.model is not None and self._snapshot is not None
        restore_snapshot(self._snapshot, self.model, self.optimizer, self.strategy)
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
            out["precision/guard_flushing_steps"] = float(state["flushing"].item())
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
            "flushing_seen": self._flushing_seen,
            "outliers_seen": self._outliers_seen,
            "checked_step": self._checked_step,
            "faults_since_snapshot": self._faults_since_snapshot,
            "snapshot_step": self._snapshot_step,
            "snapshot_due": self._snapshot_due,
            "window": None if state is None else {k: v.tolist() for k, v in state.items()},
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.steps = int(saved.get("steps", 0))
        self.rollbacks = int(saved.get("rollbacks", 0))
        self.actions = list(saved.get("actions", []))
        self.stopped = str(saved.get("stopped", ""))
        self._faults_seen = float(saved.get("faults_seen", 0.0))
        self._flushing_seen = float(saved.get("flushing_seen", 0.0))
        self._outliers_seen = float(saved.get("outliers_seen", 0.0))
        self._checked_step = int(saved.get("checked_step", self.steps))
        self._faults_since_snapshot = float(saved.get("faults_since_snapshot", 0.0))
        # Saved before saves were snapshot points: the loaded state is one now.
        self._snapshot_step = int(saved.get("snapshot_step", self.steps))
        self._snapshot_due = bool(saved.get("snapshot_due", True))
        if self._snapshot_due:  # taken before the next step or check, as the saving run took it
            self._snapshot = None
        window = saved.get("window")
        if window is not None:
            device = self._device_state["loss"].device if self._device_state is not None else _device_of(self.model)
            self._device_state = {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in window.items()}
            for key, fresh in fresh_window(
                self.config.window, self.steps, device
            ).items():  # a checkpoint from before a counter existed
                self._device_state.setdefault(key, fresh)
            if len(window["loss"]) != self.config.window:  # resumed with another `window`: the counters
                # carry over, the history starts again (outliers judged after `warmup` new steps)
                for key in ("loss", "norm", "valid", "why"):
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
