"""The peer rows a plan prices beside the package's strategies, driven as strategies are:
`ANCHOR` (torch autocast to BF16 with `AdamW(fused=True)`, what `bf16=True` with
`optim="adamw_torch_fused"` runs) and `TORCHAO` (torchao's float8 training under the anchor's
recipe, where torchao is installed).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ANCHOR", "PEERS", "TORCHAO", "TorchAMP", "TorchAOFloat8"]

ANCHOR = "torch-amp"
# torchao's float8 training (tensorwise, LM head kept), under the anchor's autocast and fused
# AdamW, as the device check's `e2e` row runs it; counted where torchao is installed.
TORCHAO = "torchao-float8"
PEERS = (ANCHOR, TORCHAO)


class TorchAMP:
    """The anchor as a strategy: torch autocast to BF16 over FP32 weights, torch's clipping and
    `AdamW(fused=True)` (what `bf16=True` with `optim="adamw_torch_fused"` runs)."""

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def forward_context(self) -> Any:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_gradients(self, optimizer: Any) -> None:
        pass

    def clip_grad_norm(self, params: Any, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(params), max_norm)

    def process_gradients(self, optimizer: Any) -> None:
        pass

    def optimizer_step(self, optimizer: Any) -> None:
        optimizer.inner.step()

    def create_optimizer(self, params: Any, **kwargs: Any) -> Any:
        strategy = self

        class Stepper:
            inner = torch.optim.AdamW(params, fused=True, **kwargs)

            def step(self) -> None:
                strategy.process_gradients(self)
                strategy.optimizer_step(self)

            def zero_grad(self, set_to_none: bool = True) -> None:
                self.inner.zero_grad(set_to_none=set_to_none)

        return Stepper()


class TorchAOFloat8(TorchAMP):
    """The torchao peer: `convert_to_float8_training` (tensorwise) on every linear layer but the
    LM head, then the anchor's recipe."""

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as error:
            raise ValueError(f"the {TORCHAO} row needs torchao (pip install torchao): {error}") from error
        config = Float8LinearConfig.from_recipe_name("tensorwise")
        return convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn != "lm_head")
