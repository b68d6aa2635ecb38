"""Common base for optimizers whose state tensors keep their own dtypes."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

__all__ = ["LowPrecisionOptimizer", "TrackedUpdate"]


class TrackedUpdate:
    """What one parameter looked like around one step, for the lost-arithmetic metrics.

    Args:
        group: index of the parameter group.
        param: the parameter (its value after the step is read from it).
        before: a copy of the parameter before the step, in the parameter's dtype.
        update: the update the optimizer intended to add (Δθ), at least FP32.
    """

    __slots__ = ("group", "param", "before", "update")

    def __init__(self, group: int, param: torch.Tensor, before: torch.Tensor, update: torch.Tensor):
        self.group = group
        self.param = param
        self.before = before
        self.update = update


class LowPrecisionOptimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` whose state survives `load_state_dict` in its own dtypes.

    `torch.optim.Optimizer.load_state_dict` casts every floating state tensor (and uint8/FP8
    payloads) to the parameter's dtype; a BF16 error component or an FP8 moment would be
    silently widened or narrowed. Subclasses keep every state tensor exactly as saved.

    Subclasses declare `state_roles`, mapping a state key to the kind of memory it is
    ("optimizer" for moments, "extra" for MCF components, master weights and scales,
    "gradient" for gradients kept in optimizer state), which `hf_lowprec.memory` reads.

    Lost-arithmetic tracking: when `track_updates` is true, `step()` implementations call
    `_track(group_index, param, before, update)` for each parameter; the records are left in
    `tracked` until the caller clears them. Tracking only copies, so the trajectory is unchanged.
    """

    state_roles: ClassVar[dict[str, str]] = {}

    def __init__(self, params: Any, defaults: dict[str, Any]):
        super().__init__(params, defaults)
        self.track_updates = False
        self.tracked: list[TrackedUpdate] = []

    def _track(self, group: int, param: torch.Tensor, before: torch.Tensor, update: torch.Tensor) -> None:
        self.tracked.append(TrackedUpdate(group, param, before, update))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_state = state_dict["state"]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
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
