"""One rank of the FP8-LM FSDP2 tests (`test_fsdp2_fp8.py`): FP8 all-gather, counted at the collective.

Started by `tests/deepspeed/_launch.py` (gloo, CPU). For fp8-lm-o1 and fp8-lm-o2 it records, in one process on
the whole batches and sharded with `shard_model` on this rank's half: the losses, the FP32
first-order terms of the reference (`fp32_gradient_norms`), a digest of every FP8 weight each
FP8 layer multiplied by (payload and scale), the bytes every all-gather moved and the all-reduces
of each step; for O2 also whether each shard's master scale is its own. A 128-wide GPT-2
and a tiny Qwen3-MoE give the bytes all-gathered per step under bf16-mixed and both levels. Results go to `<out>/rank<r>.json`.
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

import torch.distributed as dist  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402

from hf_lowprec import get_strategy  # noqa: E402
from hf_lowprec.engines.fsdp2 import shard_model  # noqa: E402
from hf_lowprec.engines.traffic import fsdp2_step_bytes  # noqa: E402
from hf_lowprec.fp8 import FP8Linear  # noqa: E402
from hf_lowprec.fp8.linear import quantize_weight  # noqa: E402
from hf_lowprec.testing.moe import tiny_moe  # noqa: E402
from tests.distributed._fsdp2_worker import LR, MICRO, Collectives, clip  # noqa: E402
from tests.helpers import batches, fp32_gradient_norms, rank_rows, tiny_gpt2  # noqa: E402

STEPS = 3
LEVELS = ("fp8-lm-o1", "fp8-lm-o2")
# fp8-lm-o2 with the finer recipes tiny_gpt2's 64-wide layers fit (blockwise needs 128).
RECIPES = ("rowwise", "mxfp8")


def fp8_weights_seen(model) -> list[str]:
    # digest_fp8 copies: numpy() on the all-gather buffer itself would pin its storage (FSDP2 frees it).
    """A forward pre-hook on every FP8 layer: digest of the (payload, scale) it multiplies by."""
    seen: list[str] = []

    def hook(module, _args):
        weight = module.weight
        payload, scale = weight.fp8() if hasattr(weight, "fp8") else module._fp8_weight()
        seen.append(digest_fp8(payload, scale))

    for module in model.modules():
        if isinstance(module, FP8Linear):
            module.register_forward_pre_hook(hook)
    return seen


def digest_fp8(payload: torch.Tensor, scale: torch.Tensor) -> str:
    h = hashlib.sha256(payload.view(torch.uint8).clone().numpy().tobytes())
    h.update(scale.float().numpy().tobytes())
    return h.hexdigest()


def real_shard(module) -> torch.Tensor:
    """This rank's shard of an FP8 layer's weight in real units (O2: the FP16 payload divided by
    the shard's own master scale, exact for a power of two), FP32."""
    shard = module.weight.to_local().local_values.contiguous().float()
    return shard if module.master_scale is None else shard / module.master_scale


def fp8_of_whole_weights(model) -> list[str]:
    """Sharded model, between steps: each FP8 layer's whole weight, gathered here in real units,
    quantized as one process's FP8Linear would (its own amax): the digests."""
    out = []
    for module in model.modules():
        if isinstance(module, FP8Linear):
            shard = real_shard(module)
            parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, shard)
            whole = torch.cat(parts)
            out.append(digest_fp8(*quantize_weight(whole, module.margin)))
    return out


def master_scales_per_shard(model) -> dict:
    """O2, sharded: each FP8 layer's master scale against the FP16 scale of its shard's own amax
    (what FP8AdamW chooses at each step), and the optimizer reading that same tensor."""
    from hf_lowprec.fp8.scaled import get_master_scale, pow2_scale, tensor_amax

    own, linked, scales = [], [], []
    for module in model.modules():
        if isinstance(module, FP8Linear):
            payload = module.weight.to_local().local_values
            real = payload.float() / module.master_scale
            own.append(bool(module.master_scale == pow2_scale(tensor_amax(real), torch.float16, module.master_margin)))
            linked.append(get_master_scale(module.weight) is module.master_scale)
            scales.append(module.master_scale.item())
    return {"own_amax": own, "linked": linked, "scales": scales}


def train(strategy, model, optimizer, data, sharded: bool, counter: Collectives | None = None) -> dict:
    losses, norms, gathered, reduces, expected = [], [], [], [], []
    seen = fp8_weights_seen(model)
    for ids in data:
        if not sharded:
            norms.append(fp32_gradient_norms(strategy, model, optimizer, ids))
        else:
            expected += fp8_of_whole_weights(model)
        start = (len(counter.gathered), counter.all_reduces) if counter else (0, 0)
        part = rank_rows(ids, MICRO) if sharded else ids
        with strategy.forward_context():
            loss = model(input_ids=part, labels=part).loss
        strategy.scale_loss(loss).backward()
        clip(strategy, model, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if counter:
            gathered.append(sum(counter.gathered[start[0] :]))
            reduces.append(counter.all_reduces - start[1])
        value = loss.detach().float().clone()
        if sharded:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return {
        "losses": losses,
        "norms": norms,
        "fp8_weights": seen,
        "fp8_of_whole_weights": expected,
        "gathered": gathered,
        "all_reduces": reduces,
    }


def wide_gpt2() -> GPT2LMHeadModel:
    """2 layers, 128 wide, GPT-2's own dropout (0.1); the tied embeddings stay BF16 under FP8-LM."""
    return tiny_gpt2(n_embd=128, dropout=0.1)


def gather_bytes(name: str, data, counter: Collectives) -> dict:
    strategy = get_strategy(name)
    model = shard_model(strategy, wide_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=LR)
    out = train(strategy, model, optimizer, data, sharded=True, counter=counter)
    fp8 = [m.weight for m in model.modules() if isinstance(m, FP8Linear)]
    out["fp8_elements"] = sum(p.numel() for p in fp8)
    out["elements"] = sum(p.numel() for p in model.parameters())
    out["scale_refreshes"] = getattr(getattr(strategy, "weight_scales", None), "refreshes", None)
    return out


def moe_gather_bytes(name: str, counter: Collectives) -> dict:
    """A tiny Qwen3-MoE sharded: the bytes each step's all-gathers moved, and the declared ones."""
    strategy = get_strategy(name)
    model = shard_model(strategy, tiny_moe("qwen3_moe"))
    optimizer = strategy.create_optimizer(model.parameters(), lr=LR)
    ids = torch.randint(0, 256, (MICRO * dist.get_world_size(), 32), generator=torch.Generator().manual_seed(1))
    gathered = []
    for _ in range(2):
        start = len(counter.gathered)
        part = rank_rows(ids, MICRO)
        with strategy.forward_context():
            loss = model(input_ids=part, labels=part).loss
        strategy.scale_loss(loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gathered.append(sum(counter.gathered[start:]))
    return {"gathered": gathered, "declared": fsdp2_step_bytes(strategy, model, dist.get_world_size())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result: dict = {"world_size": dist.get_world_size(), "cases": {}}
    data = batches(STEPS, MICRO * dist.get_world_size())
    counter = Collectives()
    try:
        runs = [(name, name, {}) for name in LEVELS] + [(f"fp8-lm-o2+{r}", "fp8-lm-o2", {"recipe": r}) for r in RECIPES]
        for label, name, options in runs:
            strategy = get_strategy(name, **options)
            model = strategy.prepare_model(tiny_gpt2())
            optimizer = strategy.create_optimizer(model.parameters(), lr=LR, weight_decay=0.01)
            result["cases"][f"{label}/one"] = train(strategy, model, optimizer, data, sharded=False)
            strategy = get_strategy(name, **options)
            model = shard_model(strategy, tiny_gpt2())
            optimizer = strategy.create_optimizer(model.parameters(), lr=LR, weight_decay=0.01)
            case = train(strategy, model, optimizer, data, sharded=True, counter=counter)
            case["scale_refreshes"] = strategy.weight_scales.refreshes
            case["recipes"] = sorted({m.recipe for m in model.modules() if isinstance(m, FP8Linear)})
            if strategy.o2:
                case["master_scales"] = master_scales_per_shard(model)
            result["cases"][f"{label}/sharded"] = case
        for name in ("bf16-mixed", *LEVELS):
            result["cases"][f"{name}/bytes"] = gather_bytes(name, data, counter)
            result["cases"][f"{name}/moe-bytes"] = moe_gather_bytes(name, counter)
    except Exception:
        result["error"] = traceback.format_exc()
    result["complete"] = True
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
