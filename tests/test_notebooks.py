"""The Colab notebooks: built from their sources, stored without outputs, and each runs
top to bottom at the small size in a Jupyter kernel of this environment."""

import importlib.util
import os
import pathlib
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLAB = ROOT / "colab"
NAMES = ("01_quickstart", "02_policies", "03_regime_map", "04_learned_estimator", "05_pallas_topk")


def _build_module():
    spec = importlib.util.spec_from_file_location("colab_build", COLAB / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_notebook_has_a_source_and_is_up_to_date():
    build = _build_module()
    assert tuple(source.stem for source in build.sources()) == NAMES
    assert sorted(p.stem for p in COLAB.glob("*.ipynb")) == list(NAMES)
    for source in build.sources():
        stored = (COLAB / f"{source.stem}.ipynb").read_text()
        assert stored == build.render(source), f"{source.stem}.ipynb is stale: run python colab/build.py"
        nb = nbformat.reads(stored, as_version=4)
        assert nb.metadata.kernelspec.name == "python3"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{source.stem} stores outputs"


def test_build_rejects_malformed_sources(tmp_path):
    build = _build_module()
    bad = tmp_path / "bad.py"
    bad.write_text("# %%\nprint('no title')\n")
    with pytest.raises(ValueError, match="markdown cell"):
        build.notebook(bad)
    bad.write_text("# %% [markdown]\n# # Title\nnot a comment\n")
    with pytest.raises(ValueError, match="must be a comment"):
        build.notebook(bad)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, monkeypatch):
    nb = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    # Report which Python and which flsmem the kernel used.
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.prefix)\nprint(flsmem.__file__)"))
    monkeypatch.setenv("FLSMEM_NOTEBOOK_SIZE", "small")
    # Shape bugs fail loudly in the notebooks too, as in the tests (conftest.py).
    monkeypatch.setenv("JAX_NUMPY_RANK_PROMOTION", "raise")
    client = NotebookClient(nb, timeout=600, startup_timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(COLAB)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = nb.cells[-1].outputs
    prefix, module = "".join(o.get("text", "") for o in outputs).splitlines()
    assert prefix == sys.prefix, "the kernel ran another Python environment than the tests"
    assert pathlib.Path(module).resolve().is_relative_to(ROOT), f"the notebook imported flsmem from {module}"
    setup = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert "SIZE = 'small'" in setup
