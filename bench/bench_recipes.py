"""FP8 scaling recipes (hf_lowprec/fp8/scaling_recipes.py): GEMM output SNR per token row with massive
activations, and training fidelity through the Trainer.

    python bench/bench_recipes.py [--rows 1024] [--features 1024] [--outliers 4] [--factor 1e5]
    python bench/bench_recipes.py --fidelity 3000 --seeds 0,1,2 [--threads 1]

1. SNR: an FP8 linear layer's forward output y = x·Wᵀ and input gradient dx = dy·W under each
   recipe against FP64 (the unquantized operands), per token row, for Gaussian activations and
   for the same activations with `--outliers` rows multiplied by `--factor` (massive
   activations). Printed: the ordinary rows' median SNR without and with the outlier rows, and
   the outlier rows' own median.
2. With `--fidelity N`: the tiny GPT-2 of `hf_lowprec.demo` (n_embd 128, so every block layer is
   on blockwise's 128-blocks) trained N steps through the Trainer under bf16-mixed and under
   fp8-lm-o2 with each recipe, per seed; eval perplexity, the mean over seeds and its ratio to
   bf16-mixed's mean.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile

import torch

from hf_lowprec.fp8 import fp8_linear
from hf_lowprec.fp8.scaling_recipes import SCALING_RECIPES
from hf_lowprec.testing import row_snr_db


def snr_table(rows: int, features: int, outliers: int, factor: float, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    clean = torch.randn(rows, features, generator=g, dtype=torch.float64)
    w = torch.randn(features, features, generator=g, dtype=torch.float64) * features**-0.5
    dy = torch.randn(rows, features, generator=g, dtype=torch.float64)
    special = torch.randperm(rows, generator=g)[:outliers]
    spiked = clean.clone()
    spiked[special] *= factor
    dy_spiked = dy.clone()
    dy_spiked[special] *= factor  # the outlier tokens' gradients are outliers too
    ordinary = torch.ones(rows, dtype=torch.bool)
    ordinary[special] = False
    out = []
    for recipe in SCALING_RECIPES:
        row = {"recipe": recipe}
        for label, x, g_out in (("clean", clean, dy), ("outliers", spiked, dy_spiked)):
            xf = x.float().requires_grad_()
            y = fp8_linear(xf, w.float(), recipe=recipe)
            y.backward(g_out.float())
            y_snr = row_snr_db(x @ w.t(), y.detach())
            dx_snr = row_snr_db(g_out @ w, xf.grad)
            row[f"y_{label}"] = y_snr[ordinary].median().item()
            row[f"dx_{label}"] = dx_snr[ordinary].median().item()
            if label == "outliers":
                row["y_outlier_rows"] = y_snr[~ordinary].median().item()
        out.append(row)
    return out


def fidelity(steps: int, seeds: list[int], threads: int) -> list[dict]:
    from hf_lowprec.data import build_tokenizer, clm_datasets
    from hf_lowprec.demo import run_strategy

    logging.getLogger("transformers").setLevel(logging.ERROR)
    if threads:
        torch.set_num_threads(threads)
    tokenizer = build_tokenizer()
    train_ds, eval_ds = clm_datasets(tokenizer, block_size=64)
    runs = [("bf16-mixed", None)] + [("fp8-lm-o2", {"recipe": r}) for r in SCALING_RECIPES]
    rows = []
    for name, options in runs:
        ppl = []
        for seed in seeds:
            with tempfile.TemporaryDirectory() as out:
                result = run_strategy(
                    name,
                    steps=steps,
                    batch_size=8,
                    lr=1e-3,
                    seed=seed,
                    tokenizer=tokenizer,
                    train_ds=train_ds,
                    eval_ds=eval_ds,
                    output_dir=out,
                    options=options,
                    config={"n_embd": 128},
                )
            ppl.append(result["eval_perplexity"])
            label = name if options is None else f"{name} {options['recipe']}"
            print(f"{label:<24} seed {seed}: eval ppl {ppl[-1]:.3f}", flush=True)
        rows.append({"run": label, "ppl": ppl, "mean": statistics.fmean(ppl)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--outliers", type=int, default=4)
    parser.add_argument("--factor", type=float, default=1e5)
    parser.add_argument("--fidelity", type=int, default=0, help="training steps per run (0: SNR table only)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--threads", type=int, default=1)
    ns = parser.parse_args(argv)
    if ns.fidelity:
        rows = fidelity(ns.fidelity, [int(s) for s in ns.seeds.split(",")], ns.threads)
        base = rows[0]["mean"]
        print("| run | eval ppl per seed | mean | ratio to bf16-mixed |\n|---|---|---|---|")
        for r in rows:
            seeds = ", ".join(f"{p:.3f}" for p in r["ppl"])
            print(f"| {r['run']} | {seeds} | {r['mean']:.3f} | {r['mean'] / base:.4f} |")
        return
    print(
        f"{ns.rows} token rows × {ns.features} features, {ns.outliers} rows ×{ns.factor:g}; "
        "median SNR (dB) of the ordinary rows vs FP64"
    )
    print("| recipe | y, no outliers | y, with outliers | dx, no outliers | dx, with outliers | y, outlier rows |")
    print("|---|---|---|---|---|---|")
    for r in snr_table(ns.rows, ns.features, ns.outliers, ns.factor):
        print(
            f"| {r['recipe']} | {r['y_clean']:.1f} | {r['y_outliers']:.1f} | {r['dx_clean']:.1f} | "
            f"{r['dx_outliers']:.1f} | {r['y_outlier_rows']:.1f} |"
        )


if __name__ == "__main__":
    main()
