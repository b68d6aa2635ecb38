import re

import pytest

import hf_lowprec
from hf_lowprec.strategies.registry import register


def test_available_strategies_lists_names_sorted():
    names = hf_lowprec.available_strategies()
    assert names == sorted(names)
    assert "bf16-pure" in names


def test_unknown_name_names_the_closest():
    with pytest.raises(ValueError, match=r"unknown precision strategy 'bf16-pur'.*'bf16-pure'"):
        hf_lowprec.get_strategy("bf16-pur")


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"Valid names: .*fp32"):
        hf_lowprec.get_strategy("zzzz")


@pytest.mark.parametrize("name", [3, None, ["bf16-pure"]])
def test_a_name_that_is_not_a_string_is_refused_clearly(name, tmp_path):
    match = rf"precision strategy must be a name \(a string\), got {re.escape(repr(name))}.*Valid names: .*fp32"
    with pytest.raises(ValueError, match=match):
        hf_lowprec.get_strategy(name)
    if name is not None:  # None means no strategy in TrainingArguments
        with pytest.raises(ValueError, match=match):
            hf_lowprec.TrainingArguments(output_dir=str(tmp_path), precision_strategy=name, use_cpu=True)


def test_bad_option_name_raises_before_work():
    with pytest.raises(ValueError, match=r"no option\(s\) \['colour'\].*lost_arithmetic_metrics"):
        hf_lowprec.get_strategy("bf16-pure", colour="red")


def test_bad_option_value_raises():
    with pytest.raises(ValueError, match=r"lost_arithmetic_metrics.*true or false"):
        hf_lowprec.get_strategy("fp32", lost_arithmetic_metrics="yes")


def test_duplicate_registration_refused():
    with pytest.raises(ValueError, match="registered twice"):
        register("fp32")(object)


def test_bad_hyper_parameters_raise():
    import torch

    strategy = hf_lowprec.get_strategy("fp32")
    p = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match="learning rate"):
        strategy.create_optimizer(p, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        strategy.create_optimizer(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="no parameters"):
        strategy.create_optimizer([])
