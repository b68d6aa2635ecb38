"""Small shared builders for tests: a tiny GPT-2, fixed random batches, bit-pattern equality."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 256


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    # Dims are multiples of 16 so FP8 strategies can convert every block layer.
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def batches(n: int, batch: int = 4, seq: int = 32, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def train_steps(strategy, model, optimizer, data: list[torch.Tensor], scheduler=None) -> list[float]:
    """The plain strategy loop (forward context, scaled backward, step, `scheduler` step if
    given) over `data`; the losses."""
    losses = []
    for ids in data:
        losses.append(strategy.train_step(model, ids, optimizer).item())
        if scheduler is not None:
            scheduler.step()
    return losses


class TokenBlocks(torch.utils.data.Dataset):
    """`n` random token blocks as causal-LM examples (labels = input_ids) for Trainer tests."""

    def __init__(self, n: int = 48, seq: int = 32, seed: int = 1):
        self.ids = torch.cat(batches(n // 4, batch=4, seq=seq, seed=seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
