"""The README stays true: its usage example runs as printed, and CI runs its test command."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_usage_examples_run_as_printed(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(blocks) >= 2, "README lost a python example"
    for i, block in enumerate(blocks):
        script = tmp_path / f"example{i}.py"
        script.write_text(block)
        # From the repository root, where the README's relative paths point.
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert "evictions" in out.stdout


def test_ci_runs_the_readme_test_command():
    commands = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1).strip().splitlines()
    assert len(commands) == 2
    assert commands[0].endswith("flsmem eval")
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
