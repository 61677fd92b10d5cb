# Setup: import flsmem from the repository this notebook sits in (its colab/ folder).
# In Colab, copy the repository into the runtime first (see the error below); this cell
# then installs it with its pinned dependencies.
import importlib
import os
import pathlib
import re
import shutil
import subprocess
import sys


def find_repository():
    """The flsmem checkout around the working directory (or at ./flsmem), else None."""
    here = pathlib.Path.cwd()
    for folder in (here, *here.parents, here / "flsmem"):
        if (folder / "pyproject.toml").is_file() and (folder / "flsmem" / "__init__.py").is_file():
            return folder
    return None


ROOT = find_repository()
if ROOT is None:
    raise RuntimeError(
        "This notebook needs the flsmem repository (library, models, checkpoints). Copy it into "
        "this runtime, e.g. upload an archive of it in the Files pane and run `!unzip -q flsmem.zip` "
        "so that ./flsmem/pyproject.toml exists, then run this cell again."
    )
if "google.colab" in sys.modules:
    # Colab ships other versions of jax and flax; install the versions the project pins,
    # with the CUDA or TPU build of jax when the runtime has an accelerator.
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", str(ROOT)])
    jax_pin = re.search(r'"jax==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    extra = "cuda12" if shutil.which("nvidia-smi") else "tpu" if list(pathlib.Path("/dev").glob("accel*")) else None
    if extra:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", f"jax[{extra}]=={jax_pin}"])
    importlib.invalidate_caches()
sys.path.insert(0, str(ROOT))  # this checkout's flsmem (flsmem.models, .harness, .train come with the install)
try:
    import flsmem
except ImportError as error:
    raise RuntimeError(
        f"flsmem's dependencies are missing from this kernel's Python ({sys.executable}): "
        f"install the repository into it with `pip install -e {ROOT}`, or pick the kernel "
        f"of the environment where you installed it."
    ) from error
import jax

# One size switch: "small" runs on a CPU in about a minute; "large" is meant for a GPU or
# TPU runtime. The environment variable FLSMEM_NOTEBOOK_SIZE overrides it (CI runs small).
SIZE = os.environ.get("FLSMEM_NOTEBOOK_SIZE", "small")  # "small" on CPU, "large" on GPU/TPU
assert SIZE in ("small", "large"), SIZE
print(f"flsmem {flsmem.__version__} from {ROOT}, jax {jax.__version__} on {jax.default_backend()}, SIZE = {SIZE!r}")
