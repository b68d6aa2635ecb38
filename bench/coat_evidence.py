"""COAT evidence (docs/algorithms.md §4): state quantization error, saved-activation bytes, gradient error, B/param.

    python bench/coat_evidence.py [--steps 200] [--train 2000] [--train-only]

1. Mean relative error of FP8 optimizer states on real AdamW moments (a tiny GPT-2 trained
   `--steps` steps on the embedded corpus with torch.optim.AdamW): COAT's dynamic range
   expansion vs plain per-group FP8, and the peers that run on this machine (torchao's FP8
   and 8-bit state subclasses, bitsandbytes' 8-bit blockwise quantization).
2. Saved-activation bytes per transformer block (2-layer minus 1-layer model) for GPT-2, BERT
   and Llama tiny configs, BF16 autocast vs `coat`, from what autograd keeps alive.
3. Gradient error of `coat`'s FP8 activations vs the BF16 model on the same batch.
4. Model-state bytes/param of `coat` (FP32 master, BF16 + δθ), from `model_state_bytes`.
5. With `--train N`: `hf_lowprec.demo` training of bf16-mixed, coat and each coat piece on its
   own (same seed, data and schedule), eval perplexity and its ratio to bf16-mixed.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging

import torch
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import hf_lowprec
from hf_lowprec.coat.activations import compress_activations, saved_activation_bytes
from hf_lowprec.data import build_tokenizer, clm_datasets, tiny_gpt2_config
from hf_lowprec.fp8 import convert_to_fp8
from hf_lowprec.memory import model_state_bytes
from hf_lowprec.optim.coat_adamw import dequantize_state, quantize_state

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def adamw_snapshots(steps: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """m1 and m2 of every parameter (one FP32 tensor per parameter) after `steps` AdamW steps."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    train_ds, _ = clm_datasets(tokenizer, block_size=64)
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(train_ds, batch_size=8, shuffle=True)
    step = 0
    while step < steps:
        for batch in loader:
            model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == steps:
                break
    states = list(optimizer.state.values())
    return [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]


def mean_relative_error(tensors: list[torch.Tensor], method, signed: bool) -> float:
    """mean over the non-zero elements of all `tensors` of |x̂ − x| / |x|, in FP64.

    Each tensor is quantized on its own, as an optimizer stores each parameter's state (groups
    never straddle two parameters).
    """
    x = torch.cat([t.flatten() for t in tensors]).double()
    decoded = torch.cat([method(t, signed).flatten() for t in tensors]).double()
    nz = x != 0
    return ((decoded[nz] - x[nz]).abs() / x[nz].abs()).mean().item()


def _ours(expand: bool, dtype: torch.dtype, group_size: int = 128):
    return lambda x, signed: dequantize_state(quantize_state(x, group_size, dtype, expand))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x flattened and zero-padded to whole blocks (a peer's block must not straddle parameters;
    zeros change no block maximum). torchao's optimizers keep tensors below 4096 elements in FP32;
    here every tensor is quantized so that all methods see the same elements."""
    flat = x.detach().float().flatten()
    return torch.nn.functional.pad(flat, (0, -flat.numel() % block))


def _unblocks(decoded: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return decoded.flatten()[: x.numel()].view(x.shape)


def _torchao_fp8(x: torch.Tensor, signed: bool) -> torch.Tensor:
    from torchao.optim.subclass_fp8 import OptimStateFp8

    flat = _blocks(x, 256)
    state = OptimStateFp8.zeros(flat.shape, block_size=256)
    state.copy_(flat)
    return _unblocks(state.dequantize(), x)


def _torchao_8bit(x: torch.Tensor, signed: bool) -> torch.Tensor:
    from torchao.optim.subclass_8bit import OptimState8bit

    flat = _blocks(x, 256)
    state = OptimState8bit.zeros(flat.shape, signed=signed, block_size=256)
    state.copy_(flat)
    return _unblocks(state.dequantize(), x)


def _bnb_blockwise(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """bitsandbytes' own quantize/dequantize. Its CPU kernel (0.50.2) maps |x| below about
    2e-5·absmax, exact zeros included, to the code 2.1e-5·absmax instead of the nearest code, so
    the mean relative error of this row is dominated by those elements. The same dynamic map
    rounded to the nearest code is torchao's `OptimState8bit` row (identical errors here)."""
    import bitsandbytes.functional as F

    code = F.create_dynamic_map(signed=signed)
    q, state = F.quantize_blockwise(_blocks(x, 256), code=code, blocksize=256)
    return _unblocks(F.dequantize_blockwise(q, state), x)


def state_error_table(steps: int) -> list[tuple[str, float | None, float | None]]:
    m1, m2 = adamw_snapshots(steps)
    methods = [
        ("coat: expand, E4M3 / E4M3, G=128", _ours(True, E4M3), _ours(True, E4M3)),
        ("coat: expand, E4M3 / E5M2, G=128", _ours(True, E4M3), _ours(True, E5M2)),
        ("plain per-group E4M3 / E4M3, G=128", _ours(False, E4M3), _ours(False, E4M3)),
        ("plain per-group E4M3 / E5M2, G=128", _ours(False, E4M3), _ours(False, E5M2)),
    ]
    peers = [
        ("torchao OptimStateFp8 (E4M3, block 256)", "torchao", _torchao_fp8),
        ("torchao OptimState8bit (dynamic map, block 256)", "torchao", _torchao_8bit),
        ("bitsandbytes 8-bit blockwise (dynamic map, block 256)", "bitsandbytes", _bnb_blockwise),
    ]
    rows = [(name, mean_relative_error(m1, f1, True), mean_relative_error(m2, f2, False)) for name, f1, f2 in methods]
    for name, package, fn in peers:
        if importlib.util.find_spec(package) is None:
            rows.append((f"{name}: not installed", None, None))
            continue
        rows.append((name, mean_relative_error(m1, fn, True), mean_relative_error(m2, fn, False)))
    return rows


def tiny_model(kind: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(
            GPT2Config(
                vocab_size=256,
                n_positions=128,
                n_embd=64,
                n_layer=layers,
                n_head=2,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
    if kind == "bert":
        return BertForMaskedLM(
            BertConfig(
                vocab_size=256,
                hidden_size=64,
                num_hidden_layers=layers,
                num_attention_heads=2,
                intermediate_size=256,
                max_position_embeddings=128,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
    )


def coat_model(model: torch.nn.Module) -> torch.nn.Module:
    return compress_activations(convert_to_fp8(model))


def forward_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=ids, labels=ids).loss

    return saved_activation_bytes(forward)[1]


def activation_table(batch: int = 8, seq: int = 128) -> list[tuple[str, int, int]]:
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    rows = []
    for kind in ("gpt2", "bert", "llama"):
        per_block = {}
        for name, convert in (("bf16", lambda m: m), ("coat", coat_model)):
            two, one = (forward_bytes(convert(tiny_model(kind, n)), ids) for n in (2, 1))
            per_block[name] = two - one
        rows.append((kind, per_block["bf16"], per_block["coat"]))
    return rows


def gradients(model: torch.nn.Module, ids: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(input_ids=ids, labels=ids).loss.backward()
    return torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])


def gradient_errors(kind: str = "gpt2", batch: int = 8, seq: int = 128) -> dict[str, float]:
    """Norm-wise relative gradient errors: coat vs BF16 autocast, and BF16 vs FP32 for scale."""
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    g32 = gradients(tiny_model(kind, 2), ids, autocast=False)
    g16 = gradients(tiny_model(kind, 2), ids, autocast=True)
    gcoat = gradients(coat_model(tiny_model(kind, 2)), ids, autocast=True)
    gact = gradients(compress_activations(tiny_model(kind, 2)), ids, autocast=True)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    return {
        "coat vs bf16": rel(gcoat, g16),
        "FP8 non-linear saves only vs bf16": rel(gact, g16),
        "bf16 vs fp32": rel(g16, g32),
        "coat vs fp32": rel(gcoat, g32),
    }


def bytes_per_param() -> dict[str, float]:
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    out = {}
    for label, options in (
        ("coat (FP32 master)", {}),
        ("coat master_weights=bf16-collage", {"master_weights": "bf16-collage"}),
    ):
        strategy = hf_lowprec.get_strategy("coat", **options)
        model = strategy.prepare_model(tiny_model("gpt2", 2))
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
        strategy.train_step(model, ids, optimizer)
        out[label] = model_state_bytes(model, optimizer)["total"]
    return out


#: bf16-mixed first (the reference), then `coat` and each of its pieces on its own.
TRAINING_RUNS = (
    ("bf16-mixed", "bf16-mixed", None),
    ("coat", "coat", None),
    ("coat master_weights=bf16-collage", "coat", {"master_weights": "bf16-collage"}),
    ("coat states=False (FP8 linear + activations)", "coat", {"states": False}),
    ("coat activations=False (FP8 states only)", "coat", {"activations": False}),
)


def training_rows(steps: int):
    """Yield (label, demo row) for each of TRAINING_RUNS, same seed, data and schedule."""
    import tempfile

    from hf_lowprec.demo import run_strategy

    tokenizer = build_tokenizer()
    train_ds, eval_ds = clm_datasets(tokenizer, block_size=64)
    with tempfile.TemporaryDirectory() as out:
        for label, name, options in TRAINING_RUNS:
            yield (
                label,
                run_strategy(
                    name,
                    steps=steps,
                    batch_size=8,
                    lr=1e-3,
                    seed=0,
                    tokenizer=tokenizer,
                    train_ds=train_ds,
                    eval_ds=eval_ds,
                    output_dir=out,
                    options=options,
                ),
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="AdamW steps before the state snapshot")
    parser.add_argument(
        "--train", type=int, default=0, help="also train bf16-mixed and coat (and its pieces) this many steps"
    )
    parser.add_argument("--train-only", action="store_true", help="skip sections 1-4")
    ns = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)

    if not ns.train_only:
        print(
            f"1. FP8 optimizer-state error, tiny GPT-2 after {ns.steps} AdamW steps (mean relative error, non-zero elements)"
        )
        rows = state_error_table(ns.steps)
        print(f"{'method':<58} {'m1':>8} {'m2':>8}")
        for name, e1, e2 in rows:
            cells = "".join(f" {e:>8.4f}" if e is not None else f" {'-':>8}" for e in (e1, e2))
            print(f"{name:<58}{cells}")
        plain = rows[2]
        print(f"expansion / plain (E4M3/E4M3): m1 {rows[0][1] / plain[1]:.3f}x, m2 {rows[0][2] / plain[2]:.3f}x")

        print("\n2. Saved-activation bytes per transformer block, batch 8x128, hidden 64")
        print(f"{'model':<8} {'bf16':>10} {'coat':>10} {'ratio':>7}")
        for kind, bf16, coat in activation_table():
            print(f"{kind:<8} {bf16:>10} {coat:>10} {coat / bf16:>7.3f}")

        print("\n3. Gradient error (norm-wise relative, all parameters), tiny GPT-2, batch 8x128")
        for label, value in gradient_errors().items():
            print(f"{label:<36} {value:.4f}")

        print("\n4. Model-state bytes/param (hf_lowprec.memory.model_state_bytes), tiny GPT-2")
        for label, value in bytes_per_param().items():
            print(f"{label:<36} {value:.2f}")

    if ns.train:
        print(f"\n5. Training, tiny GPT-2, {ns.train} steps, batch 8x64, cosine lr 1e-3, seed 0 (hf_lowprec.demo)")
        print(f"{'strategy':<48} {'train loss':>10} {'eval ppl':>9} {'vs bf16':>8} {'step ms':>8}")
        reference = None
        for label, row in training_rows(ns.train):
            reference = reference or row["eval_perplexity"]
            print(
                f"{label:<48} {row['final_train_loss']:>10.4f} {row['eval_perplexity']:>9.2f} "
                f"{row['eval_perplexity'] / reference:>8.4f} {row['median_step_ms']:>8.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
