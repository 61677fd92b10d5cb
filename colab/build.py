"""Build the notebooks of this folder from their sources in ``source/``.

Each source is a Python file in the "percent" format: ``# %%`` starts a code cell and
``# %% [markdown]`` a markdown cell, whose lines are comments (``# `` is stripped).
Every notebook gets the shared setup cell (``source/_setup.py``) right after its first
markdown cell. The notebooks are written without outputs, with stable cell ids, so a
rebuild of unchanged sources changes nothing.

    python colab/build.py            # write colab/*.ipynb
    python colab/build.py --check    # fail if a notebook differs from its source
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import nbformat

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = HERE / "source"
SETUP = SOURCES / "_setup.py"

METADATA = {
    "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
    "language_info": {"name": "python"},
    "colab": {"provenance": [], "toc_visible": True},
}


def _cells(text: str) -> list[tuple[str, str]]:
    """``(kind, source)`` pairs of a percent-format file, kind "code" or "markdown"."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if "[markdown]" in line else "code", []))
        elif cells:
            cells[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"text before the first cell marker: {line!r}")
    out = []
    for kind, lines in cells:
        if kind == "markdown":
            for line in lines:
                if line.strip() and not line.startswith("#"):
                    raise ValueError(f"a markdown line must be a comment: {line!r}")
            lines = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines]
        source = "\n".join(lines).strip("\n")
        if source:
            out.append((kind, source))
    return out


def notebook(source: pathlib.Path) -> nbformat.NotebookNode:
    """The notebook of one source file, setup cell included."""
    cells = _cells(source.read_text())
    if not cells or cells[0][0] != "markdown":
        raise ValueError(f"{source.name} must start with a markdown cell (the title)")
    cells.insert(1, ("code", SETUP.read_text().strip("\n")))
    nb = nbformat.v4.new_notebook(metadata=METADATA)
    for i, (kind, text) in enumerate(cells):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        nb.cells.append(make(text, id=f"cell-{i:02d}"))
    nbformat.validate(nb)
    return nb


def sources() -> list[pathlib.Path]:
    """The notebook sources, in order (files starting with ``_`` are shared parts)."""
    return sorted(p for p in SOURCES.glob("*.py") if not p.name.startswith("_"))


def render(source: pathlib.Path) -> str:
    """The ``.ipynb`` text of one source."""
    return nbformat.writes(notebook(source)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the notebooks are up to date")
    args = parser.parse_args(argv)
    stale = []
    for source in sources():
        target = HERE / f"{source.stem}.ipynb"
        text = render(source)
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.name)
        if not args.check:
            target.write_text(text)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python colab/build.py", file=sys.stderr)
        return 1
    print("up to date" if args.check else f"written: {', '.join(stale) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
