"""The device check's own logic, on CPU (bench/device_check*.py, scripts/device_check.sh).

What runs on the GPU machine cannot be rehearsed in the suite (a CUDA device, minutes); what
decides whether its results come back can: the parts cover every section within their time,
a report keeps its rows when its section is cut short, the manifest tells which tree ran, the
pytest plugin records each outcome as it comes, and a GPU section without a device says so.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import device_check  # noqa: E402
from device_check_steps import gemm_calls, gemm_row  # noqa: E402

SCRIPT = ROOT / "scripts" / "device_check.sh"
# The device tool runs a command for at most what its caller allows; the issue gives each part
# six minutes. The script stops starting sections at its limit and gives the last one its
# budget plus 15 s of grace and 10 s to die: that must end inside the six minutes.
PART_SECONDS = 360
GRACE = 15 + 10


def test_the_parts_run_every_section_once_within_their_time():
    planned = [name for part in device_check.PARTS.values() for name, _ in part]
    assert sorted(planned) == sorted(device_check.SECTIONS)
    limit = int(re.search(r"DEVICE_CHECK_SECONDS:-(\d+)", SCRIPT.read_text()).group(1))
    assert limit + GRACE <= PART_SECONDS
    for part, sections in device_check.PARTS.items():
        assert sum(budget for _, budget in sections) <= limit, part


def test_the_script_parses_and_names_its_parts():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    usage = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert usage.returncode == 2 and "part1|part2|all" in usage.stderr


def test_a_report_keeps_its_rows_when_its_section_is_cut(tmp_path):
    report = device_check.Report(tmp_path, "demo", "Demo", ["name", "value"], {"device": "x", "torch": "y"})
    report.add({"name": "a|b", "value": 0.5})
    device_check.mark_cut(tmp_path, "demo", 12)
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["status"] == "cut short" and data["rows"] == [{"name": "a|b", "value": 0.5}]
    markdown = (tmp_path / "demo.md").read_text()
    assert "| a/b | 0.5 |" in markdown and "stopped by the part's timeout after 12 s" in markdown
    assert not list(tmp_path.glob("*.tmp"))


def test_a_section_never_started_still_says_so(tmp_path):
    device_check.mark_cut(tmp_path, "e2e", 0)
    assert json.loads((tmp_path / "e2e.json").read_text())["status"] == "cut short"


@pytest.mark.skipif(
    not (ROOT / ".git").exists(), reason="the manifest is made from a git checkout (the device gets none)"
)
def test_the_manifest_names_the_tree_and_what_differs_from_it(tmp_path, capsys):
    assert device_check.write_manifest(tmp_path) == 0
    assert "of 64 MiB" in capsys.readouterr().out
    manifest = json.loads((tmp_path / device_check.MANIFEST).read_text())
    assert "scripts/device_check.sh" in manifest["files"] and len(manifest["commit"]) == 40
    manifest["files"]["pyproject.toml"] = "0" * 16
    (tmp_path / device_check.MANIFEST).write_text(json.dumps(manifest))
    state = device_check.tree_state(tmp_path)
    assert state.startswith(manifest["commit"][:10]) and "1 files differ" in state and "pyproject.toml" in state


def _checkout_with_venv(tmp_path: Path) -> Path:
    """A checkout with this repository's .gitignore, a tracked file and a README-style .venv in it."""
    root = tmp_path / "checkout"
    root.mkdir()
    (root / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    (root / "README.md").write_text("readme\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "init"], cwd=root, check=True)
    site = root / ".venv" / "lib" / "python3.11" / "site-packages" / "torch"
    site.mkdir(parents=True)
    with open(site / "libtorch_cpu.so", "wb") as f:  # sparse: its size counts, no disk is used
        f.truncate(device_check.TRAVEL_LIMIT * 3)
    (root / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    return root


def test_a_venv_in_the_checkout_does_not_travel(tmp_path):
    root = _checkout_with_venv(tmp_path)
    files = device_check.travelling_files(root)
    assert files == [".gitignore", "README.md"]
    assert sum((root / f).stat().st_size for f in files) < device_check.TRAVEL_LIMIT
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    assert device_check.write_manifest(bundle, root) == 0


def test_a_tree_over_the_limit_is_refused_naming_the_heaviest_folder_and_the_fix(tmp_path, capsys):
    root = _checkout_with_venv(tmp_path)
    data = root / "mydata"
    data.mkdir()
    with open(data / "shard0.bin", "wb") as f:
        f.truncate(device_check.TRAVEL_LIMIT + 1)
    (root / "notes.txt").write_text("small\n")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    assert device_check.write_manifest(bundle, root) == 1
    err = capsys.readouterr().err
    assert "over the device tool's limit" in err and "mydata/" in err and ".gitignore" in err
    assert ".venv" not in err.split("fix:")[0]  # the ignored venv is not blamed
    assert err.index("mydata/") < err.index("notes.txt")  # largest first
    assert not (bundle / device_check.MANIFEST).exists()


def test_the_pytest_plugin_records_every_outcome(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_pass(): pass\n"
        "def test_fail(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skip(): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('setup broke')\n"
        "def test_error(broken): pass\n"
    )
    outcomes, _, _ = device_check.run_pytest([str(tmp_path)], 1, 60, tmp_path / "log.jsonl")
    found = {o["test"].rsplit("::", 1)[1]: o for o in outcomes}
    assert {k: o["outcome"] for k, o in found.items()} == {
        "test_pass": "passed",
        "test_fail": "failed",
        "test_skip": "skipped",
        "test_error": "error",
    }
    assert "assert 1 == 2" in found["test_fail"]["reason"] and found["test_skip"]["reason"] == "not here"
    assert "setup broke" in found["test_error"]["reason"]


def test_a_gpu_section_without_a_device_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device_check.main(["run", "optim", "--out", str(tmp_path), "--budget", "10"])
    data = json.loads((tmp_path / "optim.json").read_text())
    assert data["status"] == "no CUDA device" and data["rows"] == []
    assert data["context"]["torch"] == torch.__version__


def test_the_gemm_counter_sees_forward_and_both_backward_gemms():
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    # Forward addmm (with the bias), backward: the input's gradient and the weight's.
    assert gemm_calls(lambda: layer(x).sum().backward()) == {"addmm→float32": 1, "mm→float32": 2}


@pytest.mark.parametrize(
    "eager, verdict",
    [
        ({"_scaled_mm e4m3fn×e4m3fn→bfloat16": 16, "_scaled_mm e5m2×e4m3fn→bfloat16": 8}, "every FP8"),
        ({"_scaled_mm e4m3fn×e4m3fn→bfloat16": 8, "mm→bfloat16": 16}, "NOT all FP8"),
    ],
)
def test_three_scaled_mm_per_fp8_layer_is_the_verdict(eager, verdict):
    row = gemm_row("fp8-lm-o2", {"fp8_layers": 8, "eager": eager, "compiled": {"_scaled_mm": 24, "mm": 3}})
    assert row["expected _scaled_mm"] == 24 and row["verdict"].startswith(verdict)


def test_the_rl_section_measures_the_frozen_models_it_keeps(tmp_path, monkeypatch):
    """The `rl` section's code at toy sizes on the CPU (its GPU figures wait for a device): the frozen
    reference and reward model hold 2 bytes/param in their blocks under bf16-mixed, about 1 under
    fp8-lm-o2, and 2 again (FP16 scaled masters) when frozen like the policy."""
    import device_check_rl

    rows = (device_check_rl.ROWS[0], device_check_rl.ROWS[3], device_check_rl.ROWS[4])
    monkeypatch.setattr(device_check_rl, "ROWS", rows)
    device_check.main(["run", "rl", "--out", str(tmp_path), "--device", "cpu", "--smoke", "--budget", "120"])
    data = json.loads((tmp_path / "rl.json").read_text())
    got = {row["row"]: row for row in data["rows"]}
    assert set(got) == {label for label, _, _ in rows} and not any(row.get("note") for row in got.values())
    assert got["bf16-mixed"]["reference B/param"] == got["bf16-mixed"]["reward B/param"] == 2.0
    assert 1.0 < got["fp8-lm-o2"]["reference B/param"] < 1.1 and 1.0 < got["fp8-lm-o2"]["reward B/param"] < 1.1
    assert got["fp8-lm-o2, frozen as policy"]["reference B/param"] == pytest.approx(2.0, abs=0.01)
    assert all(math.isfinite(row["loss"]) for row in got.values())


def test_the_moe_section_measures_an_experts_layer_at_deepseek_v3_s_shape_first(tmp_path, monkeypatch):
    """Issue #67's second shape: the `moe` section first times one experts layer, BF16 grouped GEMMs
    against the same layer in FP8 rowwise, at DeepSeek-V3's expert shape (each of 8 experts gets
    2048 tokens), then the model's rows in what is left of its budget. At toy sizes on the CPU
    (the model's rows left out: their first step compiles for minutes here): the routing gives
    every expert its even share, the FP8 row's module is converted, both rows come back with the
    ratio and the goal."""
    import device_check_moe as moe

    from hf_lowprec.fp8.experts import FP8Experts
    from hf_lowprec.grouped_experts import GroupedExperts

    full = moe.LAYER
    assert (full["hidden"], full["width"], full["experts"]) == (7168, 2048, 8)
    assert full["tokens"] * full["top_k"] // full["experts"] == 2048
    for recipe, kind in ((None, GroupedExperts), ("rowwise", FP8Experts)):
        module, x, index, weights = moe.experts_layer(recipe, moe.LAYER_SMOKE, "cpu")
        assert isinstance(module, kind) and x.dtype == weights.dtype == torch.bfloat16
        counts = torch.bincount(index.flatten(), minlength=module.num_experts)
        assert (counts == x.shape[0] * index.shape[1] // module.num_experts).all()
        assert all(len(set(row)) == index.shape[1] for row in index.tolist())  # k distinct experts
    monkeypatch.setattr(moe, "ROWS", ())
    device_check.main(["run", "moe", "--out", str(tmp_path), "--device", "cpu", "--smoke", "--budget", "120"])
    rows = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert [row["row"] for row in rows] == [label for label, _ in moe.LAYER_ROWS]
    bf16, fp8 = rows[0], rows[1]
    assert bf16["TFLOP/s"] >= 0 and fp8["step ms"] > 0 and "goal ≥ 1.25×" in fp8["note"]
    assert fp8["× bf16-pure"] == pytest.approx(bf16["step ms"] / fp8["step ms"], rel=0.01)
    assert "no CUDA device" in fp8["rule"]


def test_the_bundle_carries_the_ledger_s_prediction_for_each_row(tmp_path):
    """`make device-bundle` counts each row's predicted step (docs/planning.md) on the CPU, so the
    device check prints it beside the measured one without spending device time on counting."""
    from device_common import PREDICTIONS, write_predictions

    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": 256,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        )
    )
    write_predictions(tmp_path, {"e2e": (str(config), True, ["bf16-mixed", "torch-amp", "no-such-strategy"])})
    found = json.loads((tmp_path / PREDICTIONS).read_text())
    for gpu in ("h100", "h200"):
        assert set(found["e2e"][gpu]) == {"bf16-mixed", "torch-amp"}  # a row it cannot count is left out
        assert all(ms > 0 for ms in found["e2e"][gpu].values())
    assert found["e2e"]["h200"]["bf16-mixed"] <= found["e2e"]["h100"]["bf16-mixed"]  # more bandwidth


def test_a_prediction_off_by_more_than_20_percent_says_the_table_changes():
    """Issue #69 item 2: beside each measured row, how far the ledger's prediction was; past 20%
    the check says so, and that the table of GPU constants is what changes."""
    from device_common import prediction_check

    assert prediction_check(None, 63.6) == ""
    assert prediction_check(75.8, 63.6) == "+19%"
    assert prediction_check(120.5, 147.0) == "-18%"
    off = prediction_check(90.0, 63.6)
    assert off.startswith("+42%") and "more than 20% off" in off and "hf_lowprec.planning.gpus" in off
    assert "more than 20% off" in prediction_check(40.0, 63.6)
