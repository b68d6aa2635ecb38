"""Mixed precision reaches the experts (issue #67): under a 16-bit autocast, transformers' fused
experts modules run their grouped GEMMs on BF16 weights and tokens (`hf_lowprec.grouped_experts`), in the
forward and both backward GEMMs, with FP32 gradients for the FP32 masters; outside one, or under
an implementation autocast already casts (`eager`), the module's own forward runs unchanged.
Numerics against FP64 with BF16-rounded operands; the model-level output against the module's own
implementation on BF16 copies of the weights, bit for bit.
"""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_lowprec import get_strategy
from hf_lowprec.grouped_experts import GroupedExperts, install_grouped_experts, is_experts_module
from hf_lowprec.testing.moe import MOE_ARCHITECTURES, tiny_moe
from tests.helpers import assert_bits_equal, rounding_bound

# gpt-oss adds a bias per expert: here the FP32 bias joins the BF16 GEMM result in FP32 (rounded
# again), where the module's own forward on a BF16 copy adds the BF16 bias in place, so its output
# is not compared bit for bit (it trains under every strategy: tests/strategies/test_moe.py).
NO_BIAS = [a for a in MOE_ARCHITECTURES if a != "gpt_oss"]


class GroupedCalls(TorchDispatchMode):
    """The operand dtypes of every `aten._grouped_mm` run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default:
            self.dtypes.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def experts_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if is_experts_module(m)]


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
@pytest.mark.parametrize("name", ["bf16-mixed", "fp16-mixed", "coat", "fp16-als"])
def test_every_grouped_gemm_of_a_16_bit_step_takes_bf16_operands(name, arch):
    """Forward and backward of a whole step: the two grouped GEMMs per MoE layer and their four
    backward GEMMs, all BF16 (FP32 before #67 under bf16-mixed and fp16-mixed, FP16 under fp16-als:
    on a GPU, torch's per-group fallback, which reads the offsets on the host); every gradient in
    its weight's dtype."""
    strategy = get_strategy(name)
    model = strategy.prepare_model(tiny_moe(arch))
    assert all(isinstance(m, GroupedExperts) for m in experts_of(model))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with GroupedCalls() as calls:
        with strategy.forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        strategy.scale_loss(loss).backward()
    layers = sum(1 for _ in experts_of(model))
    assert len(calls.dtypes) == 6 * layers, calls.dtypes
    assert set(calls.dtypes) == {(torch.bfloat16, torch.bfloat16)}, calls.dtypes
    for p in model.parameters():
        if p.requires_grad and p.grad is not None:
            assert p.grad.dtype == p.dtype


def test_a_grouped_projection_and_its_weight_gradient_against_fp64():
    """One projection of 8 experts over 256 routed rows under BF16 autocast: the output is the
    FP64 product of the BF16-rounded operands, rounded once to BF16, up to K = 64 FP32 additions
    (bound: u_bf16·|y| + γ_64(FP32)·Σ|x||w|); the FP32 master's gradient is the FP64 Σ gᵀx of
    the BF16 operands over each expert's rows, rounded once to BF16 (the grouped GEMM's output)
    and exactly widened, up to that expert's FP32 additions."""
    torch.manual_seed(0)
    (module,) = experts_of(tiny_moe("qwen3_moe", layers=1))
    install_grouped_experts(module)
    rows = torch.sort(torch.randint(0, 8, (256,))).values
    counts = torch.bincount(rows, minlength=8)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(256, 64)
    g = torch.randn(256, 64)  # gate_up_proj: 2 × 32 outputs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module._project("gate_up_proj", x.to(torch.bfloat16), offsets, rows)
    y.backward(g.to(torch.bfloat16))
    w = module.gate_up_proj.detach()  # [experts, out, in], FP32
    x16, w16, g16 = (t.to(torch.bfloat16).double() for t in (x, w, g))
    ref = torch.einsum("rk,rnk->rn", x16, w16[rows])
    magnitude = torch.einsum("rk,rnk->rn", x16.abs(), w16[rows].abs())
    u = 2.0**-8
    assert y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs() <= u * ref.abs() + rounding_bound(torch.float32, 64, 1.0) * magnitude).all()
    grad = module.gate_up_proj.grad
    assert grad.dtype == torch.float32
    for e in range(8):
        sel = rows == e
        ref_e = g16[sel].t() @ x16[sel]
        mag_e = g16[sel].abs().t() @ x16[sel].abs()
        bound = u * ref_e.abs() + rounding_bound(torch.float32, max(int(sel.sum()), 1), 1.0) * mag_e
        assert ((grad[e].double() - ref_e).abs() <= bound).all(), e


@pytest.mark.parametrize("arch", NO_BIAS)
def test_under_autocast_the_experts_compute_what_their_own_forward_does_on_bf16_weights(arch):
    """The whole experts module under BF16 autocast over FP32 weights against the module's own
    `grouped_mm` implementation on a BF16 copy of its weights and BF16 tokens (what bf16-pure
    runs), with the same routing: the same bits once rounded to BF16."""
    torch.manual_seed(1)
    (module, *_) = experts_of(tiny_moe(arch))
    reference = copy.deepcopy(module).to(torch.bfloat16)
    install_grouped_experts(module)
    tokens = torch.randn(64, 64)
    top_k_index = torch.randint(0, module.num_experts, (64, 2))
    top_k_weights = torch.softmax(torch.randn(64, 2), dim=-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = module(tokens, top_k_index, top_k_weights)
    want = reference(tokens.detach().to(torch.bfloat16), top_k_index, top_k_weights)
    assert got.dtype == torch.float32
    assert_bits_equal(got.to(torch.bfloat16), want, arch)


@pytest.mark.parametrize("arch", NO_BIAS)
def test_fp16_weights_without_autocast_take_bf16_grouped_gemms(arch):
    """fp16-als's FP16 experts, no autocast: the six grouped GEMMs of forward and backward take
    BF16 operands (torch's only one-kernel grouped GEMM on a GPU), the output and the weights'
    gradients come back in FP16. The output against the module's own implementation on a BF16
    copy (the same FP32 result rounded once to BF16): ours is rounded to FP16 first, and a
    double rounding moves it by at most u_fp16 + u_bf16 relative, with FP16's smallest
    subnormal as the absolute floor."""
    torch.manual_seed(3)
    (module, *_) = experts_of(tiny_moe(arch))
    module.half()
    reference = copy.deepcopy(module).to(torch.bfloat16)
    install_grouped_experts(module)
    tokens = torch.randn(64, 64).half().requires_grad_()  # as between layers: all six GEMMs run
    top_k_index = torch.randint(0, module.num_experts, (64, 2))
    top_k_weights = torch.softmax(torch.randn(64, 2), dim=-1).half()
    with GroupedCalls() as calls:
        got = module(tokens, top_k_index, top_k_weights)
        got.float().pow(2).sum().backward()
    assert set(calls.dtypes) == {(torch.bfloat16, torch.bfloat16)} and len(calls.dtypes) == 6, calls.dtypes
    assert got.dtype == torch.float16
    assert {p.grad.dtype for p in module.parameters() if p.grad is not None} == {torch.float16}
    want = reference(tokens.detach().to(torch.bfloat16), top_k_index, top_k_weights).float()
    bound = (2.0**-11 + 2.0**-8) * want.abs() + 2.0**-24
    assert ((got.float() - want).abs() <= bound).all(), (got.float() - want).abs().max()


def test_outside_autocast_and_under_the_eager_implementation_nothing_changes():
    """No autocast: the installed module runs its own implementation (the same bits as before).
    `eager` (a loop of `F.linear`, which autocast casts itself) is not taken over at all."""
    torch.manual_seed(2)
    model = tiny_moe("mixtral")
    before = copy.deepcopy(model)
    assert install_grouped_experts(model)
    ids = torch.randint(0, 256, (2, 16))
    assert_bits_equal(model(input_ids=ids).logits, before(input_ids=ids).logits, "no autocast")
    eager = tiny_moe("mixtral")
    eager.config._experts_implementation = "eager"
    for m in experts_of(eager):
        m.config._experts_implementation = "eager"
    assert install_grouped_experts(eager) == []
    assert not any(isinstance(m, GroupedExperts) for m in experts_of(eager))
