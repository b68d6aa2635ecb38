"""The tests' shared helpers, each defined once here: a tiny GPT-2, fixed random batches, bit
patterns and rounding bounds, Trainer arguments and callbacks, what several ranks share, the
GPU marks. `tests/launching.py` runs what users run in fresh interpreters (`hf-lowprec launch`,
torchrun ranks, recipes); `tests/fp8_reference.py` holds the FP8 references. No test module
imports another (`tests/test_test_imports.py`). What the benchmarks use too (host-sync
counters, the GPU checks' GPT-2 step, SNR) is in `hf_lowprec.testing`.
"""

import functools
import math
import socket

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, TrainerCallback

VOCAB = 256

# Marks of a test or parameter that needs a GPU: the `cuda` marker (`make gpu-check` runs
# `pytest -m cuda`) and a skip, reported as such, where there is none.
requires_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Unit roundoff u = 2^-p of round to nearest, p significand bits with the implicit one:
# |r(x) − x| ≤ u·|x| for x in the dtype's normal range (FP8 after its scale puts x there).
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
    torch.float8_e4m3fn: 2.0**-4,
    torch.float8_e5m2: 2.0**-3,
}


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of `dtype` (`UNIT_ROUNDOFF`): the relative error bound of one rounding to nearest."""
    return UNIT_ROUNDOFF[dtype]


def gamma(n: int, u: float = UNIT_ROUNDOFF[torch.float32]) -> float:
    """Higham's γₙ = n·u / (1 − n·u): the relative error bound of n roundings of unit roundoff
    `u` (an n-term sum in any order; FP32's u by default)."""
    return n * u / (1 - n * u)


def rounding_bound(dtype: torch.dtype, n_roundings: int, magnitude: float = 1.0) -> float:
    """γₙ·magnitude (`gamma`): the error of a result after `n_roundings` roundings to `dtype` of
    quantities of at most `magnitude`, none of them cancelling."""
    nu = n_roundings * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"{n_roundings} roundings of {dtype} bound nothing (n·u = {nu} ≥ 1)")
    return gamma(n_roundings, unit_roundoff(dtype)) * magnitude


def e4m3_half_ulp(y: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest E4M3 error bound: max(2⁻⁴·|y|, 2⁻¹⁰) (2⁻¹⁰ is half the smallest subnormal)."""
    return torch.maximum(y.abs() * 2.0**-4, torch.full_like(y, 2.0**-10))


def snr_floor_db(*dtypes: torch.dtype) -> float:
    """The expected SNR floor of a sum of products whose operands are each rounded once to
    `dtypes`: a rounding error uniform in ±ulp/2 has E[δ²] = ulp²/(12·x²) ≤ u²/3 whatever the
    significand, and the independent, zero-mean errors of a dot product add their powers,
    E[(ŷ − y)²] ≤ Σ uᵢ²/3 · Σ aⱼ²bⱼ² = Σ uᵢ²/3 · E[y²] for independent zero-mean operands."""
    return 10 * math.log10(3 / sum(unit_roundoff(d) ** 2 for d in dtypes))


def tiny_gpt2(
    seed: int = 0, n_embd: int = 64, n_positions: int = 32, dropout: float = 0.0, **config
) -> GPT2LMHeadModel:
    """The tests' GPT-2 from config: VOCAB tokens, 2 layers of 2 heads, initialised from `seed`.

    Widths are multiples of 16 so FP8 strategies can convert every block layer. `dropout` is
    each of GPT-2's three dropouts (0: a run's losses are its weights'); `config` adds to the
    `GPT2Config` (`initializer_range`, ...)."""
    torch.manual_seed(seed)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=n_positions,
            n_embd=n_embd,
            n_layer=2,
            n_head=2,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            **config,
        )
    )


def tiny_llama_config(hidden_size: int = 32, vocab_size: int = VOCAB) -> LlamaConfig:
    """A one-layer Llama, MLP twice as wide, one head per 32 features; widths multiples of 16 (FP8
    converts every projection) or, at 128, of the published FP8 format's 128×128 blocks."""
    heads = hidden_size // 32 if hidden_size >= 64 else 2
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=64,
    )


def batches(n: int, batch: int = 4, seq: int = 32, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def rank_rows(ids: torch.Tensor, per_rank: int) -> torch.Tensor:
    """This rank's `per_rank` rows of a global batch (rank r takes rows r·per_rank onwards)."""
    rank = dist.get_rank()
    return ids[rank * per_rank : (rank + 1) * per_rank]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a launch's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nbytes(tensors) -> int:
    """The bytes the elements of `tensors` take."""
    return sum(t.numel() * t.element_size() for t in tensors)


def snapshot(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `params`, then of every tensor state the optimizer holds for each of them."""
    tensors = [p.detach().clone() for p in params]
    for p in params:
        tensors += [v.clone() for v in optimizer.state[p].values() if torch.is_tensor(v)]
    return tensors


def train_steps(strategy, model, optimizer, data: list[torch.Tensor], scheduler=None) -> list[float]:
    """The plain strategy loop (forward context, scaled backward, step, `scheduler` step if
    given) over `data`; the losses."""
    losses = []
    for ids in data:
        losses.append(strategy.train_step(model, ids, optimizer).item())
        if scheduler is not None:
            scheduler.step()
    return losses


def split_like_before(self, param_groups, **hyper):
    """FP8-LM O2's optimizer as it was built before `unscaled_format` (to 2026-12-06): each group
    split in two. Bound to a strategy as its `build_optimizer`, it writes that layout's checkpoints."""
    from hf_lowprec.fp8.scaled import get_master_scale
    from hf_lowprec.optim import FP8AdamW

    groups = []
    for group in param_groups:
        fp8 = [p for p in group["params"] if get_master_scale(p) is not None]
        other = [p for p in group["params"] if get_master_scale(p) is None]
        groups += [{**group, "params": fp8}] if fp8 else []
        groups += [{**group, "params": other, "exp_avg_format": "fp32", "exp_avg_sq_format": "fp32"}] if other else []
    optimizer = FP8AdamW(groups, **hyper, exp_avg_sq_format="fp16", margin=0, fused=self.options.fused)
    self.backward_grads.owner = optimizer
    return optimizer


def planned_and_measured(name: str) -> tuple[dict[str, float], dict[str, float]]:
    """Strategy `name`'s model state on `tiny_gpt2`: planned before the first step
    (`plan_model_state`), and counted from the live storage after one step (`model_state_bytes`)."""
    import hf_lowprec
    from hf_lowprec.memory import model_state_bytes, plan_model_state

    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    planned = plan_model_state(model, optimizer)
    train_steps(strategy, model, optimizer, batches(1))
    return planned, model_state_bytes(model, optimizer)


def trainer_arguments(output_dir, **overrides) -> dict:
    """`TrainingArguments` keywords of the Trainer tests: a few CPU steps, every step logged, no
    reporting integration, no progress bar; `overrides` win."""
    return {
        "output_dir": str(output_dir),
        "max_steps": 6,
        "per_device_train_batch_size": 4,
        "learning_rate": 3e-3,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        **overrides,
    }


def logged_losses(trainer) -> list[tuple[int, float]]:
    """(step, loss) of every log entry of `trainer` that has a loss."""
    return [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]


class ParameterSnapshots(TrainerCallback):
    """Copies of the model's parameters at the end of every optimizer step, in `taken`."""

    def __init__(self) -> None:
        self.taken: list[list[torch.Tensor]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.taken.append([p.detach().clone() for p in model.parameters()])


def make_args(output_dir, strategy: str | None, **overrides):
    """`hf_lowprec.TrainingArguments` of `trainer_arguments` under `strategy`; test modules fix
    their own overrides with `functools.partial`."""
    from hf_lowprec import TrainingArguments

    return TrainingArguments(**trainer_arguments(output_dir, precision_strategy=strategy, **overrides))


# `make_args` of the Trainer tests that save and resume: a checkpoint every 3 steps, a cosine
# schedule after one warm-up step and weight decay, all of which a resume has to restore.
checkpointed_args = functools.partial(
    make_args,
    save_steps=3,
    save_strategy="steps",
    lr_scheduler_type="cosine",
    warmup_steps=1,
    weight_decay=0.01,
)


class TokenBlocks(torch.utils.data.Dataset):
    """`n` random token blocks as causal-LM examples (labels = input_ids) for Trainer tests."""

    def __init__(self, n: int = 48, seq: int = 32, seed: int = 1):
        self.ids = torch.cat(batches(n // 4, batch=4, seq=seq, seed=seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of `t` as integers of its width (so NaN == NaN and −0 ≠ +0 in comparisons)."""
    return t.contiguous().view(_BITS[t.element_size()])


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern: what "bit-identical" means (−0 ≠ +0; a NaN equals
    only a NaN with the same payload), unlike `torch.equal`."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        a, b = a.view(_BITS[a.element_size()]), b.view(_BITS[b.element_size()])
    return torch.equal(a, b)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """`bits_equal`, or an AssertionError naming the first element whose bits differ."""
    if bits_equal(a, b):
        return
    where = f"{what}: " if what else ""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{where}{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    first = (a.view(_BITS[a.element_size()]) != b.view(_BITS[b.element_size()])).flatten().nonzero()[0].item()
    raise AssertionError(
        f"{where}bits differ first at flat index {first}: {a.flatten()[first]} vs {b.flatten()[first]}"
    )


def assert_same_state(a, b, where: str) -> None:
    """Equal structure (nested dicts, lists, tuples, values), and tensors equal bit for bit
    (compared as bytes: FP8 has no ==); `where` names the state in the message."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def finite(values: list[float]) -> list[float]:
    """`values` after asserting every one is finite: a NaN or inf loss fails here, before any
    comparison (JSON decodes every NaN as one object, so `[nan] == [nan]` would pass)."""
    values = [float(v) for v in values]
    assert all(math.isfinite(v) for v in values), values
    return values


def assert_same_losses(got: list[float], expected: list[float], context: object = "") -> None:
    """Equal FP32 losses, every one finite (a NaN on both sides fails)."""
    assert finite(got) == finite(expected), (context, got, expected)


def fp32_gradient_norms(strategy, model, optimizer, ids: torch.Tensor) -> dict[str, float]:
    """‖∇L‖₁ and Σ|∂L/∂wᵢ·wᵢ| at the weights the optimizer holds, on an FP32 copy of the model
    (the first-order terms of `first_order_bound`)."""
    plain = tiny_gpt2()
    plain.load_state_dict(strategy.full_precision_state_dict(model, optimizer))
    plain(input_ids=ids, labels=ids).loss.backward()
    grads = [(p.grad.double(), p.detach().double()) for p in plain.parameters()]
    return {
        "grad_l1": sum(float(g.abs().sum()) for g, _ in grads),
        "grad_w_l1": sum(float((g * w).abs().sum()) for g, w in grads),
    }


def accumulated_halves(strategy, model, optimizer, data: list[torch.Tensor]) -> list[float]:
    """One process, each batch as two halves (one per rank of a 2-rank run) whose gradients are
    accumulated and then halved: fl(g₀ + g₁)/2 = fl(g₀/2 + g₁/2), the gradient a 2-rank
    all-reduce (DDP) or reduce-scatter (ZeRO) forms. Halving is exact in FP32 and BF16; halving
    each loss instead would round differently where a loss-scaled FP16 gradient is subnormal. A
    strategy that averages micro-batches itself (fp16-als' running mean, M₂ = fl(g₀/2 + g₁/2)
    as the 2-rank reduction forms it) is left to do so. Returns the losses of the whole batches
    (FP32 sum of the halves' means, halved, as the ranks' losses are combined)."""
    averages_itself = getattr(strategy.options, "running_mean", False)
    losses = []
    for ids in data:
        total = torch.zeros((), dtype=torch.float32)
        for half in ids.chunk(2):
            with strategy.forward_context():
                loss = model(input_ids=half, labels=half).loss
            strategy.scale_loss(loss).backward()
            total += loss.detach().float()
        for p in model.parameters():
            if p.grad is not None and not averages_itself:
                p.grad.mul_(0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total / 2))
    return losses


def adam_update_ratio(step: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """max |m̂ₜ|/√v̂ₜ of Adam over every gradient sequence (Cauchy–Schwarz): √(Σ aⱼ²/bⱼ), with aⱼ
    and bⱼ the bias-corrected weights of gⱼ in m̂ₜ and of gⱼ² in v̂ₜ."""
    a = [(1 - beta1) * beta1 ** (step - j) / (1 - beta1**step) for j in range(1, step + 1)]
    b = [(1 - beta2) * beta2 ** (step - j) / (1 - beta2**step) for j in range(1, step + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b)))


def first_order_bound(norms: list[dict], step: int, lr: float = 1e-3, weight_decay: float = 0.01) -> float:
    """|L(w') − L(w)| at `step` (0-based) of two AdamW runs from the same weights.

    Each step moves a weight by at most lr·(U·q + wd·|w|), U = `adam_update_ratio`, q = 2 for
    moments stored in 8 bits (relative rounding at most 2⁻³ on m and on v), so after k steps the
    runs' weights differ by δᵢ ≤ 2k·lr·(U·q + wd·|wᵢ|), plus the rounding of the weights the
    forward sees, at most 2⁻³·|wᵢ| per step (E4M3, the coarsest weight format of any strategy).
    To first order |ΔL| ≤ Σᵢ |∂L/∂wᵢ|·δᵢ (`norms[step]`, from `fp32_gradient_norms` on the
    reference run); the factor 2 covers the curvature term and the strategy's own gradient
    rounding. Loose by design (≈ 1 on these models' loss of 5.5): it catches NaN and divergence;
    the exact and per-element checks carry the rest.
    """
    if step == 0:
        return 0.0
    ratio = sum(2 * adam_update_ratio(k) for k in range(1, step + 1))
    g1, gw1 = norms[step]["grad_l1"], norms[step]["grad_w_l1"]
    return 2 * (g1 * 2 * lr * ratio + gw1 * step * (2 * lr * weight_decay + 2.0**-3))


def load_as_on_a_gpu(path):
    """`from_pretrained` where transformers keeps its FP8 inference layers (CUDA ≥ 8.9 faked for the load)."""
    from unittest import mock

    from transformers import AutoModelForCausalLM

    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)),
    ):
        return AutoModelForCausalLM.from_pretrained(path)


# --- TRL (imported inside the helpers: TRL is an extra) -------------------------------------------


def left_padded_tokenizer():
    """The tests' tokenizer, padding on the left (generation) and without token type ids."""
    from hf_lowprec.data import build_tokenizer

    tok = build_tokenizer()
    tok.model_input_names = ["input_ids", "attention_mask"]
    tok.padding_side = "left"
    return tok


def tiny_lm(tokenizer, seed=0, **config):
    """A tiny GPT-2 language model (`hf_lowprec.data.tiny_gpt2_config`) for the tokenizer."""
    from hf_lowprec.data import tiny_gpt2_config

    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer), n_positions=64, **config))


def tiny_scorer(tokenizer, seed=1):
    """A tiny GPT-2 with one output (a reward or value model)."""
    from transformers import GPT2ForSequenceClassification

    from hf_lowprec.data import tiny_gpt2_config

    torch.manual_seed(seed)
    return GPT2ForSequenceClassification(tiny_gpt2_config(vocab_size=len(tokenizer), n_positions=64, num_labels=1))


# A preference pair per prompt (DPO).
PAIRS = {
    "prompt": ["Return the", "Open a"],
    "chosen": [" value of x", " file for reading"],
    "rejected": [" x of value", " reading for file"],
}


def no_activation_checkpointing() -> dict[str, bool]:
    """TRL configs' activation checkpointing off, under the field name the installed transformers
    has (recipes/common.py's rule: `activation_checkpointing` from 5.23, `gradient_checkpointing` before)."""
    from tests.launching import import_recipe

    return import_recipe("common").no_activation_checkpointing()


def trl_args(config, tmp_path, strategy, **overrides):
    """`hl_trl.<config>` for a CPU run of one step of two examples, no saving, no reporting."""
    import hf_lowprec.trl as hl_trl

    kwargs = dict(
        output_dir=str(tmp_path),
        precision_strategy=strategy,
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=1,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return getattr(hl_trl, config)(**kwargs)


def ppo_trainer(tmp_path, tokenizer, strategy=None, precision_strategy="fp32", ref_model=None):
    """TRL 1.12's PPOTrainer on the tiny policy (`tiny_lm`, seed 0), reward (seed 1) and value
    (seed 2) models, four prompts, one PPO update; `strategy` replaces the one built from the name."""
    import datasets
    from transformers import set_seed

    import hf_lowprec.trl as hl_trl

    set_seed(0)
    args = hl_trl.PPOConfig(
        output_dir=str(tmp_path),
        precision_strategy=precision_strategy,
        use_cpu=True,
        per_device_train_batch_size=4,
        num_mini_batches=1,
        num_ppo_epochs=1,
        total_episodes=4,
        response_length=4,
        num_sample_generations=0,
        learning_rate=1e-3,
        **no_activation_checkpointing(),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    if strategy is not None:
        args.build_precision_strategy = lambda: strategy
    prompts = [tokenizer(t)["input_ids"] for t in ("Return the", "Open a file", "Split the", "Join the")]
    train = datasets.Dataset.from_dict({"input_ids": prompts})
    return hl_trl.PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=tiny_lm(tokenizer),
        ref_model=ref_model,
        reward_model=tiny_scorer(tokenizer, seed=1),
        value_model=tiny_scorer(tokenizer, seed=2),
        train_dataset=train,
        eval_dataset=train,
    )


# A tiny Llama's config.json (4 layers, hidden 64): the planner's tests count its steps.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


# A GPU's optimizer step is one compiled call per chunk of at most eight rows of a group
# (`optim.dispatch.chunks_of`); a count made at two depths and scaled is linear in the layers,
# the chunks are not: the last chunks of a group (4, 2, 1) differ by at most three calls per group,
# and a model's rows fall in at most three groups (matrices, vectors, staged rows). The graphs
# over every gradient (FP8-LM's gradient casts, O2's clipping) are chunked the same way.
CHUNK_ROUNDING = 3 * 3
CHUNKED_PHASES = ("optimizer", "gradients", "clip")


def assert_counted_alike(scaled: dict, whole: dict) -> None:
    """Two counts' phases {phase: (kernels, graphs, eager, bytes, ...)} agree: exactly, but for the
    kernels and graphs of the phases with chunked calls (CHUNKED_PHASES), within the chunks'
    rounding (CHUNK_ROUNDING), and their bytes."""
    assert scaled.keys() == whole.keys()
    for phase, figures in scaled.items():
        if phase not in CHUNKED_PHASES:
            assert figures == whole[phase], phase
            continue
        (kernels, graphs, eager, moved, *rest), (kernels_whole, graphs_whole, eager_whole, moved_whole, *rest_whole) = (
            figures,
            whole[phase],
        )
        assert (eager, rest) == (eager_whole, rest_whole), phase
        # Each kernel reads the step's scalars and flag once: a few bytes more or less per chunk.
        assert abs(moved - moved_whole) <= 1e-4 * moved_whole, (moved, moved_whole)
        assert abs(kernels - kernels_whole) <= CHUNK_ROUNDING and abs(graphs - graphs_whole) <= CHUNK_ROUNDING, (
            figures[:2],
            whole[phase][:2],
        )
