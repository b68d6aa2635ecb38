"""`hf-lowprec launch`: unchanged transformers scripts and TRL's own CLI train with the strategy.

Every training test compares a launched run with a run of the same code written against
hf_lowprec (`from hf_lowprec import Trainer, TrainingArguments`, `hf_lowprec.trl`'s classes),
same seed: the logged losses, the saved weights and the saved optimizer state must be equal bit
for bit, and the startup report must name the strategy and its optimizer.
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import math
import os
import runpy
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from hf_lowprec.integrations import launch
from tests.launching import ROOT, launch_command, run_checked, run_ranks, subprocess_env

STRATEGY = "collage-plus"
# The eager reference step: no kernel build or compile in the launched processes.
OPTIONS = '{"fused": "reference"}'
STEPS = 3

# A script of the shape of transformers' examples/pytorch/language-modeling/run_clm.py.
SCRIPT = """
import dataclasses

from datasets import load_dataset
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, HfArgumentParser, default_data_collator, set_seed
from transformers import Trainer, TrainingArguments


@dataclasses.dataclass
class ModelArguments:
    tokenizer_name: str
    n_embd: int = 64


@dataclasses.dataclass
class DataArguments:
    train_file: str
    block_size: int = 32


def main():
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    raw = load_dataset("json", data_files=data_args.train_file)["train"]
    tokenized = raw.map(lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=raw.column_names)

    def group_texts(batch):
        ids = sum(batch["input_ids"], [])
        size = data_args.block_size
        blocks = [ids[i : i + size] for i in range(0, len(ids) // size * size, size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    train = tokenized.map(group_texts, batched=True, remove_columns=tokenized.column_names)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=data_args.block_size, n_embd=model_args.n_embd, n_layer=2, n_head=2
    )
    model = GPT2LMHeadModel(config)
    trainer = Trainer(model=model, args=training_args, train_dataset=train, data_collator=default_data_collator)
    trainer.train()
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
"""
TRANSFORMERS_IMPORT = "from transformers import Trainer, TrainingArguments\n"
HF_LOWPREC_IMPORT = "from hf_lowprec import Trainer, TrainingArguments\n"


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """Saved tiny GPT-2s with their tokenizer (the policy `model`, a `teacher` of another seed, a one-label
    `scorer`: the reward model), text for the script, and a data folder (jsonl) per TRL command."""
    from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

    from hf_lowprec.data import build_tokenizer, embedded_corpus, tiny_gpt2_config

    root = tmp_path_factory.mktemp("launch_assets")
    tokenizer = build_tokenizer()
    for name, cls, seed, extra in [
        ("model", GPT2LMHeadModel, 0, {}),
        ("teacher", GPT2LMHeadModel, 2, {}),
        ("scorer", GPT2ForSequenceClassification, 1, {"num_labels": 1}),
    ]:
        torch.manual_seed(seed)
        cls(tiny_gpt2_config(vocab_size=len(tokenizer), n_positions=64, **extra)).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    texts = [t[:200] for t in embedded_corpus() if t.strip()][:64]
    pairs = list(itertools.pairwise(texts[:32]))
    prompts = [{"prompt": t[:40]} for t in texts[:16]]
    for name, rows in {
        "sft": [{"text": t} for t in texts],
        "dpo": [{"prompt": t[:40], "chosen": t[40:80], "rejected": u[40:80]} for t, u in pairs],
        "reward": [{"chosen": t[:80], "rejected": t[:40] + u[40:80]} for t, u in pairs],
        # Unpaired preference: every prompt once, its completion desirable or not in turn.
        "kto": [{"prompt": t[:40], "completion": t[40:80], "label": i % 2 == 0} for i, t in enumerate(texts[:32])],
        "grpo": prompts,
        "rloo": prompts,
        "distillation": prompts,
    }.items():
        (root / name).mkdir()
        (root / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _script(directory: Path, hf_lowprec: bool) -> Path:
    text = SCRIPT.replace(TRANSFORMERS_IMPORT, HF_LOWPREC_IMPORT) if hf_lowprec else SCRIPT
    path = directory / ("run_clm_hf_lowprec.py" if hf_lowprec else "run_clm.py")
    path.write_text(text)
    return path


def _script_args(assets: Path, out: Path) -> list[str]:
    return [
        "--tokenizer_name",
        str(assets / "model"),
        "--train_file",
        str(assets / "sft" / "train.jsonl"),
        "--output_dir",
        str(out),
        "--max_steps",
        str(STEPS),
        "--per_device_train_batch_size",
        "4",
        "--learning_rate",
        "1e-3",
        "--logging_steps",
        "1",
        "--save_steps",
        str(STEPS),
        "--report_to",
        "none",
        "--use_cpu",
        "--disable_tqdm",
        "true",
    ]


def _float_bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", v) for v in values]


def _tensor_bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


class Run:
    """What one training run left in its output directory."""

    def __init__(self, out: Path) -> None:
        from safetensors.torch import load_file

        state = json.loads(next(out.rglob("trainer_state.json")).read_text())
        self.losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
        self.weights = load_file(out / "model.safetensors")
        checkpoint = out / f"checkpoint-{state['global_step']}"
        optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=False)
        self.optimizer_state = {
            (index, key): value
            for index, entries in optimizer["state"].items()
            for key, value in entries.items()
            if torch.is_tensor(value) and key != "step"
        }
        self.report = json.loads((out / "precision_report.json").read_text())


def assert_same_training(launched: Run, reference: Run, steps: int) -> None:
    """The strategy ran in the launched process, and it trained exactly as the hf_lowprec-written code."""
    assert launched.report["strategy"] == reference.report["strategy"] == STRATEGY
    assert launched.report["optimizer"]["class"] == reference.report["optimizer"]["class"] == "CollageAdamW"
    # Collage-plus keeps every optimizer state (moments and compensations) in BF16.
    assert {v.dtype for v in launched.optimizer_state.values()} == {torch.bfloat16}
    assert launched.optimizer_state.keys() == reference.optimizer_state.keys()
    for key, value in launched.optimizer_state.items():
        assert torch.equal(_tensor_bits(value), _tensor_bits(reference.optimizer_state[key])), key
    assert len(launched.losses) == steps and all(math.isfinite(v) for v in launched.losses), launched.losses
    assert _float_bits(launched.losses) == _float_bits(reference.losses), (launched.losses, reference.losses)
    assert launched.weights.keys() == reference.weights.keys()
    for name, value in launched.weights.items():
        other = reference.weights[name]
        assert value.dtype == other.dtype and torch.equal(_tensor_bits(value), _tensor_bits(other)), name


def test_environment_puts_the_hook_first_and_the_strategy_in_it():
    env = launch.launch_environment(STRATEGY, OPTIONS, {"PYTHONPATH": "/elsewhere", "KEEP": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(launch.HOOK_DIR), "/elsewhere"]
    assert (launch.HOOK_DIR / "sitecustomize.py").is_file()
    assert env[launch.ENV_LAUNCH] == "1" and env["KEEP"] == "1"
    assert env[launch.ENV_STRATEGY] == STRATEGY and json.loads(env[launch.ENV_OPTIONS]) == {"fused": "reference"}
    plain = launch.launch_environment(None, None, {launch.ENV_STRATEGY: "bf16-pure", "PYTHONPATH": ""})
    assert launch.ENV_STRATEGY not in plain and plain["PYTHONPATH"] == str(launch.HOOK_DIR)
    with pytest.raises(ValueError, match="without --precision_strategy"):
        launch.launch_environment(None, OPTIONS, {})
    with pytest.raises(ValueError, match="JSON object"):
        launch.launch_environment(STRATEGY, "[1]", {})
    with pytest.raises(ValueError, match=r"has no option\(s\) \['fusd'\]; valid options"):
        launch.launch_environment(STRATEGY, '{"fusd": "reference"}', {})


def test_a_missing_patch_point_names_the_versions_and_the_import_that_works(monkeypatch):
    import transformers.trainer

    monkeypatch.setattr(transformers.trainer, "TrainingArguments", object)
    with pytest.raises(launch.LaunchPatchError) as raised:
        launch._transformers_swaps(STRATEGY, None)
    message = str(raised.value)
    assert "transformers.trainer.TrainingArguments is missing or changed" in message
    assert (
        f"transformers {transformers.__version__}" in message
        and "tested with transformers 5.24 and TRL 1.16" in message
    )
    assert "`from hf_lowprec import Trainer, TrainingArguments`" in message

    monkeypatch.setattr(launch._PATCH, "originals", (transformers.TrainingArguments, transformers.Trainer))
    with pytest.raises(launch.LaunchPatchError, match=r"trl\.SFTTrainer no longer subclasses transformers'"):
        launch._precision_name(None, "SFTTrainer", type("SFTTrainer", (), {}))


def test_every_trl_command_that_trains_is_swapped_tested_and_named():
    """TRL's CLI commands that train (`trl.cli`'s TrainingCommand: one script each) are the kinds the
    launcher swaps, the commands `test_trl_cli_trains_with_the_strategy` runs, and the kinds its
    messages name: a TRL release with a new training command fails here first."""
    pytest.importorskip("trl")
    from trl.cli.commands import get_commands
    from trl.cli.commands.training import TrainingCommand

    from hf_lowprec.integrations.trl_trainers import TRAINER_KINDS

    training = {command.name for command in get_commands() if isinstance(command, TrainingCommand)}
    assert training == {kind.lower() for kind in TRAINER_KINDS} == {kind.lower() for kind in _TRL_COMMANDS}
    assert launch._TRL_KINDS.replace(" and ", ", ").split(", ") == list(TRAINER_KINDS)
    assert launch._TRL_KINDS in launch._IMPORT_CHANGE


def test_a_launched_interpreter_without_hf_lowprec_refuses_transformers(tmp_path):
    """Another environment's Python under the launcher must not train without the strategy."""
    (tmp_path / "hf_lowprec").mkdir()
    (tmp_path / "hf_lowprec" / "__init__.py").write_text("raise ImportError('not importable here')\n")
    env = launch.launch_environment(None, None, subprocess_env(PYTHONPATH=str(tmp_path)))
    cmd = [sys.executable, "-c", "import transformers"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "cannot import hf_lowprec (not importable here), so this process would train without" in proc.stderr


def test_misspelt_strategy_stops_before_the_command_starts(tmp_path):
    marker = tmp_path / "started"
    cmd = launch_command(
        "--precision_strategy", "colage-plus", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"
    )
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "unknown precision strategy 'colage-plus'" in proc.stderr and "collage-plus" in proc.stderr
    assert "Valid names:" in proc.stderr and "bf16-pure" in proc.stderr
    assert not marker.exists()


MALFORMED = '{"lost_arithmetic_metrics": tru}'


def test_a_malformed_options_variable_stops_the_launched_process(tmp_path):
    """The hook's failure must not become Python's "Error in sitecustomize" and an FP32 run."""
    marker = tmp_path / "trained"
    script = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    env = launch.launch_environment(STRATEGY, None, subprocess_env())
    direct = subprocess.run(
        script, cwd=tmp_path, env={**env, launch.ENV_OPTIONS: MALFORMED}, capture_output=True, text=True, timeout=120
    )
    # Through the launcher, the variable replaced by the command itself.
    cmd = launch_command("--precision_strategy", STRATEGY, "--", "env", f"{launch.ENV_OPTIONS}={MALFORMED}", *script)
    launched = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    for proc in (direct, launched):
        assert proc.returncode == 2, proc.stderr
        assert "Error in sitecustomize" not in proc.stderr
        assert (
            f"${launch.ENV_OPTIONS} must be a JSON object, got '{MALFORMED}' (Expecting value: line 1 column 29"
            in proc.stderr
        )
        assert "This process stops here: it would train without the precision strategy" in proc.stderr
    assert not marker.exists(), "the script ran without its strategy"


def test_a_failure_while_the_hook_imports_hf_lowprec_stops_the_process(tmp_path):
    """`import hf_lowprec` checks $HF_LOWPREC_CPU_GEMM and raises ValueError: that became "Error in
    sitecustomize" and a whole run without the strategy; it must stop the process like a failing install."""
    marker = tmp_path / "trained"
    env = launch.launch_environment(STRATEGY, None, subprocess_env(HF_LOWPREC_CPU_GEMM="bogus"))
    script = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    proc = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Error in sitecustomize" not in proc.stderr
    assert "the startup hook failed in" in proc.stderr and "ValueError: HF_LOWPREC_CPU_GEMM='bogus'" in proc.stderr
    assert "This process stops here: it would train without the precision strategy" in proc.stderr
    assert not marker.exists(), "the script ran without its strategy"


def test_a_second_hook_directory_on_the_path_neither_recurses_nor_hides_the_real_sitecustomize(tmp_path):
    """Another install's hook directory (here a copy of this one, and a symlink to it) later on the path:
    the hook chained to it, it chained back, until RecursionError; the real sitecustomize never ran."""
    other, linked, real = tmp_path / "other_hook", tmp_path / "linked_hook", tmp_path / "real"
    shutil.copytree(launch.HOOK_DIR, other)
    linked.symlink_to(launch.HOOK_DIR, target_is_directory=True)
    real.mkdir()
    ran = tmp_path / "ran"
    (real / "sitecustomize.py").write_text(f"open({str(ran)!r}, 'a').write('real\\n')\n")
    inherited = os.pathsep.join([str(ROOT), str(other), str(linked), str(real)])
    env = launch.launch_environment(STRATEGY, None, subprocess_env(PYTHONPATH=inherited))
    # A process whose path still holds them (a PYTHONPATH set by the command itself) ...
    probe = "import sys; print(sum(type(f).__name__ == '_Watcher' for f in sys.meta_path))"
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": os.pathsep.join([str(launch.HOOK_DIR), inherited])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "Error in sitecustomize" not in proc.stderr, proc.stderr
    assert proc.stdout.split() == ["1"]  # the watcher installed, once
    assert ran.read_text() == "real\n"  # the shadowed sitecustomize ran, once
    # ... and the launcher drops them from the path it inherits.
    assert env["PYTHONPATH"].split(os.pathsep) == [str(launch.HOOK_DIR), str(ROOT), str(real)]


@pytest.mark.parametrize(
    "command",
    [
        ["env", "PYTHONPATH=/elsewhere", sys.executable, "-c", "print('ran')"],
        [sys.executable, "-I", "-c", "print('ran')"],
    ],
    ids=["replaced-PYTHONPATH", "isolated"],
)
def test_a_command_whose_processes_never_ran_the_hook_fails(tmp_path, command):
    proc = subprocess.run(
        launch_command("--precision_strategy", STRATEGY, "--", *command),
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.stdout.strip() == "ran"  # the command ran to its end ...
    assert proc.returncode == launch.NO_HOOK_EXIT, proc.stderr  # ... and the launcher says it was without the hook
    assert "installed the startup hook, so none trained with precision_strategy='collage-plus'" in proc.stderr
    assert "replaced PYTHONPATH" in proc.stderr and "-I, -E or -S" in proc.stderr


def test_the_launcher_passes_on_the_exit_code_and_termination(tmp_path):
    code = subprocess.run(
        launch_command("--", sys.executable, "-c", "raise SystemExit(7)"),
        cwd=tmp_path,
        env=subprocess_env(),
        timeout=300,
    )
    assert code.returncode == 7
    # SIGTERM to the launcher reaches the command, which says so and stops; 128 + 15 as a shell reports it.
    got = tmp_path / "got"
    child = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(got)!r}, 'w').write('TERM'), sys.exit(143)))\n"
        f"open({str(got) + '.ready'!r}, 'w')\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen(launch_command("--", sys.executable, "-c", child), cwd=tmp_path, env=subprocess_env())
    deadline = time.monotonic() + 240
    while not Path(f"{got}.ready").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    assert got.read_text() == "TERM"


def test_a_path_that_is_not_executable_is_named(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    for name, match in [(script, "is not executable: chmod +x"), (tmp_path / "absent.py", "does not exist")]:
        proc = subprocess.run(
            launch_command("--", str(name)),
            cwd=tmp_path,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2 and f"'{name}' {match}" in proc.stderr, proc.stderr
        assert "not found on PATH" not in proc.stderr


PROBE = """
import json, sys
import transformers, trl
from transformers import HfArgumentParser
print(json.dumps({
    "training_args": transformers.TrainingArguments.__module__,
    "trainer": transformers.Trainer.__module__,
    "sft_config": trl.SFTConfig.__module__,
    # The SFT trainers and the classes the launcher cares about, in MRO order (helper mixins left out).
    "sft_trainer_mro": [f"{c.__module__}.{c.__name__}" for c in trl.SFTTrainer.__mro__
                        if c.__name__ in ("SFTTrainer", "PrecisionTrainerMixin", "Trainer")],
    "default": HfArgumentParser(transformers.TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "o", "--use_cpu"])[0].precision_strategy if hasattr(
        transformers.TrainingArguments, "build_precision_strategy") else None,
    "shadowed_sitecustomize": getattr(sys.modules.get("sitecustomize"), "RAN", False),
    "stock_trainer": refused(),
}))
"""
# A Trainer class that bypasses hf_lowprec's (TRL's KTOTrainer, say) must stop at construction.
REFUSED = """
import transformers.trainer

def refused():
    stock = transformers.trainer.Trainer.__mro__[-2]  # transformers' own class, under the patched name
    try:
        type("Stock", (stock,), {})()
    except (TypeError, RuntimeError) as err:  # RuntimeError: plain transformers asks for a model
        return str(err).split(", so")[0] if str(err).startswith("hf-lowprec launch") else None
"""


def test_launched_process_patches_and_a_plain_one_does_not(tmp_path):
    """One fresh interpreter each: launched (with a user sitecustomize to chain to), hook on the path, plain."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("RAN = True\n")
    # hf_lowprec imported before transformers: the patch waits for hf_lowprec's classes to exist.
    probe = [sys.executable, "-c", "import hf_lowprec.integrations.trainer\n" + REFUSED + PROBE]
    launched = subprocess.run(
        launch_command("--precision_strategy", STRATEGY, "--precision_options", OPTIONS, "--", *probe),
        cwd=tmp_path,
        env=subprocess_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(user)])),
        capture_output=True,
        text=True,
        timeout=300,
    )
    # The probe prepares no model: the launcher says nothing trained with its strategy.
    assert launched.returncode == launch.UNUSED_STRATEGY_EXIT, launched.stderr
    assert f"so nothing trained with precision_strategy={STRATEGY!r}" in launched.stderr
    seen = json.loads(launched.stdout.strip().splitlines()[-1])
    assert seen == {
        "training_args": "hf_lowprec.integrations.trainer",
        "trainer": "hf_lowprec.integrations.trainer",
        "sft_config": "hf_lowprec.integrations.trl_trainers",
        "sft_trainer_mro": [  # hf_lowprec.trl's class, the mixin over TRL's stock class, over transformers'
            "hf_lowprec.integrations.trl_trainers.SFTTrainer",
            "hf_lowprec.integrations.trainer.PrecisionTrainerMixin",
            "trl.trainer.sft_trainer.SFTTrainer",
            "transformers.trainer.Trainer",
        ],
        "default": STRATEGY,
        "shadowed_sitecustomize": True,
        "stock_trainer": f"hf-lowprec launch: __main__.Stock does not take precision_strategy={STRATEGY!r}",
    }
    # Importing hf_lowprec and transformers without the launcher's variable, even with the hook first
    # on the path (it stays inert and runs the sitecustomize it shadows): untouched.
    untouched = {
        "training_args": "transformers.training_args",
        "trainer": "transformers.trainer",
        "sft_config": "trl.trainer.sft_config",
        "sft_trainer_mro": ["trl.trainer.sft_trainer.SFTTrainer", "transformers.trainer.Trainer"],
        "default": None,
        "stock_trainer": None,
    }
    plain = [
        sys.executable,
        "-c",
        "import hf_lowprec, hf_lowprec.trl, hf_lowprec.integrations.trainer\n" + REFUSED + PROBE,
    ]
    path = os.pathsep.join([str(launch.HOOK_DIR), str(ROOT), str(user)])
    seen = json.loads(subprocess.check_output(plain, cwd=tmp_path, env=subprocess_env(PYTHONPATH=path), text=True))
    assert seen == {**untouched, "shadowed_sitecustomize": True}


LOOP = """
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0))
if sys.argv[1] == "plugin":  # a custom Accelerate loop's three lines (docs/recipes.md)
    from accelerate import Accelerator
    from hf_lowprec import PrecisionPlugin
    model = PrecisionPlugin("bf16-pure").prepare(Accelerator(cpu=True), model)
if sys.argv[1] == "direct":  # the README's custom loop: the strategy prepares the model
    import hf_lowprec
    model = hf_lowprec.get_strategy("bf16-pure").prepare_model(model)
ids = torch.randint(0, 64, (2, 16))
model(input_ids=ids, labels=ids).loss.backward()
print(next(model.parameters()).dtype)
"""


def test_a_command_that_never_took_the_strategy_fails_and_says_so(tmp_path):
    """A custom loop launched with a strategy: plain, it trains without it (FP32), ends well, and
    the launcher fails with `UNUSED_STRATEGY_EXIT`, naming the plugin; through PrecisionPlugin, or
    preparing its model with the strategy itself, it trains with it (BF16 weights), exit 0."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    cases = (("plain", launch.UNUSED_STRATEGY_EXIT, "torch.float32"), ("plugin", 0, "torch.bfloat16"))
    for how, code, dtype in (*cases, ("direct", 0, "torch.bfloat16")):
        proc = subprocess.run(
            launch_command("--precision_strategy", "bf16-pure", "--", sys.executable, str(script), how),
            cwd=tmp_path,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == code, proc.stderr
        assert proc.stdout.strip().splitlines()[-1] == dtype
        assert ("through hf_lowprec.PrecisionPlugin" in proc.stderr) == (how == "plain"), proc.stderr


@pytest.mark.slow
def test_transformers_script_takes_the_strategy_from_the_launcher_or_its_command_line(tmp_path, assets, monkeypatch):
    script, twin = _script(tmp_path, hf_lowprec=False), _script(tmp_path, hf_lowprec=True)
    strategy_args = ["--precision_strategy", STRATEGY, "--precision_options", OPTIONS]
    # The launcher's value is the default ...
    run_checked(
        launch_command(*strategy_args, "--", sys.executable, str(script), *_script_args(assets, tmp_path / "a")),
        tmp_path,
    )
    # ... and the script's own command line wins over it.
    launched_b = [*_script_args(assets, tmp_path / "b"), *strategy_args]
    run_checked(
        launch_command("--precision_strategy", "bf16-pure", "--", sys.executable, str(script), *launched_b), tmp_path
    )
    # The same script with the import changed, run here, without the launcher.
    monkeypatch.setattr(sys, "argv", [str(twin), *_script_args(assets, tmp_path / "ref"), *strategy_args])
    runpy.run_path(str(twin), run_name="__main__")
    reference = Run(tmp_path / "ref")
    assert_same_training(Run(tmp_path / "a"), reference, STEPS)
    assert_same_training(Run(tmp_path / "b"), reference, STEPS)


class _TRLCommand(NamedTuple):
    model: str  # the saved model of `assets` it trains
    args: Callable[[Path], list[str]]  # beyond the common arguments
    frozen: set[str]  # the roles of the frozen models beside the policy, in the startup report


# Lengths keep every run to seconds. Reward trains the one-label `scorer`; GRPO and RLOO score with
# it (`--reward_model_name_or_path`) and sample 2 completions of 8 tokens per prompt; Distillation
# samples 8 tokens and matches the `teacher`'s distribution on them.
_ONLINE = ["--num_generations", "2", "--max_completion_length", "8"]
_TRL_COMMANDS = {
    "SFT": _TRLCommand("model", lambda assets: ["--max_length", "64"], set()),
    "DPO": _TRLCommand("model", lambda assets: ["--max_length", "64"], {"reference"}),
    "Reward": _TRLCommand("scorer", lambda assets: ["--max_length", "64"], set()),
    "KTO": _TRLCommand("model", lambda assets: ["--max_length", "64"], {"reference"}),
    "GRPO": _TRLCommand(  # beta 0 (TRL's default): no reference model
        "model", lambda assets: [*_ONLINE, "--reward_model_name_or_path", str(assets / "scorer")], {"reward"}
    ),
    "RLOO": _TRLCommand(
        "model",
        lambda assets: [*_ONLINE, "--reward_model_name_or_path", str(assets / "scorer")],
        {"reference", "reward"},
    ),
    "Distillation": _TRLCommand(
        "model",
        lambda assets: ["--max_completion_length", "8", "--teacher_model_name_or_path", str(assets / "teacher")],
        {"teacher"},
    ),
}


def _trl_args(kind: str, assets: Path, out: Path) -> list[str]:
    command = _TRL_COMMANDS[kind]
    return [
        "--model_name_or_path",
        str(assets / command.model),
        "--dataset_name",
        str(assets / kind.lower()),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--learning_rate",  # TRL's defaults (1e-6 for most) would leave the BF16 weights as they were
        "1e-3",
        "--logging_steps",
        "1",
        "--save_steps",
        "2",
        "--seed",
        "0",
        "--gradient_checkpointing",
        "false",
        "--report_to",
        "none",
        "--use_cpu",
        "--disable_tqdm",
        "true",
        *command.args(assets),
    ]


def _trl_reference(kind: str, argv: list[str], monkeypatch) -> None:
    """TRL's own script for `kind`, run here with `hf_lowprec.trl`'s config and trainer in place of TRL's."""
    import trl

    import hf_lowprec.trl as hl_trl

    script = importlib.import_module(f"trl.scripts.{kind.lower()}")
    with monkeypatch.context() as patch:
        for suffix in ("Config", "Trainer"):
            patch.setattr(trl, f"{kind}{suffix}", getattr(hl_trl, f"{kind}{suffix}"))
        parsed = script.make_parser().parse_args_and_config(argv)
        script.main(*parsed)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(_TRL_COMMANDS))
def test_trl_cli_trains_with_the_strategy(tmp_path, assets, monkeypatch, kind):
    """`hf-lowprec launch -- trl <command>` for every training command of TRL's CLI, against TRL's
    script for it run here with `hf_lowprec.trl`'s classes: the same losses, weights and optimizer
    state bit for bit (`assert_same_training`), and the same frozen models in the startup report.
    The online commands (GRPO, RLOO, Distillation) sample their completions, yet are compared as
    strictly: their trainers seed from `--seed` when built and again before sampling, so both runs
    sample the same tokens. Their logged loss can be exactly 0 (GRPO's on-policy loss is the mean of
    zero-sum advantages), so the optimizer's first moments must show that gradients reached it, and
    the weights must have moved."""
    from safetensors.torch import load_file

    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    cli = shutil.which("trl")
    if cli is None:
        pytest.skip("the `trl` console script is not on PATH")
    launched = tmp_path / "launched"
    cmd = launch_command("--precision_strategy", STRATEGY, "--precision_options", OPTIONS, "--", cli, kind.lower())
    run_checked([*cmd, *_trl_args(kind, assets, launched)], tmp_path)
    strategy_args = ["--precision_strategy", STRATEGY, "--precision_options", OPTIONS]
    _trl_reference(kind, [*_trl_args(kind, assets, tmp_path / "ref"), *strategy_args], monkeypatch)
    run, reference = Run(launched), Run(tmp_path / "ref")
    assert_same_training(run, reference, 2)
    frozen = run.report.get("frozen_models", {})
    assert frozen == reference.report.get("frozen_models", {})
    assert {facts["role"] for facts in frozen.values()} == _TRL_COMMANDS[kind].frozen, frozen
    assert any(v.any() for (_, key), v in run.optimizer_state.items() if key == "exp_avg")
    start = load_file(assets / _TRL_COMMANDS[kind].model / "model.safetensors")
    assert any(not torch.equal(v, start[k].to(v.dtype)) for k, v in run.weights.items() if k in start)


@pytest.mark.slow
@pytest.mark.multiproc
def test_torchrun_ranks_train_with_the_strategy(tmp_path, assets):
    script, twin = _script(tmp_path, hf_lowprec=False), _script(tmp_path, hf_lowprec=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    strategy_args = ["--precision_strategy", STRATEGY, "--precision_options", OPTIONS]
    launched_cmd = launch_command(*strategy_args, "--", *torchrun, str(script), *_script_args(assets, tmp_path / "a"))
    run_ranks(launched_cmd, tmp_path, (tmp_path / "a" / "trainer_state.json").is_file)
    reference_cmd = [*torchrun, str(twin), *_script_args(assets, tmp_path / "ref"), *strategy_args]
    run_ranks(reference_cmd, tmp_path, (tmp_path / "ref" / "trainer_state.json").is_file)
    launched, reference = Run(tmp_path / "a"), Run(tmp_path / "ref")
    # Both ranks' gradients were all-reduced (the report of rank 0 says so), in a world of two.
    assert launched.report["gradients"]["communication"] == "DDP all-reduce in the gradient dtype"
    assert torch.load(tmp_path / "a" / "training_args.bin", weights_only=False).world_size == 2
    assert_same_training(launched, reference, STEPS)


def test_launched_precision_is_read_from_the_launchers_environment_only():
    from hf_lowprec.integrations.launch_env import launched_precision

    env = launch.launch_environment(STRATEGY, '{"fused": "reference"}', {})
    first, options = launched_precision(env)
    assert (first, options) == (STRATEGY, {"fused": "reference"})
    options["fused"] = "native"  # each caller gets its own dict: nothing shared to mutate
    assert launched_precision(env)[1] == {"fused": "reference"}
    assert launched_precision({k: v for k, v in env.items() if k != launch.ENV_LAUNCH}) == (None, None)


def test_a_launched_scripts_help_is_not_a_run_that_trained_nothing(tmp_path):
    """`hf-lowprec launch ... -- python train.py --help` printed the help and exited 4 ("nothing
    trained"): a script's help is a success."""
    script = tmp_path / "train.py"
    script.write_text(
        "from transformers import HfArgumentParser, TrainingArguments\n"
        "HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()\n"
    )
    cmd = launch_command("--precision_strategy", STRATEGY, "--", sys.executable, str(script), "--help")
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "--precision_strategy" in proc.stdout and "nothing trained" not in proc.stderr


def test_the_launchers_options_stay_with_the_launchers_strategy(monkeypatch, caplog):
    """`--precision_options` typed for the launcher's bf16-sr were handed to the fp32 the script's command
    line chose (ValueError: fp32 has no option 'seed', naming neither the launcher nor bf16-sr); they are
    the launcher's strategy's, dropped with a warning naming both under another, kept under the same."""
    from transformers import HfArgumentParser

    from hf_lowprec import TrainingArguments

    env = launch.launch_environment("bf16-sr", '{"fused": "reference", "seed": 3}', {})
    for name in (launch.ENV_LAUNCH, launch.ENV_STRATEGY, launch.ENV_OPTIONS):
        monkeypatch.setenv(name, env[name])
    base = ["--output_dir", "o", "--use_cpu", "true", "--report_to", "none"]
    parser = HfArgumentParser(TrainingArguments)
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        (args,) = parser.parse_args_into_dataclasses([*base, "--precision_strategy", "fp32"])
    assert args.precision_strategy == "fp32" and args.precision_options is None
    assert (
        """precision_options {"fused": "reference", "seed": 3} from hf-lowprec launch --precision_options ignored: """
        "they were given for precision_strategy='bf16-sr', and this run's precision_strategy is 'fp32'"
    ) in caplog.text
    caplog.clear()
    for argv in (base, [*base, "--precision_strategy", "bf16-sr"]):
        (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
        assert args.precision_strategy == "bf16-sr" and type(args.precision_options) is dict
        assert args.precision_options == {"fused": "reference", "seed": 3}
    given = TrainingArguments(output_dir="o", use_cpu=True, precision_strategy="fp32", precision_options={})
    assert given.precision_options == {}  # the script's own options are its own
    assert "ignored" not in caplog.text


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_a_command_asking_for_its_version_is_not_a_run_that_trained_nothing(tmp_path, flag):
    cmd = launch_command("--precision_strategy", STRATEGY, "--", sys.executable, "-c", "print('1.0')", flag)
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1.0" and "nothing trained" not in proc.stderr
