"""FP8-LM O2's FP8 weights written by the optimizer step (`optim.rules.ScaledMasterFP8`) on each
device: after every step, each FP8 layer's written E4M3 weight and scale are the cast its forward
would make of the stored master, bit for bit. On CUDA the step is a Triton graph that recomputes
the update in its reduction and its store kernels; on CPU `compiling.gpu_paths` takes the GPU's
path, its compiled step run as its eager source (tests/fp8/test_written_weight.py compiles it on
CPU); the forward runs eagerly on both, as under the Trainer's default."""

import contextlib

import torch

import hf_lowprec
from hf_lowprec.compiling import gpu_paths
from hf_lowprec.fp8 import FP8Linear
from hf_lowprec.fp8.linear import quantize_weight
from hf_lowprec.fp8.scaled import get_fp8_weight_copy
from hf_lowprec.testing import gpt2, token_batch
from tests.helpers import assert_bits_equal


def test_o2_writes_the_fp8_weights_its_forward_would_cast(device):
    strategy = hf_lowprec.get_strategy("fp8-lm-o2")
    model = strategy.prepare_model(gpt2(2).to(device))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-2)
    ids = token_batch().to(device)
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert layers
    on_cpu = contextlib.ExitStack()
    if device.type == "cpu":
        on_cpu.enter_context(gpu_paths())
        on_cpu.enter_context(torch.compiler.set_stance("force_eager"))
    with on_cpu:
        for step in range(3):
            with strategy.forward_context():
                loss = model(input_ids=ids, labels=ids).loss
            strategy.scale_loss(loss).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for layer in layers:
                copy = get_fp8_weight_copy(layer.weight)
                assert copy is not None and copy.holds(layer.weight), (step, layer)
                payload, scale = quantize_weight(layer.weight, layer.margin, layer.master_scale)
                assert_bits_equal(copy.payload, payload, f"step {step}")
                assert_bits_equal(copy.scale, scale, f"step {step}")
