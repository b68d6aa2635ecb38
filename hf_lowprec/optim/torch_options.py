"""torch.optim.AdamW's own arguments (amsgrad, maximize, foreach, capturable, differentiable, fused,
decoupled_weight_decay) as this package's AdamW meets them: accepted at the values that change
nothing here, refused by name, with the reason and the fix, at any other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["IMPLEMENTATION_SWITCHES", "TORCH_ONLY_KEYS", "check_keyword_options", "check_torch_group_options"]

#: torch's switches between its own implementations of one update (which kernel, CUDA-graph capture).
IMPLEMENTATION_SWITCHES = ("foreach", "fused", "capturable")

# Each torch-only argument: the values at which it changes nothing here, and why any other is refused.
_ACCEPTED: dict[str, tuple[Any, ...]] = {
    "amsgrad": (False,),
    "maximize": (False,),
    "foreach": (None, False),
    "capturable": (False,),
    "differentiable": (False,),
    "decoupled_weight_decay": (True,),
    "fused": (None,),
}
_WHY = {
    "amsgrad": "AMSGrad (a running maximum of v) has no counterpart in this AdamW: drop amsgrad, or use "
    "torch.optim.AdamW(amsgrad=True) on FP32 parameters",
    "maximize": "this AdamW minimizes: drop maximize and minimize the negated objective (loss = -objective)",
    "foreach": "foreach picks one of torch's implementations; here `fused` picks the implementation "
    "('auto', the default, runs the fastest that works): drop foreach",
    "capturable": "this AdamW has no mode for stepping inside a CUDA-graph capture: drop capturable",
    "differentiable": "this AdamW steps under torch.no_grad, so no gradient flows through its update: drop "
    "differentiable, or use torch.optim.AdamW(differentiable=True) on FP32 parameters",
    "decoupled_weight_decay": "this AdamW decays decoupled (θ ← θ − lr·λ·θ); the L2 decay of Adam, added to the "
    "gradient, has no counterpart here: drop decoupled_weight_decay, or use torch.optim.Adam",
    "fused": "here `fused` names the implementation, not torch's fused-kernel switch: pass fused='auto' (the "
    "default: the fastest path that runs), 'native', 'compiled' or 'reference' (eager), or drop it",
}
#: The keys of torch.optim.AdamW's parameter groups that this AdamW does not read.
TORCH_ONLY_KEYS = tuple(_ACCEPTED)


def _refuse(owner: str, name: str, value: Any) -> None:
    if not any(value is accepted for accepted in _ACCEPTED[name]):
        raise ValueError(f"{owner}: {name}={value!r} (an argument of torch.optim.AdamW): {_WHY[name]}")


def check_keyword_options(
    owner: str, fused: Any, options: dict[str, Any], extra_options: Iterable[str]
) -> tuple[str, dict[str, Any]]:
    """(`fused`, `options` without torch.optim.AdamW's own arguments) for an AdamW whose group options
    beyond the hyper-parameters are `extra_options`: torch's arguments at values that change nothing
    here are dropped (fused=None is 'auto'), at any other they raise ValueError naming them; another
    unknown name raises TypeError."""
    for name in TORCH_ONLY_KEYS:
        if name in options:
            _refuse(owner, name, options[name])
    if fused is None or isinstance(fused, bool):
        _refuse(owner, "fused", fused)
        fused = "auto"
    unknown = sorted(set(options) - set(extra_options) - set(_ACCEPTED))
    if unknown:
        raise TypeError(f"{owner} got unexpected argument(s) {unknown}")
    return fused, {name: value for name, value in options.items() if name not in _ACCEPTED}


def check_torch_group_options(owner: str, group: dict[str, Any]) -> None:
    """Raise ValueError for a group key of torch.optim.AdamW at a value this AdamW would not honour
    (a group's `fused` string is this package's mode, not torch's switch, and is left alone)."""
    for name in TORCH_ONLY_KEYS:
        if name in group and not (name == "fused" and isinstance(group[name], str)):
            _refuse(owner, name, group[name])
