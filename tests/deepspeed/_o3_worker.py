"""One rank of the fp8-lm-o3 FP8 ZeRO checks on 2 gloo ranks (launched by test_fp8_zero_ranks.py).

Cases, each on a fresh `deepspeed.initialize` (ZeRO-2) of the tiny GPT-2 with the strategy's
optimizer split into two groups (decay / no decay, as the Trainer builds them), so DeepSpeed
calls the client optimizer twice per step:

- "train": 3 steps; the bytes each rank holds for the FP8 weights it does not own, the FP8
  AdamW step count of the weights it owns, the forward weights' digest after every step;
  then the export: `exported_state_dict` → `save_pretrained` on rank 0, reloaded by every
  rank and compared with the masters it owns; and the error the export had before it gathered
  (rank 0's module holds the FP8 values of the weights it does not own).
- "clip": two engines from the same model and data, without and with `gradient_clipping`;
  the gradients the client optimizer updates with (the dense partitions and the owners' FP8
  gradients) on the first step of each.

Results go to `<out>/rank<r>.json` with "complete": true at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hf_lowprec import get_strategy  # noqa: E402
from hf_lowprec.engines.zero import attach_zero_optimizer, precision_config  # noqa: E402
from hf_lowprec.fp8.cast import widen  # noqa: E402
from hf_lowprec.fp8.scaled import dequantize, get_master_scale  # noqa: E402
from tests.helpers import batches, tiny_gpt2  # noqa: E402

MICRO = 2
LR = 1e-3
DEVICE = torch.device("cpu")  # cuda:<local rank> under NCCL (set in main)


def build(clip: float = 0.0):
    strategy = get_strategy("fp8-lm-o3")
    model = strategy.prepare_model(tiny_gpt2().to(DEVICE))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.01},
        {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = strategy.create_optimizer(groups, lr=LR)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
        "gradient_clipping": clip,
    }
    engine, zero_opt, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=precision_config(strategy, config)
    )
    attach_zero_optimizer(zero_opt)
    return strategy, engine, zero_opt, optimizer.optimizer


def local(ids: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return ids[rank * MICRO : (rank + 1) * MICRO].to(DEVICE)


def step(strategy, engine, ids) -> float:
    with strategy.forward_context():
        loss = engine(input_ids=local(ids), labels=local(ids)).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def forward_digest(inner) -> str:
    h = hashlib.sha256()
    for i in range(len(inner.fp8_params)):
        payload, scale = inner.fp8_weight(i)
        h.update((widen(payload, torch.float32) / scale + 0.0).cpu().numpy().tobytes())
    return h.hexdigest()


def run_train(out: Path, data) -> dict:
    strategy, engine, _zero_opt, inner = build()
    rank = dist.get_rank()
    others = [i for i, o in enumerate(inner.owners) if o != rank]
    result = {
        "owned": inner.owned,
        "non_owned_numel": sum(inner.fp8_params[i].numel() for i in others),
        "non_owned_bytes_fp16_storage": sum(inner.fp8_params[i].numel() * 2 for i in others),
        "non_owned_bytes": sum(inner.fp8_params[i].numel() * inner.fp8_params[i].element_size() for i in others),
        "non_owned_dtypes": sorted({str(inner.fp8_params[i].dtype) for i in others}),
        "losses": [],
        "digests": [],
    }
    for ids in data:
        result["losses"].append(step(strategy, engine, ids))
        result["digests"].append(forward_digest(inner))
    result["non_owned_bytes_after_steps"] = sum(
        inner.fp8_params[i].numel() * inner.fp8_params[i].element_size() for i in others
    )
    result["fp8_steps"] = sorted({int(inner.state[inner.fp8_params[i]]["step"]) for i in inner.owned})
    result["group_steps"] = sorted(
        {int(s["step"]) for p, s in inner.state.items() if all(p is not q for q in inner.fp8_params)}
    )

    # Export: every rank takes part in the gather; rank 0 writes.
    model = engine.module
    names = {id(p): n for n, p in model.named_parameters()}
    masters = {
        names[id(inner.fp8_params[i])]: dequantize(
            inner.fp8_params[i].detach(), get_master_scale(inner.fp8_params[i]), torch.float32
        ).cpu()
        for i in inner.owned
    }
    exported = strategy.exported_state_dict(model, inner, None)
    full = strategy.full_precision_state_dict(model, inner)
    # What the export held before it gathered: rank 0's module, i.e. the FP8 values of the
    # weights rank 0 does not own. Each owner measures that error on its own weights.
    fp8_values = {}
    for i in inner.owned:
        payload, scale = inner.fp8_weight(i)
        fp8_values[names[id(inner.fp8_params[i])]] = (widen(payload, torch.float32) / scale).cpu()
    save = out / "export"
    if rank == 0:
        model.save_pretrained(str(save), state_dict=exported, safe_serialization=True)
    dist.barrier()
    from transformers import GPT2LMHeadModel

    saved = GPT2LMHeadModel.from_pretrained(str(save)).state_dict()
    result["export_equal_owned"] = {n: bool(torch.equal(saved[n], m)) for n, m in masters.items()}
    result["full_equal_owned"] = {n: bool(torch.equal(full[n].cpu(), m)) for n, m in masters.items()}
    trained = {
        n: p.detach().float().cpu()
        for n, p in model.named_parameters()
        if id(p) not in {id(q) for q in inner.fp8_params}
    }
    result["export_equal_other"] = all(torch.equal(saved[n], v) for n, v in trained.items())
    result["export_fp8_names"] = sorted(names[id(p)] for p in inner.fp8_params)
    result["fp8_export_max_rel_error"] = max(
        (float((fp8_values[n] - m).abs().max() / m.abs().max()) for n, m in masters.items()), default=0.0
    )
    result["fp8_export_max_abs_error"] = max(
        (float((fp8_values[n] - m).abs().max()) for n, m in masters.items()), default=0.0
    )
    engine.destroy()
    return result


def client_grads(inner, record: list) -> None:
    """Pre-hook of the client optimizer: the gradients it is about to update with, per call
    (DeepSpeed calls it once per group; the FP8 gradients are taken on the first call)."""

    seen = set()

    def hook(opt, *_):
        key = id(opt.param_groups[0]["params"][0])  # once per call (a nested hooked super().step())
        if key in seen:
            return
        seen.add(key)
        dense = [
            p.grad.detach().double().reshape(-1).clone()
            for g in opt.param_groups
            for p in g["params"]
            if p.grad is not None
        ]
        fp8 = {}
        for i in opt.owned:
            pending = opt.fp8_grad(opt.fp8_params[i])
            if pending is not None:
                fp8[i] = (widen(pending[0], torch.float64) / pending[1].double()).reshape(-1)
        record.append((dense, fp8))

    inner.register_step_pre_hook(hook)


def run_clip(data, clip: float) -> dict:
    out = {}
    for name, value in (("free", 0.0), ("clipped", clip)):
        strategy, engine, _zero_opt, inner = build(value)
        record: list = []
        client_grads(inner, record)
        step(strategy, engine, data[0])
        dense = torch.cat([g for dense, _ in record for g in dense])
        fp8 = {i: g for _, calls in record for i, g in calls.items()}
        out[name] = {
            "dense": dense.tolist(),
            "fp8": {i: g.tolist() for i, g in fp8.items()},
            "calls": len(record),
            "engine_norm": float(engine.get_global_grad_norm()),
        }
        engine.destroy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--clip", type=float, default=0.05)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = parser.parse_args()
    out = Path(args.out)
    global DEVICE
    if args.backend == "nccl":
        DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(DEVICE)
    deepspeed.init_distributed(dist_backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(3, batch=MICRO * world)
    results: dict = {"world_size": world, "device": str(DEVICE)}
    path = out / f"rank{rank}.json"
    for case, run in (("train", lambda: run_train(out, data)), ("clip", lambda: run_clip(data, args.clip))):
        try:
            results[case] = run()
        except Exception:
            results[case] = {"error": traceback.format_exc()}
        path.write_text(json.dumps(results))
        dist.barrier()
    results["complete"] = True
    path.write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    main()
