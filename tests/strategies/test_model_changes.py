"""Changing the model after `prepare_model`: a cast between steps, a layer frozen or left unused
mid-run under fp8-lm-o3, a LoRA adapter or a head added after preparing (the advice, and preparing again)."""

import pytest
import torch
from transformers import GPT2LMHeadModel, TrainerCallback

import hf_lowprec
from hf_lowprec.data import tiny_gpt2_config
from hf_lowprec.fp8.linear import set_grad_sink
from hf_lowprec.report import PrecisionPromiseError
from tests.helpers import TokenBlocks, assert_bits_equal, batches, make_args


def tiny(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(
        tiny_gpt2_config(n_embd=64, n_layer=2, pad_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    )


def started(name: str, steps: int = 2, lr: float = 1e-2, weight_decay: float = 0.0):
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(tiny())
    optimizer = strategy.create_optimizer(model.parameters(), lr=lr, weight_decay=weight_decay)
    for ids in batches(steps):
        strategy.train_step(model, ids, optimizer)
    return strategy, model, optimizer


def copies(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


# --- a cast after the first step --------------------------------------------------------------


@pytest.mark.parametrize(
    "name, cast",
    [("collage-plus", torch.float16), ("collage-plus", torch.float32), ("fp16-als", torch.bfloat16),
     ("fp8-lm-o2", torch.bfloat16)],
)  # fmt: skip
def test_a_cast_after_the_first_step_is_refused_by_the_step(name, cast):
    """`check_promises` runs once, before the first step: a cast after it (collage-plus `.half()`: FP16
    weights stepped with BF16 δθ; fp16-als `.to(bf16)` under FP16 loss scaling; fp8-lm-o2: BF16
    payloads) trained silently. The step now refuses it with the startup check's error, before
    anything is written: every weight keeps its bits."""
    strategy, model, optimizer = started(name)
    model.to(cast)
    before = copies(model)
    with pytest.raises(PrecisionPromiseError, match=f"trainable parameter elements are {str(cast)[6:]}, but"):
        strategy.train_step(model, batches(3)[2], optimizer)
    for key, p in model.named_parameters():
        assert_bits_equal(p.detach(), before[key], key)


def test_a_cast_in_a_trainer_callback_is_refused(tmp_path):
    """The same through `hf_lowprec.Trainer`: `model.half()` in a callback at step 2 trained to the end
    (5 steps) under collage-plus with FP16 weights; the same cast before `train()` is refused at startup."""

    class Cast(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                model.half()

    args = make_args(tmp_path, "collage-plus", max_steps=5, save_strategy="no")
    trainer = hf_lowprec.Trainer(model=tiny(), args=args, train_dataset=TokenBlocks(), callbacks=[Cast()])
    with pytest.raises(PrecisionPromiseError, match="stepped them in bfloat16"):
        trainer.train()
    assert trainer.state.global_step == 2


def test_a_cast_in_an_accelerate_loop_is_refused():
    """The same under the Accelerate plugin, whose startup check runs once, in `prepare`."""
    from accelerate import Accelerator

    from hf_lowprec.integrations.accelerate import PrecisionPlugin

    plugin, accelerator = PrecisionPlugin("fp16-als"), Accelerator(cpu=True)
    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = plugin.prepare(accelerator, model, optimizer)
    for step, ids in enumerate(batches(2)):
        if step == 1:
            model.to(torch.bfloat16)
        plugin.backward(accelerator, model(input_ids=ids, labels=ids).loss)
        if step == 1:
            with pytest.raises(PrecisionPromiseError, match="stepped them in float16"):
                optimizer.step()
        else:
            optimizer.step()
        optimizer.zero_grad()


def test_a_parameter_group_added_later_is_no_cast():
    """A group added after steps (progressive unfreezing) brings parameters the step has not seen: no refusal."""
    strategy = hf_lowprec.get_strategy("collage-plus")
    model = strategy.prepare_model(tiny())
    head = list(model.transformer.h[1].parameters())
    optimizer = strategy.create_optimizer([p for p in model.parameters() if all(p is not q for q in head)], lr=1e-2)
    strategy.train_step(model, batches(1)[0], optimizer)
    optimizer.add_param_group({"params": head})
    before = copies(model.transformer.h[1])
    strategy.train_step(model, batches(2)[1], optimizer)
    assert any(not torch.equal(p, before[k]) for k, p in model.transformer.h[1].named_parameters())


# --- fp8-lm-o3: frozen and unused FP8 weights -------------------------------------------------


def test_o3_leaves_a_block_frozen_mid_run_as_it_is():
    """fp8-lm-o3 keeps its FP8 weights outside the param groups and stepped each one every step, a
    missing gradient as zeros: a block frozen after 2 steps (`requires_grad_(False)`) moved its four FP8
    weights by 0.0149 in 2 more steps (momentum, weight decay). Now they keep their bits, as its
    LayerNorms and every weight under the other strategies do; the other block's FP8 weights still move."""
    strategy, model, optimizer = started("fp8-lm-o3", weight_decay=0.1)
    frozen, trained = model.transformer.h
    frozen.requires_grad_(False)
    before, other = copies(frozen), copies(trained)
    for ids in batches(4)[2:]:
        strategy.train_step(model, ids, optimizer)
    for key, p in frozen.named_parameters():
        assert_bits_equal(p.detach(), before[key], key)
    assert not torch.equal(trained.mlp.c_fc.weight, other["mlp.c_fc.weight"])


def test_o3_does_not_step_an_fp8_weight_without_a_gradient_in_one_process():
    """A block left out of the forward (grad None) moved its FP8 weights by 0.0148 in 2 steps with
    weight_decay 0 (momentum on zero-filled gradients); torch.optim, fp8-lm-o2 and fp32 skip it (0.0)."""
    strategy, model, optimizer = started("fp8-lm-o3")
    unused = model.transformer.h[1]
    before = copies(unused)
    model.transformer.h = torch.nn.ModuleList([model.transformer.h[0]])
    for ids in batches(4)[2:]:
        strategy.train_step(model, ids, optimizer)
    for key, p in unused.named_parameters():
        assert_bits_equal(p.detach(), before[key], key)


def test_a_frozen_fp8_weight_sends_nothing_to_its_gradient_sink():
    """Across ranks, a weight another rank owns takes its gradient through a sink, which the layer
    called whatever `requires_grad` said (dW computed and stepped for a frozen weight); now only a
    trainable weight's sink is called, once per backward."""
    strategy = hf_lowprec.get_strategy("fp8-lm-o2")
    model = strategy.prepare_model(tiny())
    weight = model.transformer.h[0].mlp.c_fc.weight
    sunk = []
    set_grad_sink(weight, sunk.append)
    ids = batches(1)[0]
    for trainable in (False, True):
        weight.requires_grad_(trainable)
        with strategy.forward_context():
            model(input_ids=ids, labels=ids).loss.backward()
        assert len(sunk) == int(trainable) and weight.grad is None


# --- a LoRA adapter or a head added after prepare_model ---------------------------------------


@pytest.mark.parametrize("name, dtype", [("collage-plus", torch.bfloat16), ("fp16-als", torch.float16)])
def test_a_head_added_mid_run_is_refused_with_the_fix_and_prepared_again(name, dtype):
    """A new FP32 head under collage-plus / fp16-als was refused with advice to cast the model to BF16
    (under fp16-als a BF16 head was then taken by `add_param_group` and trained off the promise), and
    `prepare_model` again left the model as it was. Now the refusal names the strategy's dtype and the
    fix, and preparing again casts the head alone: every other weight keeps its bits, the head trains."""
    strategy, model, optimizer = started(name, steps=1)
    for head_dtype in (torch.float32, torch.bfloat16 if dtype == torch.float16 else torch.float16):
        head = torch.nn.Linear(64, 3).to(head_dtype)
        with pytest.raises(PrecisionPromiseError, match=rf"promises {str(dtype)[6:]}: .*prepare_model\(model\) again"):
            optimizer.add_param_group({"params": list(head.parameters())})
    before = copies(model)
    model.extra_head = head
    assert strategy.prepare_model(model) is model
    assert {p.dtype for p in model.parameters()} == {dtype}
    for key, p in before.items():
        assert_bits_equal(model.get_parameter(key).detach(), p, key)
    optimizer.add_param_group({"params": list(head.parameters())})
    start = head.weight.detach().clone()

    def loss_fn(m, ids):
        out = m(input_ids=ids, labels=ids, output_hidden_states=True)
        return out.loss + m.extra_head(out.hidden_states[-1].to(dtype)).float().square().mean()

    for ids in batches(3)[1:]:
        strategy.train_step(model, ids, optimizer, loss_fn=loss_fn)
    assert head.weight.dtype == dtype and not torch.equal(head.weight, start)


@pytest.mark.parametrize("name, dtype", [("collage-plus", torch.bfloat16), ("fp16-als", torch.float16)])
def test_a_lora_adapter_added_after_prepare_model_trains_once_prepared_again(name, dtype):
    """PEFT makes FP32 adapters: `create_optimizer` refuses them with the fix (the old advice, a cast
    to BF16, was refused again by fp16-als); `prepare_model` of the PEFT model casts them and they train,
    fp16-als's loss scaler hooking each layer once."""
    peft = pytest.importorskip("peft")
    strategy = hf_lowprec.get_strategy(name)
    config = peft.LoraConfig(r=4, target_modules=["c_attn", "c_fc"], lora_dropout=0.0, fan_in_fan_out=True)
    model = peft.get_peft_model(strategy.prepare_model(tiny()), config)
    trainable = lambda: [p for p in model.parameters() if p.requires_grad]  # noqa: E731
    with pytest.raises(PrecisionPromiseError, match=r"added after prepare_model \(a LoRA adapter"):
        strategy.create_optimizer(trainable(), lr=1e-2)
    model = strategy.prepare_model(model)
    assert {p.dtype for p in trainable()} == {dtype}
    if name == "fp16-als":  # the scaler hooked the wrapped model's layers again: each output was counted twice
        assert max(len(m._forward_hooks) for m in model.modules()) == 1
    optimizer = strategy.create_optimizer(trainable(), lr=1e-2)
    before = copies(model)
    for ids in batches(2):
        strategy.train_step(model, ids, optimizer)
    moved = [k for k, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[k])]
    assert moved and all("lora_" in k for k in moved)
