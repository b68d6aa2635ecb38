"""Every refusal of a resume is raised in one module, `hf_lowprec/checkpoints/resume.py`.

Read from the source: a `raise` whose message (its string constants, f-string parts included)
speaks of resuming ("resume", "resumed", "Resume with ...") or says that nothing was loaded is a
resume refusal, and must sit in that module; the callers elsewhere (the Trainer, the strategy's
optimizer, the ZeRO optimizer, the sharded loader) call its checks. A message built into a
variable before it is raised escapes this reading; the second test catches such a refusal where
a resume runs, by the frame that raised it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import hf_lowprec
from hf_lowprec.checkpoints.sharded import check_saved

PACKAGE = pathlib.Path(hf_lowprec.__file__).resolve().parent
OWNER = PACKAGE / "checkpoints" / "resume.py"
CHECKPOINTS = PACKAGE / "checkpoints"
_WORDS = ("resum", "nothing was loaded")


def resume_refusals(source: str) -> list[int]:
    """The lines of the `raise` statements in `source` whose message speaks of a resume."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            text = " ".join(
                c.value for c in ast.walk(node.exc) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            ).lower()
            if any(word in text for word in _WORDS):
                lines.append(node.lineno)
    return lines


def test_the_reading_finds_a_refusal():
    probe = (
        "def f(saved):\n"
        '    raise ValueError(f"saved by {saved}; resume with --precision_strategy {saved}")\n'
        "def g():\n"
        '    raise ValueError("no such option")\n'
        "def h(path):\n"
        '    raise RuntimeError(f"{path} is damaged. Nothing was loaded")\n'
    )
    assert resume_refusals(probe) == [2, 6]
    assert resume_refusals(OWNER.read_text(encoding="utf-8")), "the owner's own refusals are read"


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py") if p != OWNER), ids=str)
def test_resume_refusals_are_raised_in_checkpoints_resume(path):
    lines = resume_refusals(path.read_text(encoding="utf-8"))
    where = ", ".join(f"{path.relative_to(PACKAGE.parent)}:{n}" for n in lines)
    assert not lines, f"a resume is refused at {where}: move the check into hf_lowprec/checkpoints/resume.py"


def _raised_in(err: BaseException) -> pathlib.Path:
    tb = err.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return pathlib.Path(tb.tb_frame.f_code.co_filename).resolve()


def _optimizer(name: str, **options):
    strategy = hf_lowprec.get_strategy(name, **options)
    model = strategy.prepare_model(torch.nn.Sequential(torch.nn.Linear(16, 16)))
    return strategy.create_optimizer(model.parameters(), lr=1e-3)


def _zero_from_other_owners() -> None:
    optimizer = _optimizer("fp8-lm-o3")
    state = optimizer.state_dict()
    optimizer.load_state_dict(dict(state, fp8_zero=dict(state["fp8_zero"], owners=[7])))


@pytest.mark.parametrize(
    ("load", "message"),
    [
        pytest.param(
            lambda: _optimizer("fp32").load_state_dict(_optimizer("bf16-sr").state_dict()),
            "saved by precision strategy 'bf16-sr'",
            id="strategy",
        ),
        pytest.param(
            lambda: _optimizer("coat", group_size=64).load_state_dict(_optimizer("coat").state_dict()),
            "with other options",
            id="options",
        ),
        pytest.param(
            lambda: hf_lowprec.TrainingArguments(output_dir="out", resume_reset="rng"),
            "resume_reset was given without precision_strategy",
            id="resume_reset",
        ),
        pytest.param(lambda: check_saved("/nonexistent/hf_lowprec/sharded", False), "does not exist", id="sharded"),
        pytest.param(_zero_from_other_owners, "same number of ranks", id="zero-owners"),
    ],
)
def test_a_refusal_where_a_resume_runs_is_raised_in_checkpoints(load, message):
    with pytest.raises(ValueError, match=message) as caught:
        load()
    assert _raised_in(caught.value).is_relative_to(CHECKPOINTS), f"raised in {_raised_in(caught.value)}"
