"""What `hf_lowprec.Trainer` under a strategy changes from the stock `transformers.Trainer` (its
behaviour, files and refusals), from the strategies' declarations: `stock_differences(name)`, and
the README's table, `differences_markdown` (written by `scripts/readme_tables.py`).
"""

from __future__ import annotations

from ..scaling import AutomaticLossScaler
from ..strategies.interface import PrecisionStrategy

__all__ = ["stock_differences", "differences_markdown"]

_EVERY_STRATEGY = (
    "`precision_report.json` in the output directory",
    "`hf_lowprec_manifest.json` in each checkpoint, checked before a resume (missing or damaged files, "
    "another strategy's checkpoint are refused; `resume_reset`)",
    "the strategy's state under `hf_lowprec` in `optimizer.pt`",
    "`precision/…` metrics in the training logs",
    "`bf16`/`fp16` flags: refused unless they match the compute dtype",
)


def stock_differences(name: str | None) -> list[str]:
    """What `hf_lowprec.Trainer` with `precision_strategy=name` does that the stock Trainer does not."""
    if name is None:
        return []
    return [*_EVERY_STRATEGY, _optimizer_difference(name), *_own_differences(name)]


def _optimizer_difference(name: str) -> str:
    from ..strategies.registry import get_strategy

    if get_strategy(name).takes_user_optimizer:
        return (
            "yours: `optimizers=`, `optimizer_cls_and_kwargs`, `optim`, scheduler objects as with `bf16=True`/"
            "`fp16=True` (the AdamW `optim` names run the strategy's AdamW)"
        )
    return (
        "its own AdamW: `optimizers=`, `optimizer_cls_and_kwargs`, a non-AdamW `optim` refused "
        "(a scheduler over `trainer.create_optimizer()` works)"
    )


def _own_differences(name: str) -> list[str]:
    from ..strategies.registry import get_strategy

    strategy = get_strategy(name)
    found = []
    if isinstance(getattr(strategy, "scaler", None), AutomaticLossScaler):  # (fp16-als) clips, does not skip
        found.append(
            "an inf gradient is clipped to ±65504 and the step taken (`precision/clipped_elements`; the logged "
            "`grad_norm` is the clipped gradients'); a step with NaN gradients is skipped and counted"
        )
    elif strategy.skips_nonfinite:
        found.append("a step with inf/NaN gradients is skipped and counted")
    if type(strategy).scale_loss is not PrecisionStrategy.scale_loss:
        found.append("the strategy scales the loss (`precision/loss_scale` logged)")
    if strategy.param_dtype != PrecisionStrategy.param_dtype:
        dtype = str(strategy.param_dtype).removeprefix("torch.")
        found.append(f"weights trained and saved in {dtype} (`save_full_precision` saves FP32)")
    converts = type(strategy).convert_model is not PrecisionStrategy.convert_model
    if strategy.uses_fp8_gemm or (converts and strategy.param_dtype == PrecisionStrategy.param_dtype):
        found.append("linear layers swapped for FP8 ones")
    return found


def differences_markdown() -> str:
    """The README table: strategies with the same differences from the stock Trainer on one row."""
    from ..strategies.registry import available_strategies

    rows: dict[tuple[str, ...], list[str]] = {}
    for name in available_strategies():
        rows.setdefault((_optimizer_difference(name), *_own_differences(name)), []).append(f"`{name}`")
    lines = [
        "| `precision_strategy` | optimizer | also differs from the stock `transformers.Trainer` |",
        "|---|---|---|",
        "| unset (also under `hf-lowprec launch`) | stock | nothing: stock files, resume and errors (but a "
        "checkpoint a strategy saved, and a model a strategy bound FP8 layers or hooks to, are refused; a "
        "`SilentPrecisionWarning` when BF16/FP16 weights meet a plain AdamW) |",
        f"| every strategy | — | {'; '.join(_EVERY_STRATEGY)} |",
    ]
    for (optimizer, *extra), names in rows.items():
        lines.append(f"| {', '.join(names)} | {optimizer} | {'; '.join(extra) or '—'} |")
    return "\n".join(lines) + "\n"
