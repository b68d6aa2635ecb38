"""One rank of fp8-lm-o3 (FP8-LM's ZeRO, stage 2) on a tiny Qwen3-MoE, 2 gloo ranks
(launched by test_fp8_zero_moe.py): the experts' 3-D weights are FP8 GEMM weights like the
linear ones, each owned whole by one rank and held in E4M3 (1 byte) by the other.

Three steps on each rank's half of the batch; per step the loss and a digest of the FP8 weights
every rank computes with. Results go to `<out>/rank<r>.json` with "complete": true at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
from hf_lowprec.fp8 import grouped  # noqa: E402
from hf_lowprec.fp8.cast import widen  # noqa: E402
from hf_lowprec.fp8.experts import expert_weight_names, experts_modules  # noqa: E402
from hf_lowprec.fp8.scaled import get_master_scale  # noqa: E402
from hf_lowprec.testing.moe import tiny_moe  # noqa: E402
from tests.helpers import batches  # noqa: E402

MICRO = 2


def forward_digest(model: torch.nn.Module) -> str:
    """The real values of the FP8 expert weights each rank's forward computes with: the owner's
    quantization of its master, the FP8 copy elsewhere (`grouped._fp8_weight`, as the forward)."""
    h = hashlib.sha256()
    for _, module in experts_modules(model):
        for name in expert_weight_names(module):
            weight = getattr(module, name)
            payload, scale = grouped._fp8_weight(
                module.fp8_layer_config,
                weight,
                module.is_transposed,
                get_master_scale(weight),
                module.fp8_tensor_scale,
            )
            h.update((widen(payload, torch.float32) / scale + 0.0).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    result: dict = {"rank": rank}
    try:
        strategy = get_strategy("fp8-lm-o3")
        model = tiny_moe("qwen3_moe")
        with torch.no_grad():  # experts of different magnitudes: per-expert scales would differ
            for name, p in model.named_parameters():
                if ".experts." in name:
                    p.mul_(torch.exp2(torch.arange(p.shape[0], dtype=p.dtype) * 1.5).reshape(-1, 1, 1))
        model = strategy.prepare_model(model)
        optimizer = strategy.create_optimizer([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2},
            "steps_per_print": 10**9,
        }
        engine, zero_opt, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=precision_config(strategy, config)
        )
        attach_zero_optimizer(zero_opt)
        inner = optimizer.optimizer
        names = {id(p): n for n, p in model.named_parameters()}
        others = [i for i, o in enumerate(inner.owners) if o != rank]
        result["fp8_names"] = sorted(names[id(p)] for p in inner.fp8_params)
        result["owned"] = [names[id(inner.fp8_params[i])] for i in inner.owned]
        result["non_owned_dtypes"] = sorted({str(inner.fp8_params[i].dtype) for i in others})
        result["losses"], result["digests"], result["forward_digests"] = [], [], []
        for ids in batches(3, batch=2 * MICRO, seq=16, seed=3):
            local = ids[rank * MICRO : (rank + 1) * MICRO]
            with strategy.forward_context():
                loss = engine(input_ids=local, labels=local).loss
            engine.backward(loss)
            engine.step()
            result["losses"].append(float(loss))
            h = hashlib.sha256()
            for i in range(len(inner.fp8_params)):
                payload, scale = inner.fp8_weight(i)
                h.update((widen(payload, torch.float32) / scale + 0.0).numpy().tobytes())
            result["digests"].append(h.hexdigest())
            result["forward_digests"].append(forward_digest(model))
        result["complete"] = True
    except Exception:
        result["error"] = traceback.format_exc()
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
