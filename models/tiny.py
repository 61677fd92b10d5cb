"""The shipped byte-level ``TINY`` decoder trained on Austen: save and load its weights.

``checkpoints/tiny-austen/`` holds the parameters written by
``python -m flsmem.train.train_decoder --export checkpoints/tiny-austen`` (how it was trained and
its measured losses are in that folder's README.md)::

    checkpoints/tiny-austen/
      config.json   the DecoderConfig the weights belong to
      params/       orbax checkpoint of the model's nnx.Param state (float32)

Loading needs nothing beyond the repository: no network, no training run.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

from flax import nnx

from flsmem import checkpoint
from flsmem.models.data import ByteTokenizer
from flsmem.models.decoder import TINY, Decoder, DecoderConfig

__all__ = ["CHECKPOINT_DIR", "TASKS_CHECKPOINT_DIR", "save_params", "check_params", "load_params", "load_tiny"]

# Package data: the same in a clone and in an installed wheel.
CHECKPOINT_DIR = Path(str(resources.files("flsmem.checkpoints"))) / "tiny-austen"
# The same architecture fine-tuned on the controlled recall tasks of flsmem.models.tasks.
TASKS_CHECKPOINT_DIR = CHECKPOINT_DIR.parent / "tiny-tasks"

_PARAMS = "params"
_CONFIG = "config.json"


def save_params(model: Decoder, directory: str | Path) -> Path:
    """Write a model's parameters (only) where :func:`load_params` reads them.

    Replaces an earlier ``params/`` and ``config.json`` in ``directory``; other files
    there (a README) are left alone. ``params/`` is written atomically
    (:func:`flsmem.checkpoint.save_tree`).

    Args:
      model: the decoder to save.
      directory: folder to write ``config.json`` and ``params/`` into; created if needed.

    Returns:
      ``directory`` as an absolute path.
    """
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint.save_tree(directory / _PARAMS, nnx.state(model, nnx.Param), overwrite=True, what="parameters")
    (directory / _CONFIG).write_text(json.dumps(dataclasses.asdict(model.cfg), indent=2) + "\n")
    return directory


def check_params(directory: str | Path, cfg: DecoderConfig) -> Path:
    """``directory``, resolved, once it is known to hold parameters saved for ``cfg``
    (read from its record; the parameters themselves are not loaded).

    Raises:
      FileNotFoundError: ``directory`` holds no saved parameters.
      ValueError: they were saved for a different configuration.
    """
    directory = Path(directory).resolve()
    if not (directory / _PARAMS).is_dir():
        raise FileNotFoundError(
            f"no saved parameters in {directory} (expected a {_PARAMS}/ folder); "
            "train and export them with: python -m flsmem.train.train_decoder --export DIR"
        )
    config_path = directory / _CONFIG
    if config_path.is_file():
        # Checked before the restore: orbax's own shape-mismatch error does not say which config.
        saved = json.loads(config_path.read_text())
        if DecoderConfig.from_dict(saved) != cfg:
            raise ValueError(f"parameters in {directory} were saved for {saved}, not for {dataclasses.asdict(cfg)}")
    return directory


def load_params(directory: str | Path, cfg: DecoderConfig) -> Decoder:
    """A ``Decoder(cfg)`` with the parameters saved in ``directory``.

    The target structure comes from ``nnx.eval_shape``, so no throwaway random weights
    are built before the restore.

    Args:
      directory: a folder written by :func:`save_params`.
      cfg: the configuration the weights were trained with.

    Raises:
      FileNotFoundError, ValueError: see :func:`check_params`; ValueError also when they
        cannot be read.
    """
    directory = check_params(directory, cfg)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract, nnx.Param)
    params = checkpoint.restore_tree(directory / _PARAMS, abstract_params, what="parameters")
    return nnx.merge(graphdef, params)


def load_tiny(directory: str | Path | None = None) -> tuple[Decoder, ByteTokenizer]:
    """The shipped Austen-trained ``TINY`` decoder and its tokenizer.

    Args:
      directory: where the checkpoint lives; default :data:`CHECKPOINT_DIR`.

    Returns:
      ``(model, tokenizer)``.

    Raises:
      FileNotFoundError: the checkpoint is missing.
    """
    return load_params(CHECKPOINT_DIR if directory is None else directory, TINY), ByteTokenizer()
