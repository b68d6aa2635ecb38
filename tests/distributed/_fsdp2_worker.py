"""One rank of the FSDP2 tests: every strategy that trains under FSDP2, in one launch.

Started by `tests/deepspeed/_launch.py` as RANK/WORLD_SIZE processes (gloo, CPU). For each
strategy it trains the tiny GPT-2 in one process on the whole batches (the reference), then
sharded with `strategy.shard` (each rank half of every batch), and records: losses, the
pre-clip gradient norms, what the optimizer state holds (dtypes, DTensor placements, local
shard shapes), the model-state bytes on this rank, the seeded state before the first step,
the full-precision export before and after training, and whether a sharded checkpoint
(torch.distributed.checkpoint) taken after step 2 continues bit for bit. Results go to
`<out>/rank<r>.json`, written before the process exits, with "complete": true at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from hf_lowprec import get_strategy  # noqa: E402
from hf_lowprec.distributed import local_shard  # noqa: E402
from hf_lowprec.engines.fsdp2 import load_sharded, save_sharded, shard_model  # noqa: E402
from hf_lowprec.engines.traffic import fsdp2_step_bytes  # noqa: E402
from hf_lowprec.fp8.scaled import get_master_scale  # noqa: E402
from hf_lowprec.integrations.accelerate import PrecisionPlugin  # noqa: E402
from tests.helpers import batches, fp32_gradient_norms, nbytes, rank_rows, tiny_gpt2  # noqa: E402

MICRO = 2  # samples per rank per step; the one-process reference takes all ranks' samples
LR = 1e-3
LONG_STEPS = 20  # the strategies enabled for FSDP2 with their loss scaler or scales: losses over 20 steps
MAX_NORM = 1.0  # below the tiny model's first gradient norms (≈1.6): clipping is active


def clip(strategy, model, optimizer):
    """Clip the unscaled gradients to MAX_NORM as `strategy.train_step` does; the pre-clip norm."""
    strategy.unscale_gradients(optimizer.optimizer)
    norm = strategy.clip_grad_norm(list(model.parameters()), MAX_NORM)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM) if norm is None else norm


def train(
    strategy,
    model,
    optimizer,
    data,
    sharded: bool,
    clipping: bool = True,
    digests: list | None = None,
    grad_norms: list | None = None,
) -> tuple[list[float], list[float]]:
    """Losses of the whole global batch and pre-clip gradient norms (none unclipped), per step;
    `digests` collects the weights' digest after every step, `grad_norms` the first-order terms
    of `first_order_bound` at the weights each step starts from (one process only)."""
    losses, norms = [], []
    for ids in data:
        if grad_norms is not None:
            grad_norms.append(fp32_gradient_norms(strategy, model, optimizer, ids))
        ids = rank_rows(ids, MICRO) if sharded else ids
        with strategy.forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        strategy.scale_loss(loss).backward()
        if clipping:
            norm = clip(strategy, model, optimizer)
            norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        else:
            strategy.unscale_gradients(optimizer.optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if digests is not None:
            digests.append(digest(model))
        value = loss.detach().float().clone()
        if sharded:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses, norms


class Collectives:
    """Bytes each rank receives from every all-gather and sends into every reduce-scatter, and
    the all-reduces run, counted at torch.distributed's functions (FSDP2 calls
    `all_gather_single` and `reduce_scatter_single`). Installed once per process."""

    def __init__(self) -> None:
        self.gathered: list[int] = []
        self.reduce_scattered: list[int] = []
        self.all_reduces = 0
        for name in ("all_gather_single", "all_gather_into_tensor"):
            self._wrap(name, lambda output, *_a, **_k: self.gathered.append(output.numel() * output.element_size()))
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            self._wrap(name, self._count_reduce_scatter)
        self._wrap("all_reduce", self._count_reduce)

    def _wrap(self, name: str, count) -> None:
        original = getattr(dist, name, None)
        if original is None:
            return

        def wrapped(*args, **kwargs):
            count(*args, **kwargs)
            return original(*args, **kwargs)

        setattr(dist, name, wrapped)

    def _count_reduce_scatter(self, *args, **kwargs) -> None:
        source = kwargs.get("input", args[1] if len(args) > 1 else None)
        self.reduce_scattered.append(source.numel() * source.element_size())

    def _count_reduce(self, *_args, **_kwargs) -> None:
        self.all_reduces += 1

    def mark(self) -> tuple[int, int]:
        return len(self.gathered), len(self.reduce_scattered)

    def since(self, mark: tuple[int, int]) -> dict[str, int]:
        return {"all_gather": sum(self.gathered[mark[0] :]), "reduce_scatter": sum(self.reduce_scattered[mark[1] :])}


COLLECTIVES: Collectives | None = None  # set in main


def plain(t):
    """The tensor holding this rank's values (an FP8-LM weight shard: its storage, e.g. O2's FP16
    payload, which FSDP2 sees as FP32 real values)."""
    return local_shard(t)


def state_tensors(optimizer):
    return [(k, v) for s in optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)]


def state_dtypes(optimizer) -> dict[str, list[str]]:
    out: dict[str, set] = {}
    for key, value in state_tensors(optimizer):
        if value.dim() > 0:
            out.setdefault(key, set()).add(str(value.dtype))
    return {k: sorted(v) for k, v in out.items()}


def model_state_bytes(model, optimizer, grads_bytes: int) -> dict[str, int]:
    """This rank's bytes: parameters, gradients (measured before the step), optimizer state
    shaped like parameters, and the rest (0-dim scales; step counters are Python ints)."""
    params = [plain(p) for p in model.parameters()]
    states = [plain(v) for _, v in state_tensors(optimizer)]
    return {
        "params": nbytes(params),
        "grads": grads_bytes,
        "states": nbytes(s for s in states if s.dim() > 0),
        "unshardable": nbytes(s for s in states if s.dim() == 0),
    }


def grad_bytes_hook(optimizer, record: list):
    optimizer.register_step_pre_hook(
        lambda opt, *_: record.append(
            nbytes(plain(p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None)
        )
    )


def state_l1(optimizer) -> float:
    """Σ|x| over this rank's (local) floating-point state tensors shaped like their parameter (a
    seeded δθ; not 8-bit codes, whose zero is not 0, nor per-group scales), FP64: before the
    first step."""
    return sum(
        float(plain(v).double().abs().sum())
        for param, state in optimizer.state.items()
        for v in state.values()
        if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0 and v.shape == param.shape
    )


def digest(model) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        t = t.full_tensor() if isinstance(t, DTensor) else t
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def dict_digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def shards_like_params(optimizer) -> dict:
    """Every state tensor of a parameter: a DTensor with the parameter's placements and local
    shard shape, or laid out per shard (a plain tensor that is not shaped like the shard: groups
    or blocks padded per shard); counts of those and of the others."""
    good = per_shard = bad = 0
    for param, state in optimizer.state.items():
        for _key, value in state.items():
            if not torch.is_tensor(value) or value.dim() == 0:
                continue
            ok = (
                isinstance(value, DTensor)
                and value.placements == param.placements
                and value.shape == param.shape
                and value.to_local().shape == param.to_local().shape
            )
            own = not ok and not isinstance(value, DTensor) and value.shape != plain(param).shape
            good, per_shard, bad = good + ok, per_shard + own, bad + (not ok and not own)
    return {"sharded_like_param": good, "per_shard": per_shard, "not": bad}


def export_check(strategy, model, optimizer) -> dict:
    """`full_precision_state_dict` under FSDP2: rank 0 gets every key in FP32, others nothing.
    On rank 0, each updated weight rounds back to the BF16/FP32 parameter exactly and lies within
    one FP32 ulp of θ + δθ (or the master) computed here from gathered shards."""
    full = strategy.full_precision_state_dict(model, optimizer)
    out = {"keys": len(full), "digest": dict_digest(full) if full else None}
    inner = optimizer.optimizer
    checks = []
    for name, param in model.named_parameters():
        theta = param.full_tensor()
        master_scale = get_master_scale(plain(param))  # O2: an FP16 payload, a scale per shard
        held = inner.held_value(param).full_tensor() if master_scale is not None else None
        state = inner.state.get(param, {})
        group = next(g for g in inner.param_groups if any(p is param for p in g["params"]))
        rule = inner.composition(param, group).rule
        key = rule.compensation_key or rule.master_key
        extra = state.get(key) if key else None
        extra = extra.full_tensor() if extra is not None else None  # every rank joins the gather
        if dist.get_rank() != 0:
            continue
        value = full[name]
        expected = (
            theta.double()
            if extra is None
            else (extra.double() if key == rule.master_key else theta.double() + extra.double())
        )
        if held is not None:  # the real values: each shard's payload over its own scale
            expected = held
        ulp = 2 * torch.finfo(torch.float32).eps * expected.abs().float().clamp_min(2**-126)
        checks.append(
            bool(
                value.dtype == torch.float32
                and (held is not None or torch.equal(value.to(theta.dtype), theta))
                and ((value.double() - expected).abs() <= ulp.double()).all()
            )
        )
    out["exact"] = all(checks) if dist.get_rank() == 0 else None
    return out


def accumulated(name: str, data, clipping: bool = True, digests: list | None = None) -> list[float]:
    """One process, each batch as the ranks' micro-batches with gradient accumulation: the same
    half-batch backward passes and a rounded combination of their gradients as data parallelism,
    without FSDP. Its gap to `reference` is the data-parallel effect of the strategy's rounding.
    `digests` collects the weights' digest after every step."""
    strategy = get_strategy(name)
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=LR, weight_decay=0.01)
    strategy.set_gradient_accumulation(dist.get_world_size())
    losses = []
    for ids in data:
        total = 0.0
        for part in ids.split(MICRO):
            with strategy.forward_context():
                loss = model(input_ids=part, labels=part).loss
            strategy.scale_loss(loss / dist.get_world_size()).backward()
            total += loss.item() / dist.get_world_size()
        clip(strategy, model, optimizer) if clipping else strategy.unscale_gradients(optimizer.optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        if digests is not None:
            digests.append(digest(model))
    return losses


def reference(name: str, data) -> dict:
    """The strategy in one process on the whole batches."""
    strategy = get_strategy(name)
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=LR, weight_decay=0.01)
    initial = state_l1(optimizer)
    export0 = dict_digest(strategy.full_precision_state_dict(model, optimizer))
    grads: list = []
    grad_bytes_hook(optimizer.optimizer, grads)
    grad_norms: list = []
    losses, norms = train(strategy, model, optimizer, data, sharded=False, grad_norms=grad_norms)
    return {
        "losses": losses,
        "accumulated_losses": accumulated(name, data),
        "norms": norms,
        "grad_norms": grad_norms,
        "initial_state_l1": initial,
        "export_digest_before": export0,
        "state_dtypes": state_dtypes(optimizer),
        "param_dtypes": sorted({str(plain(p).dtype) for p in model.parameters()}),
        "bytes": model_state_bytes(model, optimizer, max(grads)),
    }


def build(name: str, seed: int = 0, plugin: bool = False, weight_decay: float = 0.01):
    strategy = get_strategy(name)
    if plugin:
        wrapper = PrecisionPlugin(strategy)
        model = wrapper.shard(tiny_gpt2(seed))
        optimizer = wrapper.create_optimizer(model.parameters(), lr=LR, weight_decay=weight_decay)
    else:
        model = shard_model(strategy, tiny_gpt2(seed))
        optimizer = strategy.create_optimizer(model.parameters(), lr=LR, weight_decay=weight_decay)
    return strategy, model, optimizer


def run_sharded(name: str, ckpt: Path, data) -> dict:
    strategy, model, optimizer = build(name)
    initial = torch.tensor(state_l1(optimizer), dtype=torch.float64)
    dist.all_reduce(initial)  # each element of a state lives on exactly one rank
    export_before = strategy.full_precision_state_dict(model, optimizer)
    grads: list = []
    grad_bytes_hook(optimizer.optimizer, grads)
    optimizer.optimizer.paths_taken.clear()
    mark = COLLECTIVES.mark()
    losses, norms = train(strategy, model, optimizer, data[:2], sharded=True)
    moved = COLLECTIVES.since(mark)  # 2 steps
    paths = optimizer.optimizer.paths_taken  # one count per parameter and step, by the path that ran
    result = {
        "compiled_runs": paths["compiled"] + paths["native"],
        "reference_runs": paths["reference"],
        "updated_params": len([p for g in optimizer.param_groups for p in g["params"]]),
        "initial_state_l1": initial.item(),
        "export_digest_before": dict_digest(export_before) if export_before else None,
        "export_keys_before": len(export_before),
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
        "param_dtypes": sorted({str(plain(p).dtype) for p in model.parameters()}),
        "state_dtypes": state_dtypes(optimizer),
        "state_layout": shards_like_params(optimizer.optimizer),
        "bytes": model_state_bytes(model, optimizer, max(grads)),
        "moved_two_steps": moved,
        "declared_per_step": fsdp2_step_bytes(strategy, model, dist.get_world_size()),
    }
    result["digest_step2"] = digest(model)
    save_sharded(ckpt, model, optimizer)
    more, more_norms = train(strategy, model, optimizer, data[2:], sharded=True)
    result.update(losses=losses + more, norms=norms + more_norms, digest=digest(model))
    result["export"] = export_check(strategy, model, optimizer)
    # A fresh model (another initialization) and optimizer restored from the checkpoint.
    strategy2, model2, optimizer2 = build(name, seed=5)
    load_sharded(ckpt, model2, optimizer2)
    result["resumed_losses"], _ = train(strategy2, model2, optimizer2, data[2:], sharded=True)
    result["resumed_digest"] = digest(model2)
    result["resumed_state_dtypes"] = state_dtypes(optimizer2)
    return result


def run_until_killed(name: str, ckpt: Path, data) -> dict:
    """Train 2 steps and save a sharded checkpoint; once every case ran, `main` ends the process
    at once (`os._exit`: no teardown, no process-group shutdown), as a killed job would."""
    strategy, model, optimizer = build(name)
    losses, _ = train(strategy, model, optimizer, data[:2], sharded=True)
    save_sharded(ckpt, model, optimizer)
    return {"losses": losses}


def run_resumed(name: str, ckpt: Path, data) -> dict:
    """New processes: a fresh model (another initialization) and optimizer load the checkpoint a
    killed job left and train steps 3 and 4."""
    strategy, model, optimizer = build(name, seed=5)
    load_sharded(ckpt, model, optimizer)
    losses, _ = train(strategy, model, optimizer, data[2:], sharded=True)
    return {"losses": losses, "digest": digest(model)}


def run_plugin(name: str, data) -> dict:
    """`PrecisionPlugin.shard` + `create_optimizer`: the same numerics as `strategy.shard`."""
    strategy, model, optimizer = build(name, plugin=True)
    losses, _ = train(strategy, model, optimizer, data[:2], sharded=True)
    return {"losses": losses, "digest": digest(model)}


def fsdp2_config_env() -> dict[str, str]:
    """The FSDP_* environment `accelerate launch --config_file recipes/configs/fsdp2.yaml` gives
    each process (Accelerate's own parsing of the config file)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(ROOT / "recipes/configs/fsdp2.yaml"), "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith("FSDP_")}


def forced_fsdp2_accelerator():
    """An Accelerator on the FSDP2 path on CPU.

    Accelerate 1.15 takes its FSDP path only on accelerator devices: on CPU,
    `Accelerator(cpu=True, fsdp_plugin=...)` silently runs MULTI_CPU data parallel. State.py on a
    GPU sets `distributed_type = FSDP` and keeps the plugin; this sets the same two attributes
    right after construction, so `accelerator.prepare` runs the code it runs on GPUs
    (`_prepare_fsdp2` → `fsdp2_prepare_model`: Accelerate's own `fully_shard` calls and its
    swap of the optimizer's parameters for the shards)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    os.environ.update(fsdp2_config_env())  # the plugin reads recipes/configs/fsdp2.yaml's settings
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU  # what the fixture works around
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator


def run_accelerate(name: str, data) -> dict:
    """`PrecisionPlugin.prepare` with Accelerate's FSDP2 (a torch AdamW replaced by the
    strategy's optimizer, Accelerate's wrapping): the same numerics as `strategy.shard`."""
    accelerator = forced_fsdp2_accelerator()
    wrapper = PrecisionPlugin(name)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model, optimizer = wrapper.prepare(accelerator, model, optimizer)
    inner = optimizer.optimizer.optimizer  # AcceleratedOptimizer → StrategyOptimizer → AdamW core
    policy = accelerator.state.fsdp_plugin.mixed_precision_policy
    initial = torch.tensor(state_l1(inner), dtype=torch.float64)
    dist.all_reduce(initial)
    losses = []
    for ids in data[:2]:
        ids = rank_rows(ids, MICRO)
        loss = model(input_ids=ids, labels=ids).loss  # the plugin's hook enters the forward context
        wrapper.backward(accelerator, loss)
        wrapper.clip_grad_norm_(accelerator, model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().float().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    return {
        "losses": losses,
        "digest": digest(model),
        "initial_state_l1": initial.item(),
        "states": len(inner.state),
        "params": len([p for g in inner.param_groups for p in g["params"]]),
        "state_layout": shards_like_params(inner),
        "state_dtypes": state_dtypes(inner),
        "policy": str(policy),
        "strategy_policy": str(get_strategy(name).fsdp2_mixed_precision()),
    }


def run_trainer(name: str, data, out: Path, export: str | None = None) -> dict:
    """`TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2}, precision_strategy=name)`
    on the FSDP2 path (forced on CPU, see `forced_fsdp2_accelerator`), and the custom loop with
    `shard_model` on the same per-rank batches (no weight decay, constant LR, as the Trainer is set).
    `export`: a state_dict_type; the Trainer runs with `save_full_precision` and `save_model` once
    trained, against the loop's `full_precision_state_dict` (rank 0 compares)."""
    from torch.utils.data import SequentialSampler

    from hf_lowprec import Trainer, TrainingArguments

    strategy = get_strategy(name)
    model = shard_model(strategy, tiny_gpt2())
    # The Trainer's two groups (decay, no decay; both at 0 here): bf16-sr draws its rounding
    # seeds per group, so the groups must be the same for the same bits.
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n in decay]}, {"params": [p for n, p in named if n not in decay]}]
    torch.manual_seed(TrainingArguments.seed)  # the run's seed, as the Trainer sets it: bf16-sr's rounding seed
    optimizer = strategy.create_optimizer(groups, lr=LR, weight_decay=0.0)
    loop_losses, _ = train(strategy, model, optimizer, data, sharded=True)

    class FSDP2Trainer(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            from accelerate import FullyShardedDataParallelPlugin
            from accelerate.utils import DistributedType

            super().create_accelerator_and_postprocess()
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            assert self.accelerator.distributed_type == DistributedType.MULTI_CPU  # what is forced here
            self.accelerator.state.distributed_type = DistributedType.FSDP
            self.accelerator.state.fsdp_plugin = plugin
            self.is_fsdp_enabled = True

        def _get_train_sampler(self, *args, **kwargs):  # batch k's rows in order: rank r its MICRO rows
            return SequentialSampler(self.train_dataset)

    # The Trainer divides the summed loss by the labels that are not -100, counted before the
    # model's shift; position 0 is never a target, so masking it makes that count the model's.
    rows = [{"input_ids": row, "labels": torch.cat([torch.tensor([-100]), row[1:]])} for ids in data for row in ids]
    args = TrainingArguments(
        output_dir=str(out / f"trainer-{name}-{export}"),
        precision_strategy=name,
        precision_options={"save_full_precision": True} if export else None,
        fsdp="full_shard",
        fsdp_config={"fsdp_version": 2, **({"state_dict_type": export} if export else {})},
        use_cpu=True,
        per_device_train_batch_size=MICRO,
        max_steps=len(data),
        learning_rate=LR,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        max_grad_norm=MAX_NORM,
        average_tokens_across_devices=False,
        save_strategy="steps" if export else "no",  # export: checkpoints must not gather it
        save_on_each_node=export == "FULL_STATE_DICT",  # one node: its first rank is rank 0, the writer
        save_steps=1,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = FSDP2Trainer(model=tiny_gpt2(), args=args, train_dataset=rows)
    gathers = []
    if export:  # each gather of the export (every rank's collective), counted
        full = trainer.precision.full_precision_state_dict
        trainer.precision.full_precision_state_dict = lambda *a, **k: gathers.append(1) or full(*a, **k)
    trainer.train()
    if export:
        case = exported_like_the_loop(trainer, strategy.full_precision_state_dict(model, optimizer))
        return {**case, "gathers_in_training": len(gathers) - 1}
    inner = trainer.optimizer.optimizer.optimizer  # AcceleratedOptimizer → StrategyOptimizer → core
    return {
        "loop_losses": loop_losses,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        "loop_digest": digest(model),
        "digest": digest(trainer.model),
        "param_types": sorted({type(p).__name__ for p in trainer.model.parameters()}),
        "state_layout": shards_like_params(inner),
        "state_dtypes": state_dtypes(inner),
        "loop_state_dtypes": state_dtypes(optimizer.optimizer),
        "policy": str(trainer.accelerator.state.fsdp_plugin.mixed_precision_policy),
        "strategy_policy": str(get_strategy(name).fsdp2_mixed_precision()),
    }


def exported_like_the_loop(trainer, loop_export: dict) -> dict:
    """The Trainer's `save_model` under `save_full_precision` (every rank calls it), what rank 0
    wrote against the loop's export (rank 0 holds it; the others an empty dict)."""
    from safetensors.torch import load_file

    target = Path(trainer.args.output_dir) / "final"
    pushed = []  # what the folder holds when save_model pushes it (push_to_hub=True; no hub here)
    trainer.args.push_to_hub = True
    trainer.push_to_hub = lambda **kwargs: pushed.append(sorted(p.name for p in target.glob("*")))
    trainer.save_model(str(target))
    dist.barrier()
    if dist.get_rank() != 0:
        return {"loop_keys": len(loop_export), "files": sorted(p.name for p in target.glob("*"))}
    written = load_file(str(target / "model.safetensors"))
    return {
        "loop_keys": len(loop_export),
        "pushed": pushed,
        "checkpoints": sorted(p.name for p in Path(trainer.args.output_dir).glob("checkpoint-*")),
        "written_dtypes": sorted({str(v.dtype) for v in written.values()}),
        # save_pretrained drops the tied lm_head.weight; every other key bit for bit the loop's.
        "missing": sorted(set(loop_export) - set(written) - {"lm_head.weight"}),
        "unequal": sorted(k for k, v in written.items() if not torch.equal(v, loop_export[k])),
        "config_dtype": json.loads((target / "config.json").read_text()).get("dtype"),
    }


def run_unclipped(name: str, data) -> dict:
    """Sharded and in one process accumulating the ranks' halves, neither clipping: the weights'
    digest after every step. With clipping the two global norms are summed in different orders
    (per shard, then over the ranks), so the clip coefficients, and then the runs, may differ in
    the last bit."""
    sharded, one = [], []
    train(*build(name), data, sharded=True, clipping=False, digests=sharded)
    accumulated(name, data, clipping=False, digests=one)
    return {"sharded_digests": sharded, "one_digests": one}


def run_skip(name: str, data) -> dict:
    """A non-finite gradient on rank 1's shard only: every rank must skip the step."""
    strategy, model, optimizer = build(name)
    before = digest(model)
    ids = rank_rows(data[0], MICRO)
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss
    strategy.scale_loss(loss).backward()
    if dist.get_rank() == 1:
        next(model.parameters()).grad.to_local().view(-1)[0] = float("nan")
    optimizer.step()
    scaler = getattr(strategy, "scaler", None)
    return {
        "skipped": optimizer.step_was_skipped,
        "skipped_steps": strategy.skipped_steps,
        "unchanged": digest(model) == before,
        "scale": None if scaler is None else float(scaler.get_scale()),
        "initial_scale": None if scaler is None else float(get_strategy(name).scaler.get_scale()),
    }


def run_long(name: str, data) -> dict:
    """LONG_STEPS steps in one process (whole batches, and as accumulated micro-batches) and
    sharded (each rank its half): the losses as FP64 lists, judged as tensors by the test."""
    strategy, model, optimizer = build(name)
    sharded, _ = train(strategy, model, optimizer, data, sharded=True)
    strategy = get_strategy(name)
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=LR, weight_decay=0.01)
    grad_norms: list = []
    one, _ = train(strategy, model, optimizer, data, sharded=False, grad_norms=grad_norms)
    return {"sharded": sharded, "one": one, "accumulated": accumulated(name, data), "grad_norms": grad_norms}


def gpt2_small_bytes(name: str) -> dict:
    """Model-state bytes of a GPT-2-small-shaped model (124M parameters, built on the meta
    device: shapes and dtypes, no memory) in one process and on this rank under FSDP2.
    Gradients are counted as one element of the parameter's dtype per parameter element (what
    backward allocates; FSDP2 reduce-scatters into the shard's dtype)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import GPT2Config, GPT2LMHeadModel

    def measure(model, optimizer) -> dict:
        inner = optimizer.optimizer
        inner.init_states()
        params = [plain(p) for p in model.parameters()]
        states = [plain(v) for _, v in state_tensors(inner)]
        planned = getattr(inner, "planned_grad_dtype", lambda p: plain(p).dtype)  # O2: FP8 gradients
        return {
            "params": nbytes(params),
            "grads": sum(plain(p).numel() * planned(p).itemsize for p in model.parameters()),
            "bytes_per_param": strategy.bytes_per_param,
            "states": nbytes(s for s in states if s.dim() > 0),
            "unshardable": nbytes(s for s in states if s.dim() == 0),
            "num_params": sum(p.numel() for p in model.parameters()),
        }

    def model():
        with torch.device("meta"):
            return GPT2LMHeadModel(GPT2Config())

    strategy = get_strategy(name)
    one = strategy.prepare_model(model())
    one = measure(one, strategy.create_optimizer(one.parameters(), lr=LR))
    strategy = get_strategy(name)
    sharded = shard_model(strategy, model(), init_device_mesh("cpu", (dist.get_world_size(),)))
    return {"one": one, "rank": measure(sharded, strategy.create_optimizer(sharded.parameters(), lr=LR))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True, help="JSON list of [strategy, mode]")
    parser.add_argument("--ckpt", default=None, help="checkpoint root (default: <out>/ckpt)")
    args = parser.parse_args()
    out = Path(args.out)
    global COLLECTIVES
    COLLECTIVES = Collectives()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(4, batch=MICRO * world)
    results: dict = {"world_size": world, "cases": {}, "references": {}}
    path = out / f"rank{rank}.json"

    ckpt_root = Path(args.ckpt) if args.ckpt else out / "ckpt"

    def flush(complete: bool = False) -> None:
        results["complete"] = complete
        path.write_text(json.dumps(results, indent=1))

    for name, mode in json.loads(args.cases):
        key = f"{name}/{mode}"
        start = time.time()
        try:
            if mode == "train":
                results["references"][name] = reference(name, data)
                case = run_sharded(name, ckpt_root / name, data)
            elif mode == "accelerate":
                case = run_accelerate(name, data)
            elif mode == "killed":
                case = run_until_killed(name, ckpt_root / f"{name}-killed", data)
            elif mode == "resumed":
                case = run_resumed(name, ckpt_root / f"{name}-killed", data)
            elif mode == "plugin":
                case = run_plugin(name, data)
            elif mode == "gpt2-small-bytes":
                case = gpt2_small_bytes(name)
            elif mode == "trainer":
                case = run_trainer(name, data[:2], out)
            elif mode.startswith("trainer-export-"):  # trainer-export-FULL_STATE_DICT, ...
                case = run_trainer(name, data[:2], out, export=mode.removeprefix("trainer-export-"))
            elif mode == "unclipped":
                case = run_unclipped(name, data)
            elif mode == "long":
                case = run_long(name, batches(LONG_STEPS, batch=MICRO * world, seed=7))
            elif mode == "skip":
                case = run_skip(name, data)
            else:
                raise ValueError(f"unknown mode {mode!r}")
        except Exception:  # recorded, so the test shows which case failed and why
            case = {"error": traceback.format_exc()}
        case["seconds"] = round(time.time() - start, 2)
        results["cases"][key] = case
        flush()
        dist.barrier()
    flush(complete=True)
    dist.barrier()
    if any(mode == "killed" for _, mode in json.loads(args.cases)):
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
