"""The FP8 scaling recipes live in one table: code elsewhere reads a recipe's fields, never its name.

A comparison with a recipe's name (`recipe == "tensorwise"`, `name in ("tensorwise", "rowwise")`)
or a lookup of one by name (`SCALING_RECIPES["rowwise"]`) outside `fp8/scaling_recipes.py` is a
branch a new recipe would have to find; the table's fields (`whole_tensor`, `native_scales`,
`raise_to`, `native_grouped`, …) say the same things.
"""

from __future__ import annotations

import ast
import pathlib
import typing

import pytest
import torch

from hf_lowprec.fp8 import FP8Linear, convert_to_fp8
from hf_lowprec.fp8.scaling_recipes import SCALING_RECIPES, ScalingRecipe, fp8_config, scaling_recipe
from hf_lowprec.strategies.fp8_lm import FP8LMOptions

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "hf_lowprec"
TABLE = PACKAGE / "fp8" / "scaling_recipes.py"


def _named(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in SCALING_RECIPES


def _uses_a_name(node: ast.AST) -> bool:
    return _named(node) or (isinstance(node, ast.Tuple | ast.List | ast.Set) and any(map(_named, node.elts)))


def recipe_names_in_code(source: str) -> list[int]:
    """Lines that compare with, or look up, a recipe by its name."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        compared = isinstance(node, ast.Compare) and any(map(_uses_a_name, [node.left, *node.comparators]))
        looked_up = isinstance(node, ast.Subscript) and _named(node.slice)
        if compared or looked_up:
            lines.append(node.lineno)
    return lines


def test_the_scan_finds_a_comparison_and_a_lookup_by_name():
    probe = (
        'def f(recipe, name):\n    if recipe.name == "blockwise":\n        return 1\n'
        '    if name in ("tensorwise", "rowwise"):\n        return SCALING_RECIPES["mxfp8"]\n'
        '    return g(recipe="tensorwise")\n'
    )
    assert recipe_names_in_code(probe) == [2, 4, 5]


def test_no_recipe_name_is_compared_outside_the_table():
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != TABLE and (lines := recipe_names_in_code(path.read_text()))
    }
    assert found == {}, f"recipe names compared outside fp8/scaling_recipes.py (file: lines): {found}"


def test_the_recipe_option_takes_its_names_from_the_table():
    hint = typing.get_type_hints(FP8LMOptions)["recipe"]
    assert typing.get_args(hint) == tuple(SCALING_RECIPES)
    with pytest.raises(ValueError, match="must be one of"):
        FP8LMOptions(recipe="colwise")


def test_a_new_row_runs_an_fp8_layer_with_no_other_change(monkeypatch):
    # A recipe the package has never seen: rowwise's blocks with E5M2 gradients.
    row = ScalingRecipe(
        "rowwise-e5m2", (1, None), (1, None), torch.float8_e5m2, SCALING_RECIPES["rowwise"].native_scales
    )
    monkeypatch.setitem(SCALING_RECIPES, row.name, row)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    convert_to_fp8(model, recipe="rowwise-e5m2")
    assert all(m.config.recipe is row for m in model.modules() if isinstance(m, FP8Linear))
    x = torch.randn(8, 32, requires_grad=True)
    model(x).square().sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in model.parameters())
    # Its gradients are E5M2: the layer's dx differs from rowwise's E4M3 run on the same values.
    reference = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    reference.load_state_dict(model.state_dict())
    convert_to_fp8(reference, recipe="rowwise")
    x2 = x.detach().clone().requires_grad_()
    reference(x2).square().sum().backward()
    assert not torch.equal(x.grad, x2.grad)


def test_a_configuration_is_one_object_per_value():
    assert fp8_config("rowwise", 1) is fp8_config(scaling_recipe("rowwise"), 1)
    assert fp8_config("rowwise", 1) is not fp8_config("rowwise", 0)
    layers = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    convert_to_fp8(layers, recipe="mxfp8", margin=1)
    assert layers[0].config is layers[1].config is fp8_config("mxfp8", 1)
    with pytest.raises(ValueError, match="margin must be an integer >= 0"):
        fp8_config("tensorwise", -1)
    with pytest.raises(ValueError, match="unknown FP8 recipe 'colwise'; valid recipes"):
        fp8_config("colwise")
    with pytest.raises(ValueError, match="FP8 GEMM path must be"):
        fp8_config("tensorwise", 0, "cublas")
