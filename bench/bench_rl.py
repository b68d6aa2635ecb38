"""RL fine-tuning under the strategies: the evidence of docs/rl.md and docs/benchmarks.md.

    python bench/bench_rl.py reference [--strategies ...]     # frozen reference: bytes, log-prob error
    python bench/bench_rl.py mismatch [--strategies ...]      # GRPO rollout vs training forward
    python bench/bench_rl.py dpo [--strategies ...] [--seeds 0,1,2]

1. reference: a tiny Llama (hidden 256, 4 layers) frozen as each strategy keeps a reference
   (`integrations.frozen`); its decoder blocks' bytes per parameter, and the error of its
   per-token log-probs on held text (under the strategy's forward context) against the FP32
   model computing in FP32: mean and max |Δ log p| per token, and |Δ| of a 32-token sequence's
   log-prob, which is what DPO's implicit reward β·(log π − log π_ref) and the KL term see.
   The old behaviour (`frozen_models="policy"`) is measured beside it.
2. mismatch: GRPO on a tiny Llama (hidden 128, 2 layers), 4 prompts × 4 generations of 16
   tokens, 3 steps, KL term (β 0.04), dropout off; the logged `precision/rollout_*`: mean and
   max |Δ log p| between the rollout's log-probs and the training forward's for the same tokens,
   and the spread of the ratio exp(Δ), under TRL's cached decoding and `rollout="full_forward"`.
3. dpo: recipes/dpo.py under each strategy, reference kept "forward" and "policy", same seeds;
   the final reward accuracy and margin, against the fp32 run.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = [
    "fp32",
    "bf16-mixed",
    "bf16-pure",
    "bf16-kahan",
    "bf16-sr",
    "bf16-fp32states",
    "collage-light",
    "collage-plus",
    "collage-8bit",
    "fp16-mixed",
    "fp16-als",
    "fp8-lm-o1",
    "fp8-lm-o2",
    "fp8-lm-o3",
    "coat",
]
# The FP8 scaling recipes beside tensorwise, under fp8-lm-o2.
RECIPES = ("rowwise", "blockwise", "mxfp8")


def _llama(tokenizer, hidden: int, layers: int, seed: int = 0):
    from transformers import LlamaForCausalLM

    from hf_lowprec.testing.llama import llama_config

    torch.manual_seed(seed)
    ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "eos_token_id", "bos_token_id")}
    return LlamaForCausalLM(llama_config(vocab=len(tokenizer), hidden=hidden, layers=layers, **ids))


def _cases(strategies: list[str]) -> list[tuple[str, dict]]:
    cases = [(s, {}) for s in strategies]
    if "fp8-lm-o2" in strategies:
        cases += [("fp8-lm-o2", {"recipe": r}) for r in RECIPES]
    return cases


def _label(strategy: str, options: dict) -> str:
    return strategy + (f" ({options['recipe']})" if "recipe" in options else "")


def _token_logps(model, ids, mask) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def reference(strategies: list[str]) -> list[dict]:
    import copy

    from hf_lowprec.data import build_tokenizer, embedded_corpus
    from hf_lowprec.integrations.frozen import FROZEN_ATTR, freeze_model
    from hf_lowprec.strategies.registry import get_strategy

    tokenizer = build_tokenizer()
    base = _llama(tokenizer, hidden=256, layers=4).eval()
    texts = [t for t in embedded_corpus() if len(t) > 400][:8]
    batch = tokenizer([t[:400] for t in texts], return_tensors="pt", truncation=True, max_length=33, padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        exact = _token_logps(base, ids, mask)
    rows = []
    for name, options in _cases(strategies):
        for mode in ("forward", "policy"):
            strategy = get_strategy(name, **options, frozen_models=mode)
            frozen = freeze_model(strategy, copy.deepcopy(base), "reference").eval()
            with torch.no_grad(), strategy.forward_context():
                got = _token_logps(frozen, ids, mask)
            delta = (got - exact).abs() * mask[:, 1:]
            seq = ((got - exact) * mask[:, 1:]).sum(1).abs()
            facts = frozen.__dict__[FROZEN_ATTR]
            rows.append(
                {
                    "strategy": _label(name, options),
                    "mode": mode,
                    "bytes_per_param": round(facts["blocks_bytes_per_param"], 4),
                    "mb": round(facts["bytes"] / 1e6, 2),
                    "token_mean": float(delta.sum() / mask[:, 1:].sum()),
                    "token_max": float(delta.max()),
                    "sequence_max": float(seq.max()),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def mismatch(strategies: list[str], steps: int = 3) -> list[dict]:
    import datasets

    import hf_lowprec.trl as hl_trl
    from hf_lowprec.data import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"
    folder = tempfile.mkdtemp(prefix="bench_rl_")
    _llama(tokenizer, hidden=128, layers=2).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    prompts = datasets.Dataset.from_dict({"prompt": ["Return the value", "Open a file", "The model", "A test"] * 4})

    def reward(completions, **kwargs):
        return [len(set(c.split())) / 4 for c in completions]

    rows = []
    for name, options in _cases(strategies):
        for mode in ("cached", "full_forward"):
            args = hl_trl.GRPOConfig(
                output_dir=os.path.join(folder, "out"),
                precision_strategy=name,
                precision_options={**options, "rollout": mode},
                use_cpu=True,
                per_device_train_batch_size=4,
                num_generations=4,
                max_completion_length=16,
                max_steps=steps,
                beta=0.04,
                disable_dropout=True,
                report_to="none",
                save_strategy="no",
                logging_steps=1,
                disable_tqdm=True,
                seed=0,
            )
            trainer = hl_trl.GRPOTrainer(
                model=folder, reward_funcs=reward, args=args, train_dataset=prompts, processing_class=tokenizer
            )
            start = time.perf_counter()
            trainer.train()
            seconds = (time.perf_counter() - start) / steps
            logs = [h for h in trainer.state.log_history if "precision/rollout_logp_diff_mean" in h]
            rows.append(
                {
                    "strategy": _label(name, options),
                    "rollout": mode,
                    "diff_mean": statistics.mean(h["precision/rollout_logp_diff_mean"] for h in logs),
                    "diff_max": max(h["precision/rollout_logp_diff_max"] for h in logs),
                    "ratio_std": statistics.mean(h["precision/rollout_ratio_std"] for h in logs),
                    "kl_first": logs[0].get("kl"),
                    "reference_bytes_per_param": round(
                        trainer.hf_lowprec_frozen_models["reference"]["blocks_bytes_per_param"], 4
                    ),
                    "seconds_per_step": round(seconds, 2),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def dpo(strategies: list[str], seeds: list[int], steps: int) -> list[dict]:
    rows = []
    for name in strategies:
        for mode in ("forward", "policy") if name != "fp32" else ("forward",):
            for seed in seeds:
                with tempfile.TemporaryDirectory() as out:
                    cmd = [sys.executable, os.path.join(ROOT, "recipes", "dpo.py"), "--precision_strategy", name]
                    cmd += ["--precision_options", json.dumps({"frozen_models": mode}), "--seed", str(seed)]
                    cmd += ["--max_steps", str(steps), "--output_dir", out, "--disable_tqdm", "true"]
                    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
                    line = next((x for x in done.stdout.splitlines() if x.startswith("hf_lowprec-recipe-result")), None)
                    if line is None:
                        raise RuntimeError(f"{name} {mode} seed {seed} failed:\n{done.stderr[-3000:]}")
                    result = json.loads(line.split(":", 1)[1])
                rows.append(
                    {
                        "strategy": name,
                        "mode": mode,
                        "seed": seed,
                        "accuracy": result["final_reward_accuracy"],
                        "margin": result["final_margin"],
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["reference", "mismatch", "dpo"])
    parser.add_argument("--strategies", default=",".join(ALL))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=0, help="training steps (mismatch: 3, dpo: 40 when 0)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    strategies = args.strategies.split(",")
    print(f"# load {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    if args.what == "reference":
        rows = reference(strategies)
    elif args.what == "mismatch":
        rows = mismatch(strategies, args.steps or 3)
    else:
        rows = dpo(strategies, [int(s) for s in args.seeds.split(",")], args.steps or 40)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))


if __name__ == "__main__":
    main()
