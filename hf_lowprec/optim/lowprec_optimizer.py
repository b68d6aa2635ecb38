"""Common base for optimizers whose state tensors keep their own dtypes."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..distributed import DTensor, local_shard, written_since, written_version

__all__ = ["LowPrecisionOptimizer", "TrackedUpdate", "seed_from_run"]

_WRITTEN = (-1, -1, -1)  # a record no version equals: the parameter counts as written before the next step


def seed_from_run() -> int:
    """A seed for stochastic rounding drawn from the run's seed, leaving the global RNG where it was.

    Drawing from the global generator would shift every later dropout mask against the same run without a
    strategy (`transformers.set_seed` seeds it before the optimizer is built).
    """
    generator = torch.Generator().manual_seed(torch.initial_seed())
    return int(torch.randint(0, 2**62, (), generator=generator).item())


class TrackedUpdate:
    """What one parameter looked like around one step, for the lost-arithmetic metrics.

    Args:
        group: index of the parameter group.
        param: the parameter.
        before: the value the optimizer held before the step (`held_value`, FP64).
        after: the value it held right after the step (`held_value`, FP64).
        update: the update the optimizer intended to add (Δθ), at least FP32.
    """

    __slots__ = ("after", "before", "group", "param", "update")

    def __init__(
        self, group: int, param: torch.Tensor, before: torch.Tensor, after: torch.Tensor, update: torch.Tensor
    ):
        self.group = group
        self.param = param
        self.before = before
        self.after = after
        self.update = update


class LowPrecisionOptimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` whose state survives `load_state_dict` in its own dtypes.

    `torch.optim.Optimizer.load_state_dict` casts every floating state tensor (and uint8/FP8
    payloads) to the parameter's dtype; a BF16 error component or an FP8 moment would be
    silently widened or narrowed. Subclasses keep every state tensor exactly as saved.

    Subclasses declare `state_roles`, mapping a state key to the kind of memory it is
    ("optimizer" for moments, "extra" for MCF components, master weights and scales,
    "gradient" for gradients kept in optimizer state), which `hf_lowprec.memory` reads.

    Lost-arithmetic tracking (docs/algorithms.md §1): the metrics are taken on the value the
    optimizer really holds for a parameter, `held_value(param)`: the parameter itself by
    default, θ + δθ for an expansion (Collage, Kahan), the master for a master-weight scheme.
    When `track_updates` is true, `step()` implementations take `before = held_value(param)`
    and, after updating, call `_track(group_index, param, before, update)`, which records
    `held_value(param)` as the value after; the records stay in `tracked` until the caller
    clears them. Tracking only copies, so the trajectory is unchanged.

    Writes outside the step: a parameter whose state completes it (δθ, a master) records the version
    counter and storage of its values after each step (`_mark_written`, `distributed.written_version`:
    host values every in-place write or `.data` assignment changes); one written since
    (`load_state_dict` of the model, weight clipping, a re-init, `vector_to_parameters`) is taken as
    written before the next step or export (`_written_elsewhere`), as FP32 AdamW takes it. A load of
    the state as `state_dict()` handed it out, unwritten since, keeps the record (`_holds_own_state`);
    any other load (a checkpoint's, also one written into these tensors in place) starts it again.
    """

    state_roles: ClassVar[dict[str, str]] = {}

    def __init__(self, params: Any, defaults: dict[str, Any]):
        super().__init__(params, defaults)
        self.track_updates = False
        self.tracked: list[TrackedUpdate] = []
        self._written: dict[torch.Tensor, tuple[int, int, int]] = {}
        self._handed_out: dict[int, tuple[int, int, int]] = {}  # state_dict()'s tensors: id → version
        self._handed_params: dict[torch.Tensor, tuple[int, int, int]] = {}  # and the weights' versions then

    def accept_parameter_values(self) -> None:
        """Take every parameter's value as the one its state completes, until the next step:
        `load_state_dict` calls it, so a resume keeps δθ and the masters whichever of model and
        optimizer it loads first (`watch_parameter_values` once both are loaded)."""
        self._written.clear()

    def watch_parameter_values(self) -> None:
        """Take every parameter's value as the one its state completes, and any later write as made
        outside the step: once weights and this state were both restored (the Trainer's resume and
        best-model load, the guard's rollback), so that a write before the next step (a callback's
        `on_train_begin`, `model.load_state_dict` between two `train()` calls) is where it continues.
        Subclasses give each parameter's rule through `composition` (`optim.adamw.AdamW`)."""
        for group in self.param_groups:
            for param in group["params"]:
                if self.state.get(param):
                    self._mark_written([param], self.composition(param, group).rule)

    def _mark_written(self, params: Any, rule: Any) -> None:
        """Record the version of each of `params`, if `rule`'s state completes them (δθ, a master)."""
        if rule.compensation_key or rule.master_key:
            for param in params:
                self._written[param] = written_version(param)

    def move_written(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """`new` took `old`'s place in the groups and its state (FSDP2's shard of it, cut from its
        values): the record goes with it, written where `old` was written since its record."""
        recorded = self._written.pop(old, None)
        if recorded is not None:
            self._written[new] = _WRITTEN if written_since(old, recorded) else written_version(new)

    def _written_elsewhere(self, param: torch.Tensor) -> bool:
        """Whether `param` was written since this optimizer last wrote it (host-side: no sync)."""
        recorded = self._written.get(param)
        return recorded is not None and written_since(param, recorded)

    def _restart_if_written(self, param: torch.Tensor, rule: Any, state: dict[str, Any]) -> None:
        """`rule.restart_` (`optim.rules.Rule`) where `param` was written since this optimizer wrote it."""
        if state and self._written_elsewhere(param):
            rule.restart_(local_shard(param.detach()), {key: local_shard(value) for key, value in state.items()})
            self._mark_written([param], rule)

    def held_value(self, param: torch.Tensor) -> torch.Tensor:
        """The value this optimizer holds for `param`, as a new FP64 tensor of its shape.

        Override when the parameter is not the whole story: an expansion returns θ + δθ,
        a master-weight scheme its master in the parameter's real units.
        """
        return param.detach().double()

    def full_precision_value(self, param: torch.Tensor) -> torch.Tensor:
        """`held_value(param)` rounded once to FP32: what a full-precision checkpoint stores."""
        return self.held_value(param).float()

    def _track(self, group: int, param: torch.Tensor, before: torch.Tensor, update: torch.Tensor) -> None:
        after = self.held_value(param)
        if isinstance(after, DTensor):  # FSDP2: the metrics are taken on this rank's shard
            after = after.to_local()
        self.tracked.append(TrackedUpdate(group, param, before, after, update))

    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        self._handed_out = {
            id(value): written_version(value)
            for state in state_dict["state"].values()
            for value in state.values()
            if torch.is_tensor(value)
        }
        self._handed_params = {p: written_version(p) for g in self.param_groups for p in g["params"]}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_state = state_dict["state"]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        own = self._holds_own_state(saved_state, saved_ids, params)
        self._handed_out, handed = {}, self._handed_params
        self._handed_params = {}
        super().load_state_dict(state_dict)
        if not own:
            self.accept_parameter_values()
        else:  # a weight written since `state_dict()` was loaded with this state (a resume in one process)
            for param in [p for p in self._written if p in handed and written_since(p, handed[p])]:
                self._written[param] = written_version(param)
        for saved_id, param in zip(saved_ids, params):
            if saved_id not in saved_state:
                continue
            restored = {}
            for key, value in saved_state[saved_id].items():
                if torch.is_tensor(value):
                    device = value.device if key == "step" and value.device.type == "cpu" else param.device
                    value = value.to(device=device, copy=True)
                restored[key] = value
            self.state[param] = restored

    def _holds_own_state(self, saved_state: dict[Any, Any], saved_ids: list[Any], params: list[Any]) -> bool:
        """Whether `saved_state` is this optimizer's state as `state_dict()` last handed it out, parameter
        for parameter, none of it written since: a load that restores nothing (Accelerate's
        `AcceleratedOptimizer` loads `state_dict()` back as it wraps an optimizer, moved to its device),
        so the writes recorded before stay recorded. A load written into those tensors in place
        (torch.distributed.checkpoint's, FSDP2's sharded checkpoints) or another state restores a
        checkpoint: the record starts again from it."""
        if len(saved_ids) != len(params):
            return False
        for saved_id, param in zip(saved_ids, params):
            mine, saved = self.state.get(param, {}), saved_state.get(saved_id, {})
            if mine.keys() != saved.keys():
                return False
            for key, value in mine.items():
                if torch.is_tensor(value) and not self._handed_out_unchanged(value, saved[key]):
                    return False
        return True

    def _handed_out_unchanged(self, value: torch.Tensor, saved: Any) -> bool:
        """Whether `saved` is the state tensor `value` as `state_dict()` handed it out, and `value` was not
        written since: `value` itself, an alias, or a copy on its device with its bits (`tensor.to(device)`
        copies from "cpu" to "cpu:0"; a copy to another device is taken as another state)."""
        handed = self._handed_out.get(id(value))
        if handed is None or written_version(value) != handed or not torch.is_tensor(saved):
            return False
        if saved is value or written_version(saved) == handed:  # the same storage and version counter
            return saved.shape == value.shape and saved.stride() == value.stride()
        same_kind = saved.device == value.device and saved.dtype == value.dtype and type(saved) is type(value)
        if not same_kind or saved.shape != value.shape:
            return False
        bits = [local_shard(t).reshape(-1).view(torch.uint8) for t in (saved, value)]  # FP8 and NaN alike
        return bits[0].shape == bits[1].shape and torch.equal(*bits)
