"""The package a user installs: build the wheel, install it, run every user command elsewhere.

The wheel is built from a copy of the files a release is built from (pyproject.toml,
README.md, hf_lowprec/), so nothing of the checkout (recipes/, bench/, stale build/lib
files) can leak in. It is installed (`--no-deps`) into a throw-away virtual environment that
sees the dependencies of the environment running the tests through a `.pth` file listing that
environment's site directories. `--system-site-packages` would not do: inside a virtual
environment it exposes the base interpreter's packages, not the virtual environment's. Path
lines of a `.pth` file do not run the `.pth` files of the directories they add, so an editable
install of hf_lowprec there stays out of the way. The `hf-lowprec` commands run from an empty
temporary directory with no PYTHONPATH, so they import the installed copy and find nothing of
the repository.
"""

from __future__ import annotations

import csv
import importlib.metadata
import importlib.util
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
        f"\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


def _package_files() -> set[str]:
    """Every file of hf_lowprec/ a release ships (code and data), relative to the repository."""
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "hf_lowprec").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    }


def _site_dirs() -> list[str]:
    """The site directories on the test interpreter's sys.path, in its order (a venv's own first)."""
    paths = sysconfig.get_paths()
    sites = [*site.getsitepackages(), paths["purelib"], paths["platlib"]]
    if site.ENABLE_USER_SITE:
        sites.append(site.getusersitepackages())
    real = {os.path.realpath(d) for d in sites}
    return [d for d in dict.fromkeys(sys.path) if d and os.path.realpath(d) in real and Path(d).is_dir()]


def _check_build_tools() -> None:
    """The wheel is built without build isolation (offline): this interpreter's setuptools must
    build wheels itself (70.1 on) or have the `wheel` package beside it."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        version = "none"
    major_minor = tuple(int(x) for x in re.findall(r"\d+", version)[:2]) or (0, 0)
    if major_minor < (70, 1) and importlib.util.find_spec("wheel") is None:
        pytest.fail(
            f"{sys.executable} has setuptools {version}, which cannot build a wheel without the `wheel` "
            "package: run `make install` (the dev extra brings setuptools>=70.1)"
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str], Path, Path]:
    """(venv bin directory, environment, empty working directory, the wheel) with the wheel installed."""
    _check_build_tools()
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "hf_lowprec", src / "hf_lowprec", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PIP_DISABLE_PIP_VERSION_CHECK="1")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        cwd=tmp,
        env=env,
    )
    (wheel,) = (tmp / "dist").glob("hf_lowprec-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp, env=env)
    bin_dir = venv / "bin"
    venv_site = _run(
        [str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env
    ).strip()
    (Path(venv_site) / "dependencies_of_the_test_environment.pth").write_text("\n".join(_site_dirs()) + "\n")
    _run(
        [
            str(bin_dir / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--force-reinstall",
            str(wheel),
        ],
        cwd=tmp,
        env=env,
    )
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    work = tmp / "elsewhere"
    work.mkdir()
    return bin_dir, env, work, wheel


def test_the_wheel_holds_every_file_of_the_package(installed):
    *_, wheel = installed
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    missing = sorted(_package_files() - names)
    assert not missing, f"files of hf_lowprec/ missing from the wheel (declare them as package data): {missing}"
    assert not [n for n in names if n.startswith(("recipes/", "tests/", "bench/", "scripts/"))]


def test_user_commands_run_from_the_installed_wheel_in_any_directory(installed):
    bin_dir, env, work, _ = installed
    where = _run([str(bin_dir / "python"), "-c", "import hf_lowprec; print(hf_lowprec.__file__)"], work, env)
    assert Path(where.strip()).is_relative_to(bin_dir.parent), f"imported {where.strip()}, not the installed wheel"

    help_text = _run([str(bin_dir / "hf-lowprec"), "--help"], work, env)
    assert "{list,memory,plan,compare,launch}" in help_text, help_text  # no maintainer tools among the user commands

    listing = _run([str(bin_dir / "hf-lowprec"), "list"], work, env)
    assert "collage-plus" in listing and "fp8-lm-o2" in listing

    memory = _run(
        [str(bin_dir / "hf-lowprec"), "memory", "--model", "gpt2", "--strategies", "bf16-pure,collage-plus"], work, env
    )
    assert "124,439,808 trainable parameters" in memory
    rows = {line.split()[0]: line.split() for line in memory.splitlines() if line.startswith(("bf16-pure", "collage"))}
    assert float(rows["bf16-pure"][5]) == 8.0 and float(rows["collage-plus"][5]) == 12.0

    plan = _run(
        [str(bin_dir / "hf-lowprec"), "plan", "--model", "gpt2", "--batch", "1x128", "--strategies", "bf16-pure"],
        work,
        env,
    )
    assert "bf16-pure" in plan and "measured" in plan  # the prediction, then how far it was from the GPU

    steps = 3
    out = _run(
        [
            str(bin_dir / "hf-lowprec"),
            "compare",
            "--strategies",
            "bf16-pure,collage-plus",
            "--max_steps",
            str(steps),
            "--out",
            "cmp",
            "--",
            "--per_device_train_batch_size",
            "4",
        ],
        work,
        env,
        timeout=1500,
    )
    assert "perplexity" in out and "collage-plus" in out, out
    cmp = work / "cmp"
    with open(cmp / "results.csv") as f:
        step_rows = list(csv.DictReader(f))
    for strategy in ("bf16-pure", "collage-plus"):
        assert [int(r["step"]) for r in step_rows if r["strategy"] == strategy] == list(range(1, steps + 1))
    with open(cmp / "summary.csv") as f:
        summary = {r["strategy"]: r for r in csv.DictReader(f)}
    assert float(summary["bf16-pure"]["bytes_per_param"]) == pytest.approx(8.0, abs=0.01)
    assert float(summary["collage-plus"]["bytes_per_param"]) == pytest.approx(12.0, abs=0.01)
    for name in ("loss.png", "lost_arithmetic.png", "cost.png"):
        assert (cmp / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    leftovers = sorted(p.name for p in work.iterdir())
    assert leftovers == ["cmp"], f"compare wrote outside --out: {leftovers}"
