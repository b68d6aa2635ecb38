"""Evidence for FP16 with Graphcore automatic loss scaling (docs/algorithms.md §5), on a tiny GPT-2.

Run `python bench/als_evidence.py` (about 10 minutes on one core; `--part` picks one part).

1. `failure`: the known failure of dynamic loss scaling. A tiny GPT-2 whose LayerNorm gains are
   scaled up by `--alpha` (as in checkpoints whose gains grew large in BF16) is finetuned in
   FP16: fp16-mixed (torch's GradScaler), fp16-als, and fp16-mixed with ALS in place of
   GradScaler: skipped steps, final loss, scale trace.
2. `static`: pure FP16 weights and gradients with a static loss scale of 1 (ALS's machinery
   with its scale pinned to 1) against fp16-als, final losses.
3. `accumulation`: running-mean against plain-sum gradient accumulation in FP16 on large
   gradients: overflowing elements and the error against the FP64 mean.

Every comparison runs three seeds. A report, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hf_lowprec
from hf_lowprec.scaling import AutomaticLossScaler, running_mean_

VOCAB = 256


def tiny_gpt2(seed: int, alpha: float = 1.0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    # activation_function="gelu" (one op): GPT-2's default tanh GELU forms x³, which overflows
    # FP16 for |x| > 40 inside the module, and tanh'(inf)·inf is a NaN in backward that no
    # loss scale can prevent (pure FP16 only; autocast runs pow in FP32).
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        activation_function="gelu",
    )
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # LayerNorm gains: the forward stays in range (each LN output is O(alpha)) while
            # the backward spreads gradients over ~40 binades (max ~50, median ~1e-15 at 64).
            if "ln" in name and name.endswith("weight"):
                param.mul_(alpha)
    return model


def data(seed: int, n: int = 8, batch: int = 16, seq: int = 64) -> list[torch.Tensor]:
    """A learnable stream: each row repeats a random 8-token motif, so the loss can fall far."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = []
    for _ in range(n):
        motif = torch.randint(0, VOCAB, (batch, 8), generator=g)
        out.append(motif.repeat(1, seq // 8))
    return out


def train(name: str, seed: int, steps: int, lr: float, alpha: float, **options) -> dict:
    autocast_als = name == "fp16-mixed+als"
    strategy = hf_lowprec.get_strategy("fp16-mixed" if autocast_als else name, **options)
    model = strategy.prepare_model(tiny_gpt2(seed, alpha))
    if autocast_als:
        # Bench-only composition: fp16-mixed's autocast and FP32 masters with ALS in place of
        # GradScaler, to separate the scaler's effect from pure-FP16 compute.
        strategy.scaler = AutomaticLossScaler().track(model)
    optimizer = strategy.create_optimizer(model.parameters(), lr=lr, weight_decay=0.0)
    batches = data(seed)
    losses, scales = [], []
    for step in range(steps):
        ids = batches[step % len(batches)]
        losses.append(strategy.train_step(model, ids, optimizer).item())
        scales.append(strategy.metrics().get("precision/loss_scale", 1.0))
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    metrics = strategy.metrics()
    return {
        "final_loss": statistics.mean(losses[-5:]),
        "first_loss": losses[0],
        "skipped": int(metrics["precision/skipped_steps"]),
        "clipped_total": int(getattr(strategy.scaler, "total_clipped", 0)) if hasattr(strategy, "scaler") else 0,
        "finite_params": finite,
        "scale_trace": [*scales[:: max(1, steps // 12)], scales[-1]],
        "min_scale": min(scales),
    }


def fmt_scale(s: float) -> str:
    return f"2^{round(torch.tensor(s).log2().item())}" if s > 0 else "0"


def part_failure(args) -> None:
    print(f"\n## 1. Weights x{args.alpha}: fp16-mixed (GradScaler) vs fp16-als, {args.steps} steps, lr {args.lr}\n")
    print("| strategy | seed | first loss | final loss | skipped steps | clipped elements | min scale | scale trace |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.failure_runs:
        for seed in args.seeds:
            r = train(name, seed, args.steps, args.lr, args.alpha)
            trace = " ".join(fmt_scale(s) for s in r["scale_trace"])
            print(
                f"| {name} | {seed} | {r['first_loss']:.3f} | {r['final_loss']:.3f} | {r['skipped']} | "
                f"{r['clipped_total']} | {fmt_scale(r['min_scale'])} | {trace} |",
                flush=True,
            )


def part_static(args) -> None:
    print(f"\n## 2. Pure FP16, static loss scale 1 vs fp16-als, {args.steps} steps, lr {args.lr}\n")
    print("| run | seed | first loss | final loss | skipped | final scale |")
    print("|---|---|---|---|---|---|")
    runs = {
        "fp16, static scale 1": dict(init_scale=1.0, min_scale=1.0, max_scale=1.0),
        "fp16-als": {},
    }
    for label, options in runs.items():
        for seed in args.seeds:
            r = train("fp16-als", seed, args.steps, args.lr, 1.0, **options)
            print(
                f"| {label} | {seed} | {r['first_loss']:.3f} | {r['final_loss']:.3f} | {r['skipped']} | "
                f"{fmt_scale(r['scale_trace'][-1])} |",
                flush=True,
            )


def part_underflow(args) -> None:
    """Where the gradients of the static run sit in FP16: FP32 reference gradients of the
    untrained model, as shares of elements that FP16 flushes to zero (< 2^-24) or holds as
    subnormals (< 2^-14, fewer than 11 significant bits) at loss scale 1 and at 2^10."""
    print("\n## 2b. FP32 reference gradients of the tiny GPT-2 against FP16's floor\n")
    print(
        "| seed | kind | elements | < 2^-24 at scale 1 | < 2^-14 at scale 1 | < 2^-24 at scale 2^10 | < 2^-14 at scale 2^10 |"
    )
    print("|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        model = tiny_gpt2(seed)
        activation_grads = []

        def capture(module, inputs, output, sink=activation_grads):
            if torch.is_tensor(output) and output.requires_grad:
                output.register_hook(sink.append)

        for module in model.modules():
            if next(module.children(), None) is None:
                module.register_forward_hook(capture)
        ids = data(seed)[0]
        model(input_ids=ids, labels=ids).loss.backward()
        kinds = {"weights": [p.grad for p in model.parameters()], "activations": activation_grads}
        for kind, grads in kinds.items():
            flat = torch.cat([g.detach().abs().flatten() for g in grads])
            share = lambda scale, edge, flat=flat: f"{float(((flat * scale) < edge).double().mean()):.1%}"  # noqa: E731
            print(
                f"| {seed} | {kind} | {flat.numel()} | {share(1, 2**-24)} | {share(1, 2**-14)} | "
                f"{share(2**10, 2**-24)} | {share(2**10, 2**-14)} |",
                flush=True,
            )


def part_accumulation(args) -> None:
    print("\n## 3. Gradient accumulation in FP16 over 16 micro-batches of large gradients\n")
    print(
        "| seed | max |g_k| | plain sum: inf elements | running mean: inf elements | running mean max rel. error vs FP64 |"
    )
    print("|---|---|---|---|---|")
    for seed in args.seeds:
        g = torch.Generator().manual_seed(seed)
        grads = [(2e4 * torch.randn(65536, generator=g) + 8e3).clamp(-6e4, 6e4).half() for _ in range(16)]
        total = torch.zeros_like(grads[0])
        mean = torch.zeros_like(grads[0])
        for k, grad in enumerate(grads, start=1):
            total += grad
            running_mean_(mean, grad, k)
        reference = torch.stack([x.double() for x in grads]).mean(0)
        error = ((mean.double() - reference).abs().max() / reference.abs().max()).item()
        print(
            f"| {seed} | {max(x.abs().max().item() for x in grads):.0f} | {int(torch.isinf(total).sum())} | "
            f"{int(torch.isinf(mean).sum())} | {error:.2e} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["failure", "static", "underflow", "accumulation", "all"], default="all")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--alpha", type=float, default=64.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--failure-runs",
        nargs="+",
        default=["fp16-mixed", "fp16-als", "fp16-mixed+als"],
        help="part 1 runs; fp16-mixed+als is fp16-mixed with ALS instead of GradScaler",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print("# fp16-als evidence:", json.dumps(dict(vars(args).items())))
    if args.part in ("failure", "all"):
        part_failure(args)
    if args.part in ("static", "all"):
        part_static(args)
    if args.part in ("underflow", "all"):
        part_underflow(args)
    if args.part in ("accumulation", "all"):
        part_accumulation(args)


if __name__ == "__main__":
    main()
