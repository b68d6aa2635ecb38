"""The documentation: no dangling references, generated tables up to date, README short and runnable.

- Every `docs/...md` path that a docstring, comment or page cites exists, and every relative
  link of README.md and the docs/ pages points at a file of the repository.
- Nothing cites the numerics specification that lived outside the repository; the algorithms
  are docs/algorithms.md, with stable section numbers.
- The tables that come from the code (strategy table, engine matrices) match it
  (`make readme` rewrites them).
- Every dotted `hf_lowprec.…` name in README.md, docs/ and the package's docstrings and
  comments names a module or attribute that exists; every Markdown file's code fences close.
- README.md stays a five-minute read, and its Python quick starts run as printed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".cfg", ".txt", ".json", ""}
# The old citation target, spelled in two pieces so this file does not cite it itself.
OUTSIDE_SPEC = "ALGORITHMS" + ".md"
_DOCS_PATH = re.compile(r"\bdocs/(?:[\w-]+/)*[\w-][\w.-]*?\.md\b")
_MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        names = out.splitlines()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
        names = [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file() and not {".git", "build", "__pycache__"} & set(p.relative_to(ROOT).parts)
        ]
    return [ROOT / n for n in names if (ROOT / n).is_file() and (ROOT / n).suffix in TEXT_SUFFIXES]


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_cited_docs_page_exists():
    missing = []
    for path in _tracked_files():
        for match in _DOCS_PATH.finditer(_text(path)):
            if not (ROOT / match.group(0)).is_file():
                line = _text(path).count("\n", 0, match.start()) + 1
                missing.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)}")
    assert not missing, "cited docs pages that do not exist:\n" + "\n".join(missing)


def test_every_relative_link_of_the_pages_resolves():
    broken = []
    for page in _pages():
        for match in _MD_LINK.finditer(_text(page)):
            target = match.group(1).split("#", 1)[0]
            if not target or re.match(r"^[a-z]+:", target):  # an anchor on the page, or a URL
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {match.group(1)}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_nothing_cites_the_outside_specification():
    citing = [str(p.relative_to(ROOT)) for p in _tracked_files() if OUTSIDE_SPEC in _text(p)]
    assert not citing, f"cite docs/algorithms.md §N instead of {OUTSIDE_SPEC} in: {citing}"


def test_algorithms_page_keeps_its_section_numbers():
    text = _text(ROOT / "docs" / "algorithms.md")
    headings = re.findall(r"^## §(\d+) ", text, re.M)
    assert headings == [str(n) for n in range(7)], headings
    for path in _tracked_files():
        for number in re.findall(r"docs/algorithms\.md §(\d+)", _text(path)):
            assert int(number) <= 6, f"{path.relative_to(ROOT)} cites docs/algorithms.md §{number}"


_DOTTED = re.compile(r"\bhf_lowprec(?:\.[A-Za-z_]\w*)+")
# Inside the package, names are often written from the package down (`optim.adamw.AdamW`).
_PACKAGE_RELATIVE = re.compile(r"`((?:optim|fp8|coat|strategies|integrations)(?:\.[A-Za-z_]\w*)+)")


def _resolves(dotted: str) -> bool:
    """Import the longest importable module prefix of `dotted`, then getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            continue
        if cut == len(parts):
            return True  # a module (not imported: `hf_lowprec.__main__` would run the command line)
        obj = importlib.import_module(module)
        for attribute in parts[cut:]:
            if attribute in getattr(obj, "__all__", ()) and not hasattr(type(obj), attribute):
                # A lazily built export (hf_lowprec.trl's trainers) may need an optional package
                # that this environment lacks (TRL 1.12 for PPO): listed in __all__ is enough.
                try:
                    obj = getattr(obj, attribute)
                except ImportError:
                    return True
                continue
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def _named_places() -> list[tuple[Path, str]]:
    """(file, dotted name) for every `hf_lowprec.…` name of the pages and the package's source."""
    sources = _pages() + sorted((ROOT / "hf_lowprec").rglob("*.py")) + [ROOT / "Makefile", ROOT / "pyproject.toml"]
    places = []
    for path in sources:
        text = _text(path)
        places += [(path, m.group(0)) for m in _DOTTED.finditer(text)]
        if path.suffix == ".py":
            places += [(path, "hf_lowprec." + m.group(1)) for m in _PACKAGE_RELATIVE.finditer(text)]
    return places


def test_every_dotted_name_resolves():
    places = _named_places()
    assert len(places) > 100, "the scan found almost no names: the pattern is broken"
    unknown = sorted({f"{path.relative_to(ROOT)}: {name}" for path, name in places if not _resolves(name)})
    assert not unknown, "names of modules or attributes that do not exist:\n" + "\n".join(unknown)


def test_the_name_check_catches_a_stale_name():
    assert _resolves("hf_lowprec.optim.adamw.adamw_scalars") and _resolves("hf_lowprec.__main__")
    assert not _resolves("hf_lowprec.optim.kernels") and not _resolves("hf_lowprec.optim.adamw.AdamWBase")


def test_every_markdown_file_closes_its_code_fences():
    unbalanced = []
    for path in _tracked_files():
        if path.suffix != ".md":
            continue
        fences = re.findall(r"^ {0,3}(```|~~~)", _text(path), re.M)
        if len(fences) % 2:
            unbalanced.append(f"{path.relative_to(ROOT)} ({len(fences)} fences)")
    assert not unbalanced, "code fences left open (the page renders cut off):\n" + "\n".join(unbalanced)


def _readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_match_the_code():
    tables = _readme_tables()
    assert not tables.stale_pages(), "generated tables are stale: run `make readme`"
    # The README carries the strategy table and the engines matrix; the per-engine detail tables
    # live on the distributed-training page.
    homes = {
        "strategies": "README.md",
        "engines": "README.md",
        "ddp-matrix": "docs/distributed.md",
        "zero-matrix": "docs/distributed.md",
        "fsdp2-matrix": "docs/distributed.md",
        "collectives": "docs/distributed.md",
        "trainer-differences": "README.md",
        **{f"engines-{page}": f"docs/strategies/{page}.md" for page in tables.STRATEGY_PAGES},
    }
    assert set(homes) == set(tables.blocks())
    for name, home in homes.items():
        assert f"<!-- generated:{name} -->" in _text(ROOT / home), f"{home} lost its generated {name} table"


def _table_rows(text: str, header: str) -> dict[str, list[str]]:
    """The rows of the markdown table under the line starting `header`: first cell → cells."""
    lines = text[text.index(header) :].splitlines()
    rows = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells
    return rows


def test_the_evidence_table_gives_the_planned_bytes_of_the_strategy_table():
    """Both columns are the bytes/param planned for GPT-2 small: the evidence gave collage-8bit 8.06
    beside the strategy table's (and `hf-lowprec list`'s) 8.03."""
    readme = _text(ROOT / "README.md")
    planned = _table_rows(readme, "| name | what | model-state bytes/param (GPT-2 small, planned) |")
    evidence = _table_rows(readme, "| strategy | eval perplexity (vs bf16-mixed) | model-state bytes/param |")
    assert evidence and set(evidence) <= set(planned)
    assert {n: row[2] for n, row in evidence.items()} == {n: planned[n][2] for n in evidence}


def test_regenerating_rewrites_a_stale_block_and_refuses_an_unknown_one():
    tables = _readme_tables()
    generated = {"strategies": "| new |\n"}
    stale = "a\n<!-- generated:strategies -->\n| old |\n<!-- /generated:strategies -->\nb\n"
    assert (
        tables.regenerate(stale, generated)
        == "a\n<!-- generated:strategies -->\n| new |\n<!-- /generated:strategies -->\nb\n"
    )
    with pytest.raises(KeyError, match="unknown generated block 'nope'"):
        tables.regenerate("<!-- generated:nope -->\n<!-- /generated:nope -->", generated, "X.md")


def test_readme_is_a_five_minute_read():
    lines = _text(ROOT / "README.md").count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move detail to docs/"


def test_ci_runs_the_readme_commands_as_printed():
    """.ci/run takes the README's set-up block itself; what it finds is the venv and the two commands."""
    script = _text(ROOT / ".ci" / "run")
    awk = re.search(r"block=\$\(awk '([^']+)' README.md\)", script)
    assert awk, ".ci/run no longer reads its commands from README.md"
    block = subprocess.run(["awk", awk.group(1), str(ROOT / "README.md")], capture_output=True, text=True).stdout
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["python3 -m venv .venv && . .venv/bin/activate", "make demo", "make test"]
    assert 'bash -euo pipefail -c "$block"' in script
    ignored = subprocess.run(["git", "check-ignore", "-q", ".venv/bin/python"], cwd=ROOT)
    assert ignored.returncode == 0, "the README's .venv must be ignored by git (it would travel to the GPU machine)"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", _text(ROOT / "README.md"), re.S)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_quick_starts_run(index, tmp_path):
    code = _python_blocks()[index]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"README python block {index} failed:\n{code}\n--- stderr\n{proc.stderr[-4000:]}"


def test_the_ledger_tables_name_the_widths_as_bench_ledger_prints_them(monkeypatch):
    """docs/benchmarks.md's ledger tables are `bench/bench_ledger.py`'s output: each TFLOPs cell
    is "x.y NAME" with the names it prints, FP8 the E4M3 and E5M2 GEMMs together."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    bench_ledger = importlib.import_module("bench_ledger")
    assert bench_ledger.by_width({torch.float8_e5m2: 2, torch.bfloat16: 5, torch.float8_e4m3fn: 1}) == {
        "BF16": 5,
        "FP8": 3,
    }
    names, cells = set(bench_ledger.WIDTHS.values()), []
    column = None
    for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cols is None:
            column = None
        elif "TFLOPs (width)" in cols:
            column = cols.index("TFLOPs (width)")
        elif column is not None and not cols[0].startswith("---") and len(cols) > column:
            cells.append(cols[column])
    assert len(cells) >= 20  # the dense and the MoE table
    for cell in cells:
        for entry in cell.split(", "):
            value, name = entry.split(" ")
            assert float(value) >= 0 and name in names, cell


_CONFIGS = ROOT / "recipes" / "configs"


def _launch_examples() -> list[tuple[str, list[str]]]:
    """Every `hf-lowprec launch` command in the code blocks of README.md and docs/, split as a shell
    splits it (backslash-continued lines joined); with the page it is on."""
    found = []
    for page in _pages():
        text = re.sub(r"\\\n\s*", " ", _text(page))
        for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S):
            for line in block.splitlines():
                if line.strip().startswith("hf-lowprec launch "):
                    command = shlex.split(line.split("  #")[0])
                    found.append((f"{page.relative_to(ROOT)}: {line.strip()}", command))
    return found


def _launched_engine(command: list[str]) -> tuple[str, int | None]:
    """The engine a launched command trains under: ("zero", stage), ("fsdp2", None), ("ddp", None), or
    ("single", None); an Accelerate config file is read from recipes/configs/ by its name."""
    import yaml

    if "--config_file" in command:
        config = yaml.safe_load((_CONFIGS / Path(command[command.index("--config_file") + 1]).name).read_text())
        kind = config["distributed_type"]
        if kind == "DEEPSPEED":
            deepspeed = config["deepspeed_config"]
            if "zero_stage" in deepspeed:
                return "zero", int(deepspeed["zero_stage"])
            return "zero", int(
                json.loads((ROOT / deepspeed["deepspeed_config_file"]).read_text())["zero_optimization"]["stage"]
            )
        return {"FSDP": ("fsdp2", None), "NO": ("single", None)}.get(kind, ("ddp", None))
    return ("ddp", None) if {"torchrun", "deepspeed"} & set(command) else ("single", None)


def test_every_launch_example_names_a_strategy_its_engine_and_options_allow():
    """An `hf-lowprec launch` line of the docs must be a command the launcher and the engines run: the
    strategy and options build, and the strategy's EngineSupport allows the engine the command names."""
    from hf_lowprec import get_strategy

    examples = _launch_examples()
    assert len(examples) >= 5  # the parse found the pages' examples
    wrong = []
    for where, command in examples:
        launcher = command[: command.index("--")] if "--" in command else command
        if "--precision_strategy" not in launcher or launcher[launcher.index("--precision_strategy") + 1] == "NAME":
            continue
        name = launcher[launcher.index("--precision_strategy") + 1]
        options = launcher[launcher.index("--precision_options") + 1] if "--precision_options" in launcher else "{}"
        strategy = get_strategy(name, **json.loads(options))
        support = strategy.engine_support()
        engine, stage = _launched_engine(command[len(launcher) :])
        allowed = {
            "zero": stage in support.zero_stages,
            "fsdp2": support.fsdp2,
            "ddp": support.ddp,
            "single": True,
        }[engine]
        if not allowed:
            wrong.append(f"{where}: {name} under {engine}{'' if stage is None else f' stage {stage}'}")
    assert not wrong, wrong
