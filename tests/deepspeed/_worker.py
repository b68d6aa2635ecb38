"""One rank of the DeepSpeed ZeRO tests: every case of the support matrix in one launch.

Started by `tests/deepspeed/launch.py` as RANK/WORLD_SIZE processes (gloo). For each
(strategy, stage) it either expects `hf_lowprec.engines.zero.precision_config` to refuse, or builds
a fresh `deepspeed.initialize` with the strategy's client optimizer, trains a few steps and
records what the partitions DeepSpeed holds really are, the per-rank model-state bytes, the
losses, and whether save_checkpoint → load_checkpoint continues bit-for-bit. Results go to
`<out>/rank<r>.json`, written before the process exits, with "complete": true at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hf_lowprec import get_strategy  # noqa: E402
from hf_lowprec.engines.zero import (  # noqa: E402
    attach_zero_optimizer,
    partition_segments,
    precision_config,
    zero_support,
)
from hf_lowprec.engines.zero_export import gather_full_precision  # noqa: E402
from hf_lowprec.fp8.linear import quantize_tensorwise  # noqa: E402
from hf_lowprec.fp8.scaled import dequantize, get_master_scale  # noqa: E402
from hf_lowprec.memory import unwrap_optimizer  # noqa: E402
from tests.helpers import (  # noqa: E402
    accumulated_halves,
    batches,
    fp32_gradient_norms,
    nbytes,
    rank_rows,
    tiny_gpt2,
)

SOLO: list = []  # one single-rank process group per rank, for the one-process references
MICRO = 2  # samples per rank per step; the single-process reference takes all ranks' samples
LR = 1e-3
BASE_CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "steps_per_print": 10**9,
    "wall_clock_breakdown": False,
}
# DeepSpeed clips at 1.0 unless told otherwise; the one-process references do not clip. Adam sees
# a uniform gradient scale c only through ε (c·g gives m̂/(√v̂ + ε/c)): that alone made every
# deterministic strategy leave its reference after step 1 (fp32: 5e-7 in the loss at step 2).
# The engines built here compare against those references, so they do not clip either (the
# Trainer cases keep "auto", which follows max_grad_norm).
NO_CLIPPING = {"gradient_clipping": 0.0}


def ds_config(stage: int) -> dict:
    return {**BASE_CONFIG, "zero_optimization": {"stage": stage}}


def build(name: str, stage: int):
    strategy = get_strategy(name)
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=LR, weight_decay=0.01)
    engine, zero_opt, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=precision_config(strategy, {**ds_config(stage), **NO_CLIPPING})
    )
    attach_zero_optimizer(zero_opt)
    return strategy, engine, zero_opt, optimizer


def train(strategy, engine, data, digests: list | None = None) -> list[float]:
    """Per step, the loss of the whole global batch (mean of the ranks' local losses);
    `digests` collects the forward weights' digest after every step."""
    losses = []
    for ids in data:
        ids = rank_rows(ids, MICRO)
        with strategy.forward_context():
            loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        if digests is not None:
            digests.append(forward_digest(engine.module))
    return losses


def partitions(zero_opt) -> list[torch.Tensor]:
    """The weight partitions DeepSpeed hands to the client optimizer on this rank."""
    if hasattr(zero_opt, "single_partition_of_fp32_groups"):  # ZeRO 1/2
        return list(zero_opt.single_partition_of_fp32_groups)
    return list(zero_opt.fp32_partitioned_groups_flat)  # ZeRO 3


def state_dtypes(optimizer) -> dict[str, list[str]]:
    out: dict[str, set] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.numel() > 1:
                out.setdefault(key, set()).add(str(value.dtype))
    return {k: sorted(v) for k, v in out.items()}


def state_l1(optimizer) -> float:
    """Σ|x| over the optimizer's floating-point state tensors (FP64): seeded state before the first
    step (the integer codes of 8-bit states encode zeros, and are made fresh on the partitions)."""
    return sum(
        float(v.double().abs().sum())
        for st in optimizer.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.numel() > 1 and v.is_floating_point()
    )


def forward_digest(module) -> str:
    """Digest of the weights the forward uses: FP8 layers' E4M3 weights (dequantized), other parameters."""
    h = hashlib.sha256()
    for p in module.parameters():
        scale = get_master_scale(p)
        if scale is not None:
            if p.dtype == torch.float8_e4m3fn:  # fp8-lm-o3: a weight another rank owns is its FP8 weight
                w8, sw = p.detach(), scale
            else:
                w8, sw = quantize_tensorwise(p.detach(), torch.float8_e4m3fn, 0, scale)
            p = w8.float() / sw + 0.0  # +0.0 turns -0 into +0: the same FP8 value for the GEMM
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def model_bytes(engine, stage: int) -> int:
    params = list(engine.module.parameters())
    if stage == 3:  # each rank holds its ds_tensor shard of every parameter
        return nbytes(p.ds_tensor for p in params)
    return nbytes(params)


def digest(engine) -> str:
    h = hashlib.sha256()
    for t in engine.module.state_dict().values():
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def tensor_digests(state: dict) -> dict[str, str]:
    """{name: dtype and digest of the bytes} of a state dict's tensors."""
    return {
        k: f"{v.dtype}:"
        + hashlib.sha256(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()[:16]
        for k, v in state.items()
    }


def one_process(name: str):
    strategy = get_strategy(name)
    if name == "fp8-lm-o3":  # one process: its own rank is its whole data-parallel group
        strategy.process_group = SOLO[dist.get_rank()]
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=LR, weight_decay=0.01)
    return strategy, model, optimizer


def reference(name: str, data) -> dict:
    """The strategy in one process (no DeepSpeed) on the whole batches: dtypes, losses, the
    gradient norms of the loss bounds; and on the same batches as the ranks' two halves,
    accumulated then halved, the gradient a 2-rank reduce-scatter forms."""
    strategy, model, optimizer = one_process(name)
    initial = state_l1(optimizer)
    losses, norms = [], []
    for ids in data:
        norms.append(fp32_gradient_norms(strategy, model, optimizer, ids))
        losses.append(strategy.train_step(model, ids, optimizer).item())
    params = [p for p in model.parameters() if p.requires_grad]
    halves = one_process(name)
    return {
        "losses": losses,
        "norms": norms,
        "halves_losses": accumulated_halves(*halves, data),
        # What save_full_precision writes in one process after the halves' steps.
        "halves_full_precision": tensor_digests(halves[0].full_precision_state_dict(halves[1], halves[2])),
        "initial_state_l1": initial,
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "state_dtypes": state_dtypes(optimizer),
        "model_state_bytes": nbytes(params) * 2
        + nbytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1),
    }


def run_supported(name: str, stage: int, ckpt_dir: Path, data) -> dict:
    strategy, engine, zero_opt, client = build(name, stage)
    inner = client.optimizer
    initial = torch.tensor(state_l1(inner), dtype=torch.float64)
    dist.all_reduce(initial)  # each element of the partitions lives on exactly one rank
    grad_bytes = []  # the gradient partitions the client optimizer steps on
    inner.register_step_pre_hook(
        lambda opt, *_: grad_bytes.append(
            nbytes(p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None)
        )
    )
    step_digests: list[str] = []
    losses = train(strategy, engine, data[:2], step_digests)
    parts = partitions(zero_opt)
    result = {
        "zero_optimizer": type(zero_opt).__name__,
        "initial_state_l1": initial.item(),
        "client_is_ours": zero_opt.optimizer is client,
        "model_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
        "partition_dtypes": sorted({str(p.dtype) for p in parts}),
        "state_dtypes": state_dtypes(inner),
        "bytes": {
            "model": model_bytes(engine, stage),
            "partitions": nbytes(parts),
            "grads": max(grad_bytes),
            "optimizer_state": nbytes(
                v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1
            ),
        },
    }
    engine.save_checkpoint(str(ckpt_dir), tag="t2")
    losses += train(strategy, engine, data[2:], step_digests)
    result["losses"] = losses
    result["digest"] = digest(engine)
    result["forward_digests"] = step_digests
    # save_full_precision's weights, gathered from the partitions (a collective: every rank).
    result["full_precision"] = tensor_digests(gather_full_precision(strategy, engine.module, client, zero_opt))
    # A fresh engine restored from the checkpoint must continue exactly.
    strategy2, engine2, _zero_opt2, client2 = build(name, stage)
    engine2.load_checkpoint(str(ckpt_dir), tag="t2")
    result["resumed_losses"] = train(strategy2, engine2, data[2:])
    result["resumed_digest"] = digest(engine2)
    result["resumed_state_dtypes"] = state_dtypes(client2.optimizer)
    for e in (engine, engine2):
        e.destroy()
    return result


def state_digest(strategy, optimizer) -> str:
    """Digest of the optimizer's state tensors and the strategy's own state (μ, counters)."""
    h = hashlib.sha256()
    for state in optimizer.state.values():
        for key in sorted(state):
            value = state[key]
            if torch.is_tensor(value):
                h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(value).encode())
    scaler = getattr(strategy, "scaler", None)
    if scaler is not None and hasattr(scaler, "state_dict"):
        h.update(repr(scaler.state_dict()).encode())
    return h.hexdigest()


def run_nonfinite(name: str, stage: int, where: str, data) -> dict:
    """Step 2's gradient holds an inf on rank 0 only (one element of a dense parameter, or of an
    FP8 weight rank 0 owns under fp8-lm-o3): both ranks must skip that step without changing any
    state, and steps 3 and 4 must equal a run that never saw batch 2."""
    strategy, engine, zero_opt, _ = build(name, stage)
    inner = unwrap_optimizer(zero_opt)
    if where == "fp8":
        target = inner.fp8_params[inner.owners.index(0)]
    else:
        target = engine.module.transformer.ln_f.weight
    poison = {"on": False}

    def inject(grad: torch.Tensor) -> torch.Tensor | None:
        if not poison["on"] or dist.get_rank() != 0:
            return None
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    target.register_hook(inject)
    losses = train(strategy, engine, data[:1])
    before = (digest(engine), forward_digest(engine.module), state_digest(strategy, inner))
    poison["on"] = True
    train(strategy, engine, data[1:2])
    poison["on"] = False
    after = (digest(engine), forward_digest(engine.module), state_digest(strategy, inner))
    skipped = {"strategy": strategy.skipped_steps, "deepspeed": engine.skipped_steps}
    losses += train(strategy, engine, data[2:])
    parts = ("weights", "forward", "state")
    changed = [part for part, b, a in zip(parts, before, after) if b != a]
    result = {
        "unchanged": before == after,
        "changed": changed,
        "skipped": skipped,
        "losses": losses,
        "digest": digest(engine),
    }
    clean_strategy, clean, _, _ = build(name, stage)
    result["clean_losses"] = train(clean_strategy, clean, data[:1] + data[2:])
    result["clean_digest"] = digest(clean)
    for e in (engine, clean):
        e.destroy()
    return result


def run_trainer(name: str, stage: int, out: Path, data) -> dict:
    """`Trainer(TrainingArguments(deepspeed=..., precision_strategy=name))`: 4 steps uninterrupted,
    then a fresh Trainer resumed from the step-2 checkpoint; save_pretrained → a plain model."""
    from transformers import GPT2LMHeadModel

    from hf_lowprec import Trainer, TrainingArguments

    rows = [{"input_ids": ids[i], "labels": ids[i]} for ids in data for i in range(len(ids))]
    config = ds_config(stage)
    if stage == 3:  # save_model writes the gathered weights (else only DeepSpeed's checkpoint)
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True

    def trainer(run: str) -> Trainer:
        args = TrainingArguments(
            output_dir=str(out / run),
            precision_strategy=name,
            deepspeed=config,
            use_cpu=True,
            per_device_train_batch_size=MICRO,
            max_steps=4,
            save_steps=2,
            learning_rate=LR,
            weight_decay=0.01,
            lr_scheduler_type="constant",
            logging_steps=1,
            report_to=[],
            disable_tqdm=True,
            seed=0,
            data_seed=0,
            save_only_model=False,
        )
        return Trainer(model=tiny_gpt2(), args=args, train_dataset=rows)

    first = trainer("full")
    first.train()
    zero_opt = first.model_wrapped.optimizer
    parts = partitions(zero_opt)
    result = {
        "zero_optimizer": type(zero_opt).__name__,
        "partition_dtypes": sorted({str(p.dtype) for p in parts}),
        "state_dtypes": state_dtypes(zero_opt.optimizer.optimizer),
        "losses": [h["loss"] for h in first.state.log_history if "loss" in h],
        "digest": digest(first.model_wrapped),
    }
    first.save_model(str(out / "saved"))
    dist.barrier()
    plain = GPT2LMHeadModel.from_pretrained(str(out / "saved"))
    trained = {k: v.float() for k, v in first.model.state_dict().items()}
    inner = unwrap_optimizer(zero_opt)
    if hasattr(inner, "fp8_params"):  # fp8-lm-o3: each FP8 weight is saved as its owner's master
        names = {id(p): n for n, p in first.model.named_parameters()}
        fp8 = {names[id(p)]: i for i, p in enumerate(inner.fp8_params)}
        trained = {k: v for k, v in trained.items() if k not in fp8}
        trained.update(
            {
                names[id(inner.fp8_params[i])]: dequantize(
                    inner.fp8_params[i].detach(), get_master_scale(inner.fp8_params[i]), torch.float32
                )
                for i in inner.owned
            }
        )
    saved = plain.state_dict()
    result["saved_equal"] = all(torch.equal(saved[k].float(), v) for k, v in trained.items())
    result["saved_dtype"] = str(next(plain.parameters()).dtype)
    result["saved_full"] = save_full_precision(first, out / "saved_full", out / "saved", trained, zero_opt)
    second = trainer("full")
    second.train(resume_from_checkpoint=str(out / "full" / "checkpoint-2"))
    result["resumed_losses"] = [h["loss"] for h in second.state.log_history if "loss" in h]
    result["resumed_digest"] = digest(second.model_wrapped)
    return result


def save_full_precision(trainer, path: Path, plain: Path, trained: dict, zero_opt) -> dict:
    """`save_model` with `save_full_precision`: what the file and the config hold, against the
    weights the plain save wrote (`plain`), the trained weights and the full precision this
    rank's partitions hold (θ + δθ, masters)."""
    from safetensors.torch import load_file

    trainer.precision.options = dataclasses.replace(trainer.precision.options, save_full_precision=True)
    trainer.save_model(str(path))
    dist.barrier()
    saved, theta = load_file(str(path / "model.safetensors")), load_file(str(plain / "model.safetensors"))
    model = dict(trainer.model.named_parameters(remove_duplicate=False))
    names = {id(p): n for n, p in reversed(model.items()) if n in saved}  # tied: the name written
    inner = unwrap_optimizer(zero_opt)
    own = True  # this rank's partitions, element by element, as the optimizer holds them
    for part, segments in partition_segments(zero_opt):
        flat = inner.full_precision_value(part).reshape(-1)
        for param, p_start, q_start, length in segments:
            written = saved[names[id(param)]].reshape(-1)[p_start : p_start + length]
            own = own and torch.equal(written, flat[q_start : q_start + length])
    return {
        "dtypes": sorted({str(v.dtype) for v in saved.values()}),
        "config_dtype": json.loads((path / "config.json").read_text()).get("dtype"),
        "own_partitions_equal": own,
        # (the plain save may write the tied LM head under both names: every weight here is compared)
        "casts_back": saved.keys() <= theta.keys()
        and all(torch.equal(saved[k].to(theta[k].dtype), theta[k]) for k in saved),
        "beyond_bf16": sum(int((v != v.to(torch.bfloat16).float()).sum()) for v in saved.values()),
        "trained_equal": all(torch.equal(saved[k], v) for k, v in trained.items() if k in saved),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True, help="JSON list of [strategy, stage]")
    args = parser.parse_args()
    out = Path(args.out)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    SOLO.extend(dist.new_group([r]) for r in range(world))  # collective: every rank makes every group
    data = batches(4, batch=MICRO * world)
    results: dict = {"world_size": world, "cases": {}, "references": {}}
    path = out / f"rank{rank}.json"

    def flush(complete: bool = False) -> None:
        results["complete"] = complete
        path.write_text(json.dumps(results, indent=1))

    for name, stage, *mode in json.loads(args.cases):
        key = f"{name}/{stage}" + "".join(f"/{m}" for m in mode)
        start = time.time()
        refusal = zero_support(get_strategy(name), stage)
        try:
            if mode == ["trainer"]:
                case = run_trainer(name, stage, out / "trainer" / key.replace("/", "_"), data)
            elif mode and mode[0] == "nonfinite":
                case = run_nonfinite(name, stage, mode[1], data)
            elif refusal is not None:
                try:
                    precision_config(get_strategy(name), ds_config(stage))
                    case = {"refused": False, "error": "precision_config accepted a refused combination"}
                except ValueError as err:
                    case = {"refused": True, "message": str(err)}
            else:
                for ref in [name] + (["fp8-lm-o2"] if name == "fp8-lm-o3" else []):
                    if ref not in results["references"]:
                        results["references"][ref] = reference(ref, data)
                case = run_supported(name, stage, out / "ckpt" / key.replace("/", "_"), data)
        except Exception:  # recorded, so the test shows which case failed and why
            case = {"error": traceback.format_exc()}
        case["seconds"] = round(time.time() - start, 2)
        results["cases"][key] = case
        flush()
        dist.barrier()
    flush(complete=True)
    dist.barrier()


if __name__ == "__main__":
    main()
