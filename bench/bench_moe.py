"""FP8 for Mixture-of-Experts (hf_lowprec/fp8/experts.py): the evidence of docs/benchmarks.md.

    python bench/bench_moe.py share                      # FP8 share of weight GEMMs per architecture
    python bench/bench_moe.py snr [--outliers 4 --factor 1e5]
    python bench/bench_moe.py bytes                      # model-state bytes/param, tiny (measured) and planned
    python bench/bench_moe.py fidelity --steps 400 --seeds 0,1,2 [--strategies ...] [--threads 1]

1. share: a tiny model of each MoE architecture transformers ships (`hf_lowprec.testing.moe`),
   prepared by each FP8 strategy; the share of a token's weight-GEMM multiply-adds that run in
   FP8 (the startup report's figure: LM head and routers left out).
2. snr: one expert weight set (8 experts, 512 × 512), tokens routed unevenly (one expert
   without tokens), `--outliers` token rows × `--factor`; forward y, input gradient dx and weight
   gradient dW of the FP8 grouped GEMM under each recipe against FP64 on the unquantized
   operands: the ordinary rows' median SNR (y, dx), and dW's SNR over the experts that have
   tokens, clean and with outliers.
3. bytes: model-state bytes per parameter (weights, gradients, optimizer states) measured on a
   tiny Qwen3-MoE whose experts hold most parameters, and planned on the meta device for
   Qwen3-30B-A3B (`hf-lowprec memory`), bf16-mixed against the FP8 strategies.
4. fidelity: a tiny Qwen3-MoE (hidden 128, 8 experts of width 128, top-2, 2 layers) trained on
   the embedded corpus, the same batches and schedule for every strategy; eval loss per seed,
   the mean over seeds and its ratio to bf16-mixed's mean.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import time

import torch

from hf_lowprec.fp8.experts import fp8_grouped_linear
from hf_lowprec.fp8.scaling_recipes import SCALING_RECIPES
from hf_lowprec.report import describe
from hf_lowprec.strategies.registry import get_strategy
from hf_lowprec.testing import row_snr_db
from hf_lowprec.testing.moe import MOE_ARCHITECTURES, tiny_moe

FP8_STRATEGIES = ("fp8-lm-o1", "fp8-lm-o2", "fp8-lm-o3", "coat")


def _context() -> str:
    load = os.getloadavg()[0]
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load:.2f}"


def share_table() -> list[dict]:
    rows = []
    for arch in MOE_ARCHITECTURES:
        row: dict = {"architecture": arch}
        for name in ("bf16-mixed", *FP8_STRATEGIES):
            strategy = get_strategy(name)
            model = strategy.prepare_model(tiny_moe(arch))
            fp8 = describe(strategy, model)["fp8"]
            row[name] = fp8["weight_gemm_share"]
            row["experts_share"] = fp8["experts_gemm_share"]
        rows.append(row)
    return rows


def snr_table(outliers: int, factor: float, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    experts, features, tokens = 8, 512, 2048
    counts = torch.tensor([512, 384, 0, 300, 212, 256, 200, 184])  # one expert without tokens
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    rows_of = torch.repeat_interleave(torch.arange(experts), counts)
    w = torch.randn(experts, features, features, generator=g, dtype=torch.float64) * features**-0.5
    x = torch.randn(tokens, features, generator=g, dtype=torch.float64)
    dy = torch.randn(tokens, features, generator=g, dtype=torch.float64)
    special = torch.randperm(tokens, generator=g)[:outliers]
    ordinary = torch.ones(tokens, dtype=torch.bool)
    ordinary[special] = False

    def reference(xr: torch.Tensor, dyr: torch.Tensor) -> tuple[torch.Tensor, ...]:
        we = w[rows_of]  # tokens × N × K
        y = torch.einsum("sk,snk->sn", xr, we)
        dx = torch.einsum("sn,snk->sk", dyr, we)
        dw = torch.zeros_like(w).index_add_(0, rows_of, torch.einsum("sn,sk->snk", dyr, xr))
        return y, dx, dw

    out = []
    for recipe in SCALING_RECIPES:
        row: dict = {"recipe": recipe}
        for label in ("clean", "outliers"):
            xr, dyr = x.clone(), dy.clone()
            if label == "outliers":
                xr[special] *= factor
                dyr[special] *= factor
            y_ref, dx_ref, dw_ref = reference(xr, dyr)
            xf = xr.float().requires_grad_()
            wf = w.float().requires_grad_()
            y = fp8_grouped_linear(xf, wf, offsets, rows_of, recipe=recipe)
            y.backward(dyr.float())
            row[f"y_{label}"] = row_snr_db(y_ref, y.detach())[ordinary].median().item()
            row[f"dx_{label}"] = row_snr_db(dx_ref, xf.grad)[ordinary].median().item()
            used = counts > 0
            err = (dw_ref[used] - wf.grad[used].double()).pow(2).sum()
            row[f"dw_{label}"] = 10 * math.log10(dw_ref[used].pow(2).sum().item() / err.item())
            if label == "outliers":
                row["dw_empty_expert_zero"] = bool((wf.grad[~used] == 0).all())
        out.append(row)
    return out


def bytes_table() -> list[dict]:
    from hf_lowprec.cli import memory_plan
    from hf_lowprec.memory import plan_model_state

    rows = []
    for name in ("bf16-mixed", *FP8_STRATEGIES):
        strategy = get_strategy(name)
        model = strategy.prepare_model(tiny_moe("qwen3_moe", experts=16, intermediate=64))
        optimizer = strategy.create_optimizer([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        rows.append({"model": "tiny qwen3_moe (measured)", "strategy": name, **plan_model_state(model, optimizer)})
    for row in memory_plan("qwen3-30b-a3b", ["bf16-mixed", *FP8_STRATEGIES]):
        rows.append({"model": "qwen3-30b-a3b (planned)", **row})
    base = {r["model"]: r["total"] for r in rows if r["strategy"] == "bf16-mixed"}
    for r in rows:
        r["ratio"] = r["total"] / base[r["model"]]
    return rows


def fidelity(steps: int, seeds: list[int], strategies: list[str], batch: int = 8) -> list[dict]:
    from hf_lowprec.data import build_tokenizer, clm_datasets

    tokenizer = build_tokenizer()
    train_ds, eval_ds = clm_datasets(tokenizer, block_size=64)
    train = torch.stack([torch.as_tensor(train_ds[i]["input_ids"]) for i in range(len(train_ds))])
    evals = torch.stack([torch.as_tensor(eval_ds[i]["input_ids"]) for i in range(len(eval_ds))])
    results = []
    for name in strategies:
        losses = []
        for seed in seeds:
            strategy = get_strategy(name)
            model = strategy.prepare_model(
                tiny_moe("qwen3_moe", seed=seed, vocab=len(tokenizer), hidden=128, intermediate=128)
            )
            optimizer = strategy.create_optimizer(model.parameters(), lr=2e-3, weight_decay=0.01)
            warmup = max(steps // 20, 1)
            schedule = torch.optim.lr_scheduler.LambdaLR(
                optimizer,
                lambda s, w=warmup: min((s + 1) / w, 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))),
            )
            order = torch.Generator().manual_seed(1000 + seed)
            model.train()
            for _ in range(steps):
                ids = train[torch.randint(0, train.shape[0], (batch,), generator=order)]
                with strategy.forward_context():
                    loss = model(input_ids=ids, labels=ids).loss
                strategy.scale_loss(loss).backward()
                if hasattr(strategy, "clip_grad_norm"):
                    strategy.clip_grad_norm(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
            model.eval()
            with torch.no_grad(), strategy.forward_context():
                total = sum(model(input_ids=b, labels=b).loss.float().item() for b in evals.split(16))
            losses.append(total / math.ceil(evals.shape[0] / 16))
        results.append({"strategy": name, "eval_loss": losses, "mean": statistics.fmean(losses)})
    base = next(r["mean"] for r in results if r["strategy"] == "bf16-mixed")
    for r in results:
        r["ratio"] = r["mean"] / base
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["share", "snr", "bytes", "fidelity"])
    parser.add_argument("--outliers", type=int, default=4)
    parser.add_argument("--factor", type=float, default=1e5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--strategies", default="bf16-mixed," + ",".join(FP8_STRATEGIES))
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("hf_lowprec").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if args.what == "share":
        rows = share_table()
        print("| architecture | experts' share of weight GEMMs | bf16-mixed | " + " | ".join(FP8_STRATEGIES) + " |")
        print("|---|---|---|" + "---|" * len(FP8_STRATEGIES))
        for r in rows:
            cells = " | ".join(f"{r[n]:.3f}" for n in FP8_STRATEGIES)
            print(f"| {r['architecture']} | {r['experts_share']:.2f} | {r['bf16-mixed']:.3f} | {cells} |")
    elif args.what == "snr":
        print(f"SNR in dB against FP64; {args.outliers} outlier token rows ×{args.factor:g}")
        print(
            "| recipe | y clean | y outliers | dx clean | dx outliers | dW clean | dW outliers | empty expert dW = 0 |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in snr_table(args.outliers, args.factor):
            print(
                f"| {r['recipe']} | {r['y_clean']:.1f} | {r['y_outliers']:.1f} | {r['dx_clean']:.1f} | "
                f"{r['dx_outliers']:.1f} | {r['dw_clean']:.1f} | {r['dw_outliers']:.1f} | {r['dw_empty_expert_zero']} |"
            )
    elif args.what == "bytes":
        print("| model | strategy | params | grads | optim | total B/param | × bf16-mixed |")
        print("|---|---|---|---|---|---|---|")
        for r in bytes_table():
            print(
                f"| {r['model']} | {r['strategy']} | {r['params']:.2f} | {r['grads']:.2f} | {r['optimizer_states']:.2f} | "
                f"{r['total']:.2f} | {r['ratio']:.3f} |"
            )
    else:
        seeds = [int(s) for s in args.seeds.split(",")]
        rows = fidelity(args.steps, seeds, args.strategies.split(","))
        print(f"tiny Qwen3-MoE, {args.steps} steps, seeds {seeds}: eval loss")
        print("| strategy | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | × bf16-mixed |")
        print("|---|" + "---|" * (len(seeds) + 2))
        for r in rows:
            cells = " | ".join(f"{v:.4f}" for v in r["eval_loss"])
            print(f"| {r['strategy']} | {cells} | {r['mean']:.4f} | {r['ratio']:.4f} |")
    print(f"({time.perf_counter() - start:.0f} s; {_context()})")


if __name__ == "__main__":
    main()
