"""`transformers.Seq2SeqTrainer` and `Seq2SeqTrainingArguments` with `precision_strategy=`.

The stock `prediction_step` calls `model.generate` outside `compute_loss_context_manager`: with
`predict_with_generate=True` the generation ran without the strategy's forward context (bf16-mixed
generated with FP32 GEMMs). Here the whole step runs in it, as the training forward does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import transformers

from .trainer import PrecisionArgumentsMixin, PrecisionTrainerMixin

__all__ = ["Seq2SeqTrainingArguments", "Seq2SeqTrainer", "launch_swaps"]


@dataclasses.dataclass
class Seq2SeqTrainingArguments(PrecisionArgumentsMixin, transformers.Seq2SeqTrainingArguments):
    """`transformers.Seq2SeqTrainingArguments` plus `precision_strategy` and `precision_options`."""


class Seq2SeqTrainer(PrecisionTrainerMixin, transformers.Seq2SeqTrainer):
    """`transformers.Seq2SeqTrainer` that applies `args.precision_strategy`, generation included."""

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ) -> tuple[float | None, torch.Tensor | None, torch.Tensor | None]:
        context = contextlib.nullcontext() if self.precision is None else self.precision.forward_context()
        with context:  # (the loss forward enters it again in compute_loss_context_manager: the same autocast)
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)


def launch_swaps() -> list[tuple[Any, str, Any, Any]]:
    """The names `hf-lowprec launch` swaps for these classes: (module, name, stock class, ours)."""
    import transformers.trainer_seq2seq as trainer_module
    import transformers.training_args_seq2seq as args_module

    args, trainer = transformers.Seq2SeqTrainingArguments, transformers.Seq2SeqTrainer
    return [
        (transformers, "Seq2SeqTrainingArguments", args, Seq2SeqTrainingArguments),
        (args_module, "Seq2SeqTrainingArguments", args, Seq2SeqTrainingArguments),
        (transformers, "Seq2SeqTrainer", trainer, Seq2SeqTrainer),
        (trainer_module, "Seq2SeqTrainer", trainer, Seq2SeqTrainer),
    ]
