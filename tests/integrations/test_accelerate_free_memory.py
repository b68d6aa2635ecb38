"""`accelerator.free_memory()` with PrecisionPlugin: what the loop frees is freed, a retry (Accelerate's
`find_executable_batch_size`) prepares a fresh model and optimizer as a first run, and an optimizer the
loop still holds is still trained, and counted, as before."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import find_executable_batch_size

from hf_lowprec.integrations.accelerate import PrecisionPlugin
from tests.helpers import batches, tiny_gpt2

STEPS = 3
DATA = batches(STEPS, batch=4, seq=16)
OOM = "CPU: out of memory."  # a message Accelerate's `should_reduce_batch_size` takes for an OOM


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern (NaN and -0.0 compared as bits)."""
    return t.detach().contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _prepared(plugin, accelerator, *, scheduler=False):
    model = tiny_gpt2(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    objects = [model, optimizer]
    if scheduler:
        objects.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1)))
    return plugin.prepare(accelerator, *objects) if plugin else accelerator.prepare(*objects)


def _train(plugin, accelerator, model, optimizer, batch_size, clip=None):
    norms = []
    for ids in DATA:
        loss = model(input_ids=ids[:batch_size], labels=ids[:batch_size]).loss
        plugin.backward(accelerator, loss)
        if clip is not None:
            norms.append(accelerator.clip_grad_norm_(model.parameters(), clip))
        optimizer.step(), optimizer.zero_grad()
    return [_bits(p) for p in model.parameters()], norms


@pytest.mark.parametrize("name", ["fp16-als", "fp16-mixed", "collage-plus"])
def test_a_retry_after_free_memory_trains_as_a_first_run(name):
    # The first try's optimizer, freed, was counted as a second one: "this would be optimizer 2 (two
    # models, a GAN's generator and discriminator)" under fp16-als / fp16-mixed, where stock re-prepares.
    accelerator, plugin, tried = Accelerator(cpu=True), PrecisionPlugin(name), []

    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size):
        accelerator.free_memory()
        tried.append(batch_size)
        model, optimizer = _prepared(plugin, accelerator)
        if batch_size == 4:  # out of memory in the first backward
            plugin.backward(accelerator, model(input_ids=DATA[0], labels=DATA[0]).loss)
            raise RuntimeError(OOM)
        return _train(plugin, accelerator, model, optimizer, batch_size)[0]

    retried = train()
    assert tried == [4, 3]
    accelerator, plugin = Accelerator(cpu=True), PrecisionPlugin(name)
    first, _ = _train(plugin, accelerator, *_prepared(plugin, accelerator), 3)
    assert all(torch.equal(a, b) for a, b in zip(retried, first, strict=True))


def _freed(name):
    """Weak references to a parameter, the optimizer (with its state) and the scheduler of a loop that
    stepped once, then `accelerator.free_memory(model, optimizer, scheduler)` and dropped them."""
    accelerator = Accelerator(cpu=True)
    plugin = PrecisionPlugin(name) if name else None
    model, optimizer, scheduler = _prepared(plugin, accelerator, scheduler=True)
    ids = DATA[0]
    loss = model(input_ids=ids, labels=ids).loss
    plugin.backward(accelerator, loss) if plugin else accelerator.backward(loss)
    optimizer.step(), scheduler.step(), optimizer.zero_grad()
    assert optimizer.optimizer.state  # the moments exist
    refs = [weakref.ref(o) for o in (next(model.parameters()), optimizer.optimizer, scheduler.scheduler)]
    accelerator.free_memory(model, optimizer, scheduler)
    return refs


@pytest.mark.parametrize("name", [None, "collage-plus", "fp16-als"])
def test_free_memory_frees_the_model_and_its_optimizer_state(name):
    # The plugin held every optimizer and scheduler it prepared: after free_memory, del and
    # gc.collect() collage-plus's parameters and optimizer (m, v, δθ) were alive; stock's (None) were not.
    refs = _freed(name)
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]


@pytest.mark.parametrize("name", ["fp16-als", "fp16-mixed"])
def test_a_second_optimizer_beside_one_still_held_is_refused_after_free_memory(name):
    accelerator, plugin = Accelerator(cpu=True), PrecisionPlugin(name)
    held = _prepared(plugin, accelerator)
    accelerator.free_memory()
    with pytest.raises(ValueError, match=r"would be optimizer 2.*free_memory"):
        _prepared(plugin, accelerator)
    assert held[1].optimizer.param_groups  # held through the refusal


@pytest.mark.parametrize("name", ["fp16-als", "fp16-mixed"])
def test_an_optimizer_held_past_free_memory_clips_its_unscaled_gradients(name):
    # The plugin forgets only what the loop dropped: Accelerate's `free_memory()` between two steps
    # leaves the held optimizer's gradients unscaled before clipping, the norms and weights as without it.
    runs = []
    for free in (False, True):
        accelerator, plugin = Accelerator(cpu=True), PrecisionPlugin(name)
        model, optimizer = _prepared(plugin, accelerator)
        if free:
            accelerator.free_memory()
        runs.append(_train(plugin, accelerator, model, optimizer, 4, clip=1.0))
    (weights, norms), (weights_freed, norms_freed) = runs
    assert all(1e-3 < float(n) < 1e3 for n in norms)  # unscaled: a scale of 2^16 would put them past 1e3
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(norms, norms_freed, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_freed, strict=True))
