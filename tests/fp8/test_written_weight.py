"""FP8-LM O2 on a GPU: the optimizer step writes the E4M3 weight the layer's next forward would cast
from the master it stored (`optim.rules.ScaledMasterFP8`), so an eager forward casts no weight after
the first step (issue #66). `compiling.gpu_paths` sends CPU tensors down the GPU's path.
"""

import pytest
import torch
from torch import nn

from hf_lowprec.compiling import gpu_paths
from hf_lowprec.fp8 import FP8Linear
from hf_lowprec.fp8 import linear as fp8_linear_module
from hf_lowprec.fp8.linear import quantize_weight
from hf_lowprec.fp8.scaled import get_fp8_weight_copy
from hf_lowprec.optim import FP8AdamW
from tests.helpers import assert_bits_equal


def _layer(margin: int, seed: int, weight_scale: float = 1.0) -> FP8Linear:
    torch.manual_seed(seed)
    dense = nn.Linear(96, 80, bias=False)
    with torch.no_grad():
        dense.weight.mul_(weight_scale)
    layer = FP8Linear.from_float(dense.half(), margin=margin)
    layer.scale_master_weight(margin)
    return layer


def _one_step(seed: int) -> tuple:
    """A layer, its FP8AdamW (the reference step) and an input, after one eager step on the GPU path."""
    layer = _layer(0, seed=seed)
    optimizer = FP8AdamW([layer.weight], lr=0.1, fused="reference", weight_decay=0.0)
    x = torch.randn(8, 96, dtype=torch.bfloat16)
    with gpu_paths():
        layer(x).float().sum().backward()
        optimizer.step()
    return layer, optimizer, x


def _casts(monkeypatch) -> list:
    calls = []
    original = fp8_linear_module.quantize_layer_weight
    monkeypatch.setattr(
        fp8_linear_module, "quantize_layer_weight", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    return calls


@pytest.mark.parametrize("fused", ["reference", "compiled"])
@pytest.mark.parametrize("margin", [0, 2])
def test_the_step_writes_the_weight_the_forward_would_cast(monkeypatch, fused, margin):
    """After each step (gradients over several binades, one step skipped on a non-finite flag, one
    weight decayed to 0) the written E4M3 payload and scale are the forward's cast of the stored
    master, bit for bit, and the next forward takes them without casting."""
    casts = _casts(monkeypatch)
    layer = _layer(margin, seed=margin)
    optimizer = FP8AdamW([layer.weight], lr=0.5, margin=margin, fused=fused, weight_decay=0.0)
    x = torch.randn(8, 96, dtype=torch.bfloat16)
    with gpu_paths():
        for step, (gain, flag) in enumerate([(1.0, 0.0), (4.0, 0.0), (1.0, 1.0), (1e-3, 0.0), (0.0, 0.0)]):
            casts.clear()
            layer(x).float().sum().backward()
            assert len(casts) == (1 if step == 0 else 0), step  # the first forward casts; then the step's copy
            copy = get_fp8_weight_copy(layer.weight)
            assert copy is not None and copy.margin == margin
            layer.weight.grad.mul_(gain * torch.logspace(-3, 3, 96).to(torch.float16))
            if gain == 0.0:  # the whole weight decays to zero: amax 0, scale 1
                with torch.no_grad():
                    layer.weight.zero_()
                layer(x)  # the master changed outside the optimizer: cast again, and written from zeros
            copy = get_fp8_weight_copy(layer.weight)
            optimizer.step(found_inf=torch.tensor(flag))
            optimizer.zero_grad()
            assert copy.holds(layer.weight)
            payload, scale = quantize_weight(layer.weight, margin, layer.master_scale)
            assert_bits_equal(copy.payload, payload, f"step {step}")
            assert_bits_equal(copy.scale, scale, f"step {step}")
    assert optimizer.paths_taken[fused] > 0


def test_a_weight_changed_after_the_step_is_cast_again(monkeypatch):
    """A write to the master outside the optimizer (a loaded checkpoint, a rollback, an in-place
    edit) bumps its version: the written copy is not taken, and the new cast replaces it."""
    casts = _casts(monkeypatch)
    layer, _, x = _one_step(seed=1)
    with gpu_paths():
        state = {k: v.clone() for k, v in layer.state_dict().items()}
        layer.load_state_dict({"weight": state["weight"] * 3})
        casts.clear()
        out = layer(x)
        assert len(casts) == 1
        payload, scale = quantize_weight(layer.weight, 0, layer.master_scale)
        assert_bits_equal(get_fp8_weight_copy(layer.weight).payload, payload)
        assert_bits_equal(get_fp8_weight_copy(layer.weight).scale, scale)
        layer._weight_cache = None
        assert_bits_equal(out, layer(x))


def test_no_copy_where_the_forward_casts_anyway(monkeypatch):
    """On a CPU (native optimizer kernels), under another optimizer, or with another recipe, the
    layer keeps no copy past the step: its memory is freed with the weight cache, as before."""
    x = torch.randn(8, 96, dtype=torch.bfloat16)
    layer = _layer(0, seed=2)
    layer(x)
    assert get_fp8_weight_copy(layer.weight) is None  # CPU path
    for make in (
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda p: FP8AdamW(p, lr=0.1, fused="reference", weight_decay=0.0),
    ):
        layer = _layer(0, seed=2)
        optimizer = make([layer.weight])
        with gpu_paths():
            layer(x).float().sum().backward()
            assert get_fp8_weight_copy(layer.weight) is not None
            if isinstance(optimizer, torch.optim.SGD):
                optimizer.step()
                assert get_fp8_weight_copy(layer.weight) is None and layer._weight_cache is None
    rowwise = FP8Linear.from_float(nn.Linear(96, 80, bias=False).half(), recipe="rowwise")
    rowwise.scale_master_weight()
    with gpu_paths():
        rowwise(x)
    assert get_fp8_weight_copy(rowwise.weight) is None


@pytest.mark.parametrize("change", ["load_state_dict", "in_place", "data_swap"])
def test_a_master_written_between_the_forward_and_a_skipped_step_is_cast_again(monkeypatch, change):
    """The copy records which state of the master it is the cast of (storage and version of the
    master and its scale): a write after the forward that cast it (a checkpoint loaded, an in-place
    edit, a swapped `.data`), then a skipped step (which writes nothing new), then another
    optimizer's step: the next forward does not take the old weight; it casts the master as it is."""
    casts = _casts(monkeypatch)
    layer = _layer(0, seed=3)
    optimizer = FP8AdamW([layer.weight], lr=0.1, fused="reference", weight_decay=0.0)
    other = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    x = torch.randn(8, 96, dtype=torch.bfloat16)
    with gpu_paths():
        layer(x).float().sum().backward()
        with torch.no_grad():
            if change == "load_state_dict":
                layer.load_state_dict({"weight": layer.state_dict()["weight"] * 3})
            elif change == "in_place":
                layer.weight.mul_(0.5)
            else:
                layer.weight.data = layer.weight.data * 0.5
        optimizer.step(found_inf=torch.tensor(1.0))
        other.step()
        casts.clear()
        layer(x)
        assert len(casts) == 1
        payload, scale = quantize_weight(layer.weight, 0, layer.master_scale)
        assert_bits_equal(layer._fp8_weight()[0], payload)
        assert_bits_equal(layer._fp8_weight()[1], scale)


def test_a_copy_no_forward_took_is_let_go_at_the_next_step():
    """After an eager step, a model that runs compiled (its forward casts in the graph) leaves the
    copy untaken: the next step does not write it and unlinks it, so its byte per parameter is
    freed and the optimizer steps the master alone."""
    from hf_lowprec.compiling import count_model_as_compiled

    layer, optimizer, x = _one_step(seed=4)
    with gpu_paths():
        assert get_fp8_weight_copy(layer.weight) is not None  # taken eagerly: written, kept
        try:
            count_model_as_compiled(True)
            layer(x).float().sum().backward()
        finally:
            count_model_as_compiled(False)
        optimizer.step()
        assert get_fp8_weight_copy(layer.weight) is None and layer._weight_cache is None
