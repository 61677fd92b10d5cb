"""The built wheel works anywhere: installed (not editable) into a fresh environment, it
runs ``flsmem eval`` from an empty folder, and it installs nothing but ``flsmem``.

The fresh environment reads its dependencies from this one's site-packages through a
path file, rather than installing them all again: a plain path entry, so this
environment's editable ``flsmem`` (a path file of its own there) is not picked up.
CI's own installation from ``pyproject.toml`` checks that the dependencies resolve."""

import pathlib
import subprocess
import sys
import sysconfig
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(args, **kwargs):
    out = subprocess.run(args, capture_output=True, text=True, timeout=900, **kwargs)
    assert out.returncode == 0, f"{' '.join(map(str, args))} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out


def test_wheel_installs_under_one_name_and_runs_from_an_empty_folder(tmp_path):
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dist), str(ROOT)])
    (wheel,) = dist.glob("flsmem-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"flsmem", next(t for t in top if t.endswith(".dist-info"))}, top
    for data in ("flsmem/data/austen/persuasion.txt", "flsmem/checkpoints/tiny-austen/config.json",
                 "flsmem/checkpoints/estimator/settings.json",
                 "flsmem/checkpoints/estimator-smollm2/settings.json", "flsmem/models/decoder.py"):
        assert data in names

    env = tmp_path / "env"
    _run([sys.executable, "-m", "venv", str(env)])
    site = _run([str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    (pathlib.Path(site.stdout.strip()) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(env / "bin" / "pip"), "install", "--quiet", "--no-deps", "--ignore-installed", str(wheel)])
    empty = tmp_path / "empty"
    empty.mkdir()
    where = _run([str(env / "bin" / "python"), "-c", "import flsmem.models.data as d; print(d.DATA_DIR)"], cwd=empty)
    assert pathlib.Path(where.stdout.strip()).is_relative_to(env), where.stdout
    out = _run([str(env / "bin" / "flsmem"), "eval", "--quick", "--plot", "eval.png"], cwd=empty)
    lines = out.stdout.splitlines()
    assert any(line.startswith("full cache: nll") for line in lines), out.stdout
    rows = [line for line in lines if line.split(" ")[0] in ("streaming_llm", "h2o", "rmm", "oracle")]
    assert len(rows) == 4 and all(len(row.split("|")) == 3 for row in rows), out.stdout
    assert (empty / "eval.png").stat().st_size > 0
