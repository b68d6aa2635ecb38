"""FP16 loss scaling: Graphcore's automatic loss scaling, GradScaler's helpers, running-mean accumulation.

docs/algorithms.md §5 and §6. Plain torch: no Trainer, Accelerate or DeepSpeed import. One
module per piece: `als` (the histogram scaler, decided on the device), `tallies` (its counts,
written for compiled graphs: a GPU's few launches a step), `loss_scale` (setting
checks, the FP32 norm of FP16 and BF16 gradients, GradScaler agreeing over FSDP2 ranks, the step that
skips on a device flag) and `running_mean` (micro-batch accumulation without FP16 overflow).
"""

from .als import AutomaticLossScaler
from .loss_scale import (
    FP16_MAX,
    AgreeingGradScaler,
    check_loss_scale,
    check_loss_scaler_settings,
    check_norm_type,
    clip_grad_norm_,
    narrow_grad_norm,
    step_unless,
)
from .running_mean import RunningMeanGradients, running_mean_

__all__ = [
    "FP16_MAX",
    "AgreeingGradScaler",
    "AutomaticLossScaler",
    "RunningMeanGradients",
    "check_loss_scale",
    "check_loss_scaler_settings",
    "check_norm_type",
    "clip_grad_norm_",
    "narrow_grad_norm",
    "running_mean_",
    "step_unless",
]
