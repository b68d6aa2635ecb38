"""Write tests/data/optimizer_states_6be633d.pt with the optimizers of commit 6be633d.

    python scripts/optimizer_states_6be633d.py OUT.pt    (from a git checkout holding 6be633d)

The file holds, per optimizer family, what a checkpoint of the layout before the AdamW-core
restructuring looks like (tests/optim/test_old_checkpoints.py loads it into today's optimizers):
the parameters and a deep copy of `state_dict()` after two steps, the third step's gradients,
and the parameters after that third step. Parameters: `torch.randn(shape) * 0.1` from a generator
seeded 3, for shapes (24, 16), (130,), (7,), cast to the family's dtype; gradients: three sets of
`torch.randn(shape)` from a generator seeded 4. The old package is taken from git (`git archive`)
into a temporary directory and run in a subprocess with only it on PYTHONPATH; the output equals
the committed file bit for bit. A maintainer tool of the repository, not part of the package.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "6be633d"

# Run against the old package: `optim` is that commit's hf_lowprec.optim.
GENERATE = r"""
import copy, sys
import torch
from hf_lowprec import optim

SHAPES = [(24, 16), (130,), (7,)]
FAMILIES = {
    "collage_plus_bf16": (torch.bfloat16, lambda ps: optim.CollageAdamW(ps, lr=1e-3, weight_decay=0.1, variant="plus")),
    "collage_light_fp16": (torch.float16, lambda ps: optim.CollageAdamW(ps, lr=1e-3, weight_decay=0.1, variant="light")),
    "kahan_bf16": (torch.bfloat16, lambda ps: optim.KahanAdamW(ps, lr=1e-3)),
    "sr_bf16": (torch.bfloat16, lambda ps: optim.StochasticRoundingAdamW(ps, lr=1e-3, seed=5)),
    "fp32states_bf16": (torch.bfloat16, lambda ps: optim.FP32StatesAdamW(ps, lr=1e-3)),
    "plain_fp32": (torch.float32, lambda ps: optim.PlainAdamW(ps, lr=1e-3, weight_decay=0.1)),
    "coat_fp32": (torch.float32, lambda ps: optim.COATAdamW(ps, lr=1e-3)),
    "coat_bf16": (torch.bfloat16, lambda ps: optim.COATAdamW(ps, lr=1e-3)),
    "fp8adamw_fp32": (torch.float32, lambda ps: optim.FP8AdamW(ps, lr=1e-3, weight_decay=0.1)),
}


def draw(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * 0.1).to(dtype) for shape in SHAPES]


out = {}
for name, (dtype, make) in FAMILIES.items():
    params = [torch.nn.Parameter(p) for p in draw(3, dtype)]
    g = torch.Generator().manual_seed(4)
    grads = [[torch.randn(shape, generator=g).to(dtype) for shape in SHAPES] for _ in range(3)]
    optimizer = make(params)
    for step in range(2):
        for p, grad in zip(params, grads[step]):
            p.grad = grad.clone()
        optimizer.step()
    case = {"params": [p.detach().clone() for p in params], "state": copy.deepcopy(optimizer.state_dict())}
    case["grads"] = [grad.clone() for grad in grads[2]]
    for p, grad in zip(params, grads[2]):
        p.grad = grad.clone()
    optimizer.step()
    case["after"] = [p.detach().clone() for p in params]
    out[name] = case
torch.save(out, sys.argv[1])
"""


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0]).resolve()
    with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(["git", "archive", COMMIT, "hf_lowprec"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", old], input=archive.stdout, check=True)
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": old, "OMP_NUM_THREADS": "1", "HOME": old}
        subprocess.run([sys.executable, "-c", GENERATE, str(out)], cwd=old, env=env, check=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
