"""One rank of a custom Accelerate loop with `PrecisionPlugin` (bf16-sr, whose stochastic-rounding
generators are strategy state) under Accelerate's FSDP2 (forced on CPU) and DeepSpeed ZeRO-2 (gloo):
2 steps, `accelerator.save_state`, 2 more steps; then a fresh model and optimizer `accelerator.load_state`
the save with its world size edited to 4 (refused), then with its version edited to 0.1.9, and train
the same 2 steps. Writes per engine the losses, the manifest, the refusal and the hf_lowprec.*
warnings; run by `_version_resume_worker` in its processes (`--engines accelerate-fsdp2,...`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from hf_lowprec.checkpoints.manifest import MANIFEST
from hf_lowprec.integrations.accelerate import PrecisionPlugin
from tests.distributed._fsdp2_worker import forced_fsdp2_accelerator
from tests.distributed._version_resume_worker import Caught
from tests.helpers import batches, rank_rows, tiny_gpt2

MICRO, LR = 2, 1e-3


def accelerator_for(engine: str):
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(True)  # one Accelerator per loop (each engine, each load)
    if engine == "fsdp2":
        return forced_fsdp2_accelerator()
    # DeepSpeed on CPU ranks: the gloo processes' PartialState (cpu=True), then Accelerate's DeepSpeed path.
    PartialState(cpu=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2}}
    try:
        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def loop(engine: str, seed: int):
    accelerator = accelerator_for(engine)
    plugin = PrecisionPlugin("bf16-sr")
    model = tiny_gpt2(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model, optimizer = plugin.prepare(accelerator, model, optimizer)
    if engine == "fsdp2":  # prepare left Accelerate's CPU type; a GPU keeps FSDP (forced_fsdp2_accelerator)
        from accelerate.utils import DistributedType

        accelerator.state.distributed_type = DistributedType.FSDP
    return accelerator, plugin, model, optimizer


def train(accelerator, plugin, model, optimizer, data) -> list[float]:
    losses = []
    for ids in data:
        ids = rank_rows(ids, MICRO)
        loss = model(input_ids=ids, labels=ids).loss
        plugin.backward(accelerator, loss)
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().float().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    return losses


def edit(saved: Path, case: str) -> None:
    """Rank 0: the manifest of `saved` says what `case` names."""
    manifest = json.loads((saved / MANIFEST).read_text())
    if case == "0.1.9":
        manifest["hf_lowprec_version"] = "0.1.9"
    elif case == "world":
        manifest["world_size"] = 4
    (saved / MANIFEST).write_text(json.dumps(manifest))


def run(engine: str, out: Path) -> dict:
    data = batches(4, batch=MICRO * dist.get_world_size())
    root = out / f"accelerate-{engine}"
    accelerator, plugin, model, optimizer = loop(engine, 0)
    first = train(accelerator, plugin, model, optimizer, data[:2])
    saved = root / "saved"
    accelerator.save_state(str(saved))
    result: dict = {"losses": first + train(accelerator, plugin, model, optimizer, data[2:])}
    manifest = saved / MANIFEST
    result["manifest"] = json.loads(manifest.read_text()) if manifest.exists() else None
    rank_file = saved / f"hf_lowprec_optimizer.rank{dist.get_rank()}-of-{dist.get_world_size()}.pt"
    result["rank_file_entry"] = rank_file.exists() and "hf_lowprec" in torch.load(rank_file, weights_only=True)
    dist.barrier()
    for case in ("world", "0.1.9"):
        if dist.get_rank() == 0:
            shutil.copytree(saved, root / case)
            if result["manifest"] is not None:
                edit(root / case, case)
    dist.barrier()
    # Another initialization; a refused load leaves it as it was, and the next one loads.
    accelerator, plugin, model, optimizer = loop(engine, 5)
    caught = Caught()
    logging.getLogger("hf_lowprec").addHandler(caught)
    try:
        for case in ("world", "0.1.9"):
            try:
                accelerator.load_state(str(root / case))
            except ValueError as err:
                result[f"{case}-refused"] = str(err)
        result["resumed"] = train(accelerator, plugin, model, optimizer, data[2:])
    finally:
        logging.getLogger("hf_lowprec").removeHandler(caught)
    result["warnings"] = caught.messages
    return result
