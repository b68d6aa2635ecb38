"""FP8 references the tests hold the package to, written once and independently of it: the FP64
reference of a linear layer's three GEMMs, the FP64 product of dequantized FP8 operands with the
error bound of an FP8 GEMM, and a writer of FP8-published checkpoints (DeepSeek-V3 / Qwen3-FP8
format) that does not use the package's `quantize_published`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from tests.helpers import gamma, unit_roundoff

E4M3 = torch.float8_e4m3fn


class LinearReference(NamedTuple):
    """FP64 operands of a linear layer and its FP64 forward output and gradients."""

    x: torch.Tensor
    w: torch.Tensor
    grad_out: torch.Tensor
    y: torch.Tensor
    x_grad: torch.Tensor
    w_grad: torch.Tensor

    def run(self, layer: Callable, dtype: torch.dtype = torch.float32, device="cpu"):
        """(y, x's gradient, w's gradient) of `layer(x, w)` on the same operands cast to `dtype` on
        `device`, backward from the same output gradient; in the layer's dtype and device."""
        x = self.x.to(device, dtype).requires_grad_()
        w = self.w.to(device, dtype).requires_grad_()
        y = layer(x, w)
        y.backward(self.grad_out.to(device, dtype))
        return y.detach(), x.grad, w.grad


def fp64_linear_reference(m: int, k: int, n: int, transposed: bool = False, seed: int = 0) -> LinearReference:
    """The FP64 reference of a linear layer's three GEMMs. Drawn from `seed` in this order: x
    (m×k) from N(0, 1), the weight from N(0, 0.05²), n×k as `nn.Linear` stores it or k×n
    (`transposed`, transformers' Conv1D), the output gradient (m×n) from N(0, 1); then y = x·Wᵀ
    and the input and weight gradients, in FP64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    w = torch.randn((k, n) if transposed else (n, k), generator=g, dtype=torch.float64) * 0.05
    grad_out = torch.randn(m, n, generator=g, dtype=torch.float64)
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = x_ref @ w_ref if transposed else x_ref @ w_ref.t()
    y.backward(grad_out)
    return LinearReference(x, w, grad_out, y.detach(), x_ref.grad, w_ref.grad)


def dequantized(payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A per-tensor scaled FP8 operand in FP64 on the CPU: payload / scale (exact)."""
    return payload.cpu().double() / scale.cpu().double()


def fp64_product(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a·b, |a|·|b|) in FP64 of dequantized operands a (m×k) and b (k×n): the exact product of
    FP8 values (products of ≤ 4-bit significands with power-of-two scales are exact in FP64) and
    the magnitude its summation error is bounded by."""
    a, b = a.double(), b.double()
    return a @ b, a.abs() @ b.abs()


def gemm_error_bound(
    exact: torch.Tensor, total: torch.Tensor, k: int, accumulation_u: float = unit_roundoff(torch.float32)
) -> torch.Tensor:
    """|out − exact| of an FP8 GEMM with a BF16 output (`exact`, `total` from `fp64_product`):
    the products are exact, their sum in any order errs by at most γ_{K−1}·Σ|a||b| (unit roundoff
    `accumulation_u`, FP32's by default), then one rounding to BF16 (2^-8 relative)."""
    sum_error = gamma(k - 1, accumulation_u) * total
    return sum_error + unit_roundoff(torch.bfloat16) * (exact.abs() + sum_error)


def publish_fp8(bf16_dir, out_dir, per_tensor: bool = False) -> None:
    """Write the BF16 checkpoint in `bf16_dir` to `out_dir` in the published FP8 format, as a
    release quantizes every projection: each 2-D `…proj.weight` whose sides are whole 128-blocks
    (a Llama's attention and MLP projections, a Qwen3-MoE's experts' too) as an E4M3 `weight`
    with an FP32 `weight_scale_inv` per 128×128 block (scale_inv = block amax / 448, payload =
    w / scale_inv), the other tensors as they are, the config's `quantization_config` saying so.
    `per_tensor`: one scale per weight, shape (1,), and `weight_block_size` null."""
    bf16_dir, out_dir = Path(bf16_dir), Path(out_dir)
    tensors = {}
    for key, value in load_file(f"{bf16_dir}/model.safetensors").items():
        if not (key.endswith("proj.weight") and value.dim() == 2 and value.shape[0] % 128 == value.shape[1] % 128 == 0):
            tensors[key] = value
            continue
        rows, cols = value.shape
        if per_tensor:
            scale_inv = (value.double().abs().amax() / 448).float().reshape(1)
            payload = (value.double() / scale_inv.double()).clamp(-448, 448).to(E4M3)
            tensors[key], tensors[key.removesuffix("weight") + "weight_scale_inv"] = payload, scale_inv
            continue
        blocks = value.double().reshape(rows // 128, 128, cols // 128, 128)
        scale_inv = (blocks.abs().amax(dim=(1, 3)) / 448).float()
        payload = (blocks / scale_inv.double()[:, None, :, None]).clamp(-448, 448).reshape(rows, cols).to(E4M3)
        tensors[key], tensors[key.removesuffix("weight") + "weight_scale_inv"] = payload, scale_inv
    save_file(tensors, f"{out_dir}/model.safetensors", metadata={"format": "pt"})
    config = json.loads((bf16_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": None if per_tensor else [128, 128],
    }
    (out_dir / "config.json").write_text(json.dumps(config))
