"""Regenerate the tables of README.md and docs/ that come from the code (`make readme`).

    python scripts/readme_tables.py           rewrite every generated block in place
    python scripts/readme_tables.py --check   exit 1, naming the files, when a block is stale

A generated block sits between `<!-- generated:NAME -->` and `<!-- /generated:NAME -->` in
README.md or any docs/ page; NAME is one of `blocks()`: the strategy table (names, summaries,
model-state bytes/param planned for GPT-2 small on the meta device, requirements), the engines
matrix (README and, per family with the reasons, each docs/strategies/ page), the DDP, DeepSpeed
ZeRO and FSDP2 support matrices, what each strategy changes in the stock Trainer. A maintainer tool of the repository, not of the installed package.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's package, whatever else is installed
_BLOCK = re.compile(r"(<!-- generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated:(?P=name) -->)", re.S)


def blocks() -> dict[str, str]:
    """Generated block name → its markdown, from the code."""
    from hf_lowprec.cli import memory_plan, strategy_rows
    from hf_lowprec.engines.traffic import collectives_markdown
    from hf_lowprec.engines.zero import support_matrix_markdown
    from hf_lowprec.integrations.trainer_differences import differences_markdown

    rows = strategy_rows()
    planned = {r["strategy"]: r["total"] for r in memory_plan("gpt2", [r["name"] for r in rows])}
    lines = ["| name | what | model-state bytes/param (GPT-2 small, planned) | needs |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['name']}` | {r['summary']} | {planned[r['name']]:.2f} | {r['needs'] or '—'} |")
    generated = {
        "strategies": "\n".join(lines) + "\n",
        "engines": engines_markdown(),
        "ddp-matrix": ddp_matrix(),
        "zero-matrix": support_matrix_markdown(),
        "fsdp2-matrix": fsdp2_matrix(),
        "collectives": collectives_markdown(),
        "trainer-differences": differences_markdown(),
    }
    for page, prefixes in STRATEGY_PAGES.items():
        generated[f"engines-{page}"] = engines_markdown(prefixes, reasons=True)
    return generated


# docs/strategies/<page>.md → the name prefixes of the strategies it documents.
STRATEGY_PAGES = {
    "bf16": ("bf16-", "fp32"),
    "coat": ("coat",),
    "collage": ("collage-",),
    "fp16": ("fp16-",),
    "fp8-lm": ("fp8-lm-",),
}


def engines_markdown(prefixes: tuple[str, ...] = ("",), reasons: bool = False) -> str:
    """Strategies × engines, yes/no, from the declarations the engines' checks read.

    Args:
        prefixes: only the strategies whose names start with one of these.
        reasons: add a column with why each refused engine is refused (the engines' own message).
    """
    from hf_lowprec.engines.ddp import ddp_support
    from hf_lowprec.engines.fsdp2 import fsdp2_support
    from hf_lowprec.engines.zero import zero_support
    from hf_lowprec.strategies.registry import available_strategies, get_strategy

    head = "| strategy | one process | DDP | ZeRO-1 | ZeRO-2 | ZeRO-3 | FSDP2 |"
    lines = [head + (" why not |" if reasons else ""), "|---|---|---|---|---|---|---|" + ("---|" if reasons else "")]
    for name in available_strategies():
        if not name.startswith(prefixes):
            continue
        strategy = get_strategy(name)
        ddp = ddp_support(strategy) is None
        zero = [zero_support(strategy, stage) is None for stage in (1, 2, 3)]
        fsdp2 = fsdp2_support(strategy) is None
        row = f"| `{name}` | yes | {' | '.join('yes' if ok else 'no' for ok in [ddp, *zero, fsdp2])} |"
        if reasons:
            support = strategy.engine_support()
            why = [f"DDP: {support.ddp_refusal}"] if not ddp else []
            why += [f"ZeRO: {support.zero_refusal}"] if not all(zero) else []
            why += [f"FSDP2: {support.fsdp2_refusal}"] if not fsdp2 else []
            row += f" {'; '.join(why) or '—'} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def ddp_matrix() -> str:
    from hf_lowprec.engines.ddp import support_matrix_markdown as ddp_markdown

    return ddp_markdown()


def fsdp2_matrix() -> str:
    from hf_lowprec.engines.fsdp2 import support_matrix_markdown as fsdp2_markdown

    return fsdp2_markdown()


def pages(root: Path = ROOT) -> list[Path]:
    """The pages that may hold generated blocks: README.md and every docs/ page."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def regenerate(text: str, generated: dict[str, str], where: str = "") -> str:
    """`text` with every generated block's body replaced; an unknown block name is an error."""

    def body(match: re.Match) -> str:
        name = match.group("name")
        if name not in generated:
            raise KeyError(f"{where}: unknown generated block {name!r}; known: {sorted(generated)}")
        return match.group(1) + generated[name].rstrip("\n") + "\n" + match.group(4)

    return _BLOCK.sub(body, text)


def stale_pages(root: Path = ROOT, write: bool = False) -> list[Path]:
    """The pages whose generated blocks differ from the code (rewritten when `write`)."""
    generated = blocks()
    stale = []
    for path in pages(root):
        text = path.read_text()
        new = regenerate(text, generated, str(path.relative_to(root)))
        if new != text:
            stale.append(path)
            if write:
                path.write_text(new)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a generated block is out of date")
    ns = parser.parse_args(argv)
    stale = stale_pages(write=not ns.check)
    names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
    if ns.check and stale:
        print(f"generated tables out of date in {names}: run `make readme`", file=sys.stderr)
        return 1
    if stale:
        print(f"regenerated: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
