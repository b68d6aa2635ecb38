"""Strategy options: one the chosen combination never reads is refused when given, and the
unknown-option error lists only the options the user may set (`strategies.options.build_options`)."""

import re

import pytest

import hf_lowprec
from hf_lowprec.checkpoints.resume import check_resume_options

# (name, options, the option refused, words of the reason). Each was accepted and ignored before:
# the run was bit for bit the one without it.
NEVER_READ = [
    ("collage-plus", {"seed": 12345}, "seed", "bf16-sr's stochastic rounding"),
    ("collage-light", {"seed": 0}, "seed", "bf16-sr's stochastic rounding"),
    ("bf16-kahan", {"seed": 12345}, "seed", "bf16-sr's stochastic rounding"),
    ("bf16-fp32states", {"seed": 1}, "seed", "bf16-sr's stochastic rounding"),
    ("bf16-sr", {"seed_compensation": False}, "seed_compensation", "this update keeps none"),
    ("bf16-fp32states", {"seed_compensation": True}, "seed_compensation", "this update keeps none"),
    ("fp16-als", {"seed": 12345}, "seed", "weights='master' rounds to nearest"),
    ("fp16-als", {"weights": "sr", "seed_compensation": False}, "seed_compensation", "weights='sr' keeps no master"),
    ("coat", {"states": False, "group_size": 7}, "group_size", "states=False keeps AdamW states"),
    ("coat", {"states": False, "exp_avg_sq_format": "e5m2"}, "exp_avg_sq_format", "states=False keeps AdamW"),
    ("coat", {"states": False, "expand": False}, "expand", "states=False keeps AdamW states"),
    ("coat", {"activations": False, "fp8_layers": "all"}, "fp8_layers", "activations=False converts none"),
    ("coat", {"activations": False, "fp8_tokens": 5}, "fp8_tokens", "activations=False converts none"),
    ("fp8-lm-o2", {"fp8_layers": "all", "fp8_tokens": 5}, "fp8_tokens", "fp8_layers='all' converts every"),
    ("fp8-lm-o1", {"fp8_layers": "all", "fp8_gpu": "h100"}, "fp8_gpu", "fp8_layers='all' converts every"),
    ("fp8-lm-o1", {"exp_avg_sq_format": "fp16"}, "exp_avg_sq_format", "O1 keeps FP32 states"),
]


@pytest.mark.parametrize("name, options, key, why", NEVER_READ)
def test_an_option_the_combination_never_reads_is_refused(name, options, key, why, tmp_path):
    match = rf"precision strategy {name!r} never reads option\(s\) \[{key!r}\].*{re.escape(why)}.*drop {key}"
    with pytest.raises(ValueError, match=match):
        hf_lowprec.get_strategy(name, **options)
    with pytest.raises(ValueError, match=match):  # before any work: the arguments themselves
        hf_lowprec.TrainingArguments(
            output_dir=str(tmp_path), precision_strategy=name, precision_options=options, use_cpu=True
        )


@pytest.mark.parametrize(
    "name, options",
    [
        ("bf16-sr", {"seed": 3}),
        ("collage-plus", {"seed_compensation": False}),
        ("bf16-kahan", {"seed_compensation": True}),
        ("fp16-als", {"seed_compensation": False}),
        ("fp16-als", {"weights": "sr", "seed": 2}),
        ("coat", {"states": False, "master_weights": "bf16-collage"}),
        ("coat", {"activations": False, "group_size": 64, "expand": False}),
        ("coat", {"fp8_gpu": "h100", "fp8_tokens": 512}),
        ("fp8-lm-o2", {"fp8_layers": "all", "exp_avg_sq_format": "e4m3"}),
    ],
)
def test_options_the_combination_reads_stay_legal(name, options):
    strategy = hf_lowprec.get_strategy(name, **options)
    assert all(getattr(strategy.options, k) == v for k, v in options.items())
    assert not set(options) & set(strategy.options.unread_options())


@pytest.mark.parametrize(
    "name, options, listed, left_out",
    [
        ("collage-plus", {}, {"seed_compensation", "fused"}, {"update", "seed"}),
        ("bf16-sr", {}, {"seed"}, {"update", "seed_compensation"}),
        ("fp8-lm-o2", {}, {"exp_avg_sq_format", "fp8_layers"}, {"level"}),
        ("fp8-lm-o1", {}, {"fp8_layers"}, {"level", "exp_avg_sq_format"}),
        ("fp16-als", {"weights": "sr"}, {"seed", "weights"}, {"seed_compensation"}),
        ("coat", {"states": False}, {"states", "master_weights"}, {"group_size", "expand"}),
    ],
)
def test_an_unknown_option_lists_only_the_options_the_user_may_set(name, options, listed, left_out):
    with pytest.raises(ValueError, match=r"has no option\(s\) \['sed'\]; valid options: ") as error:
        hf_lowprec.get_strategy(name, sed=1, **options)
    shown = set(re.findall(r"'(\w+)'", str(error.value).split("valid options: ")[1]))
    assert listed <= shown and not shown & left_out, shown
    for key in shown:  # each one listed is accepted with its default value
        default = getattr(hf_lowprec.get_strategy(name, **options).options, key)
        hf_lowprec.get_strategy(name, **{**options, key: default})


def test_a_resume_ignores_options_this_run_never_reads():
    # group_size was accepted with states=False before the refusal: a checkpoint saved so resumes
    # with states=False, whose optimizer states have no groups.
    strategy = hf_lowprec.get_strategy("coat", states=False)
    saved = {**vars(strategy.options), "group_size": 64}
    assert check_resume_options(strategy, saved, "checkpoint-2") == []
    with pytest.raises(ValueError, match=r"this run changes group_size=128 \(saved: 64\)"):
        check_resume_options(hf_lowprec.get_strategy("coat"), {**saved, "states": True}, "checkpoint-2")


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63 - 1, None])
def test_a_seed_is_any_int64_or_none(seed):
    assert hf_lowprec.get_strategy("bf16-sr", seed=seed).options.seed == seed
    assert hf_lowprec.get_strategy("fp16-als", weights="sr", seed=seed).options.seed == seed


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63, True, "3", 1.0])
def test_a_seed_outside_int64_or_not_an_integer_is_refused_naming_the_range(seed):
    with pytest.raises(
        ValueError, match=re.escape("must be an integer that fits in 64 bits (-2**63 to 2**63 - 1) or null")
    ):
        hf_lowprec.get_strategy("bf16-sr", seed=seed)


def test_a_resume_with_the_default_seed_continues_the_saved_stream():
    # None draws the seed from the run's; a resume continues the checkpoint's generator state, one saved
    # with an explicit seed (or the former default, 0) included. A seed given anew restarts the stream.
    saved = {**vars(hf_lowprec.get_strategy("bf16-sr", seed=0).options)}
    assert check_resume_options(hf_lowprec.get_strategy("bf16-sr"), saved, "checkpoint-2") == []
    assert check_resume_options(hf_lowprec.get_strategy("bf16-sr", seed=5), saved, "checkpoint-2") == ["seed"]
