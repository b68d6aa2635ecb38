"""What a 16-bit-weight strategy's loss takes keeps its dtype: the Trainer's `num_items_in_batch` divides the summed loss."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_lowprec import Trainer, get_strategy
from tests.helpers import VOCAB, make_args, rounding_bound, tiny_gpt2, unit_roundoff

# Two micro-batches of 8 causal-LM rows (the first 8 lengths, the last 8), each padded to its longest.
# The Trainer counts a step's label tokens past each row's first where it knows the loss shifts them
# (a model's `loss_type`), else all: 257 or 273, which BF16 rounds to 256 and 272 (ties, to even), a
# loss divided by either 0.4% too large.
PADDED_LENGTHS = [32, 20, 9, 17, 25, 12, 30, 5, 31, 7, 18, 11, 24, 6, 16, 10]
# 2 × 129 rows of 256 tokens: 65,790 (or 66,048) label tokens a step, above FP16's largest, 65,504.
FP16_ROWS, FP16_LENGTH = 258, 256


def label_counts(lengths: list[int]) -> set[int]:
    """The step's label count, either way the Trainer counts it (`PADDED_LENGTHS`)."""
    return {sum(n - 1 for n in lengths), sum(lengths)}


def rows(lengths: list[int], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def pad(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-padded rows: padding is masked out of attention and is no label (-100)."""
    longest = max(len(r["input_ids"]) for r in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(batch):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = r["input_ids"], r["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class StepLoss:
    """A forward hook on the Trainer's model: the FP64 sum of the causal-LM cross-entropy of the
    logits each training forward computed, and the `num_items_in_batch` each forward got."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.summed, self.divisors = 0.0, []
        model.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, output) -> None:
        with torch.no_grad():
            logits = output.logits[:, :-1].double().reshape(-1, VOCAB)
            labels = kwargs["labels"][:, 1:].reshape(-1)
            self.summed += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
        self.divisors.append(kwargs["num_items_in_batch"])

    def assert_logged(self, logged: float, counts: set[int]) -> None:
        """`logged` is the step's loss as the stock Trainer defines it: the label tokens' summed
        cross-entropy over their count (either way it counts them), within `logged_tolerance`; each
        forward got that count exactly, in FP32."""
        losses = {n: self.summed / n for n in counts}
        n = min(counts, key=lambda n: abs(logged - losses[n]))
        assert abs(logged - losses[n]) <= logged_tolerance(n, losses[n]), (logged, losses)
        assert [(d.dtype, d.item()) for d in self.divisors] == [(torch.float32, n)] * 2, self.divisors


def first_step(tmp_path, strategy: str | None, data, model, batch: int) -> tuple[dict, StepLoss]:
    args = make_args(
        tmp_path / str(strategy),
        strategy,
        max_steps=1,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=2,
        save_strategy="no",
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=pad)
    seen = StepLoss(trainer.model)
    trainer.train()
    return next(h for h in trainer.state.log_history if "loss" in h), seen


# The logged loss against the FP64 loss of the same logits: FP32 roundings only, none cancelling (each
# token's cross-entropy is a log-sum-exp of VOCAB terms ≈ 5.5 less one logit below 1). Per token VOCAB
# + 4 roundings, the sum of n of them n, the division and the two micro-batches' sum 2: γ of n + 262 in
# FP32, 1.7e-4 on the loss at n = 273, a hundredth of what a divisor rounded to BF16 moves it by.
def logged_tolerance(n: int, loss: float) -> float:
    return rounding_bound(torch.float32, n + VOCAB + 6, loss)


@pytest.mark.parametrize("strategy", ["bf16-pure", "collage-plus"])
def test_a_bf16_strategys_first_loss_over_padded_accumulated_batches_is_stocks(tmp_path, strategy):
    """Padded batches accumulated over two micro-batches count 273 label tokens (GPT-2 names no
    `loss_type`): the divisor, cast to BF16 with the model's float inputs, was 272, and the first
    logged loss (before any update) was 0.37% above the loss of the very logits it came from."""
    counts = label_counts(PADDED_LENGTHS)
    assert counts == {257, 273}
    assert all(torch.tensor(float(n)).to(torch.bfloat16).item() != n for n in counts)  # the test's premise
    logged, seen = first_step(tmp_path, strategy, rows(PADDED_LENGTHS), tiny_gpt2(), batch=8)
    seen.assert_logged(logged["loss"], counts)


@pytest.mark.slow
def test_fp16_als_trains_a_step_of_more_label_tokens_than_fp16_holds(tmp_path):
    """66,048 label tokens in one optimizer step: the divisor, cast to FP16, was inf, and the step
    logged loss 0 and gradient norm 0 (every gradient zero, the step counted as taken, none skipped).
    Its loss is now the FP64 loss of its own logits, and stock FP32's within FP16's rounding."""
    lengths = [FP16_LENGTH] * FP16_ROWS
    counts = label_counts(lengths)
    assert min(counts) > torch.finfo(torch.float16).max  # the test's premise
    model = dict(n_embd=16, n_positions=FP16_LENGTH)  # 2 layers 16 wide: 66,048 tokens in ~20 s
    stock, _ = first_step(tmp_path, None, rows(lengths), tiny_gpt2(**model), batch=FP16_ROWS // 2)
    logged, seen = first_step(tmp_path, "fp16-als", rows(lengths), tiny_gpt2(**model), batch=FP16_ROWS // 2)
    assert math.isfinite(logged["grad_norm"]) and logged["grad_norm"] > 0, logged
    assert logged.get("precision/skipped_steps", 0) == 0, logged
    seen.assert_logged(logged["loss"], counts)
    # Stock's loss differs by the FP16 forward alone. A token's cross-entropy moves by at most twice
    # its largest logit error; a logit here is below 1 (weights of std 0.02), and k roundings of FP16's
    # u on it move it by k·u. 8·u·loss (loss ≈ 5.5: 2.1e-2, where the lost step logged 0) allows
    # k = 22, more than the two 16-wide layers put on one logit's path.
    bound = 8 * unit_roundoff(torch.float16) * stock["loss"]
    assert abs(logged["loss"] - stock["loss"]) <= bound, (logged["loss"], stock["loss"])


def test_cast_float_inputs_keeps_what_the_loss_takes():
    """The loss's keyword inputs keep their dtype; features are cast, a 0-d one (a timestep) too."""
    from hf_lowprec.strategies.inputs import cast_float_inputs

    s = get_strategy("fp16-als")
    loss_inputs = ["labels", "shift_labels", "num_items_in_batch"]  # transformers' `loss_utils` takes them
    kept = {name: torch.tensor([0.3, 100001.0]) for name in loss_inputs}
    batch = {"inputs_embeds": torch.randn(2, 3), "timestep": torch.tensor(0.5), **kept}
    args, kwargs = cast_float_inputs(s, ((torch.tensor(0.25),), batch))
    assert kwargs["inputs_embeds"].dtype == torch.float16 and kwargs["timestep"].dtype == torch.float16
    for name in loss_inputs:
        assert kwargs[name] is batch[name], name
    assert args[0].dtype == torch.float16 and args[0].item() == 0.25


class _TimestepModel(torch.nn.Module):
    """A denoiser's shape: a 0-d timestep expanded into a feature that meets a Linear's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.temb = torch.nn.Linear(16, 16), torch.nn.Linear(1, 16)

    def forward(self, x, timestep, labels):
        h = self.lin(x) + self.temb(timestep.reshape(1, 1).expand(x.shape[0], 1))
        return SimpleNamespace(loss=F.mse_loss(h.float(), labels))


@pytest.mark.parametrize("name", ["bf16-pure", "fp16-als"])
def test_a_0d_float_feature_meets_the_16_bit_weights_in_their_dtype(name):
    """A 0-d timestep is a layer's input once expanded: cast like the others, the step runs; the
    loss is the FP64 loss of the same 16-bit weights and inputs within the 16-bit forward's rounding."""
    s = get_strategy(name)
    torch.manual_seed(0)
    model = s.prepare_model(_TimestepModel())
    optimizer = s.create_optimizer(model.parameters(), lr=1e-3)
    batch = {"x": torch.randn(4, 16), "timestep": torch.tensor(0.5), "labels": torch.randn(4, 16)}
    with torch.no_grad():
        w = {k: v.double() for k, v in model.state_dict().items()}
        x, t = batch["x"].to(s.param_dtype).double(), batch["timestep"].to(s.param_dtype).double()
        h = x @ w["lin.weight"].T + w["lin.bias"] + t * w["temb.weight"].T + w["temb.bias"]
        size = x.abs() @ w["lin.weight"].abs().T + w["lin.bias"].abs() + (t * w["temb.weight"].T).abs()
        size = size + w["temb.bias"].abs()
        error = h - batch["labels"].double()
        reference = error.square().mean().item()
        # Each entry of h: 16 products summed, 3 more terms added, each rounding at most once in the
        # 16-bit dtype (20 roundings of quantities within `size`); (e + δ)² - e² ≤ 2|e|δ + δ².
        delta = rounding_bound(s.param_dtype, 20, 1.0) * size
        bound = (2 * error.abs() * delta + delta.square()).mean().item()
    loss = s.train_step(model, batch, optimizer).item()
    assert math.isfinite(loss)
    assert abs(loss - reference) <= bound, (loss, reference, bound)
