"""The layers point one way: the library imports nothing above it, and no module
imports itself back through another."""

import ast
import pathlib
import pkgutil
import subprocess
import sys

import flsmem

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Folder of the repository -> the module name it is installed (or run) under.
FOLDERS = {"flsmem": "flsmem", "models": "flsmem.models", "harness": "flsmem.harness",
           "train": "flsmem.train", "bench": "bench"}
ABOVE = ("flsmem.models", "flsmem.harness", "flsmem.train", "bench", "models", "harness", "train")


def test_the_library_loads_nothing_above_it():
    """Importing every module of flsmem/ in a fresh interpreter loads no model, harness,
    training or benchmark code."""
    names = [m.name for m in pkgutil.walk_packages(flsmem.__path__, "flsmem.")]
    assert "flsmem.attention" in names and "flsmem.kernels.topk" in names
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.startswith({ABOVE!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the library loaded {out.stdout.strip()}"


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name,) + parts)] = path
    return found


def _imports(path: pathlib.Path, name: str, modules: dict) -> set[str]:
    """Modules of the project that ``path`` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names)
    return {t for t in targets if t in modules and t != name}


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    above = [n for n in graph if n.startswith(ABOVE)]
    library = {n: deps for n, deps in graph.items() if n not in above}
    assert not {n: sorted(d) for n, deps in library.items() if (d := {x for x in deps if x in above})}
    state = {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                raise AssertionError(" -> ".join(trail[trail.index(nxt):] + [nxt]) if nxt in trail else nxt)
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
