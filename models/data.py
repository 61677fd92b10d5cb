"""The bundled Jane Austen texts, a byte tokenizer, and the windows cut from them.

The six novels ship in ``data/austen/`` (see ``data/PROVENANCE.md``) and are split by
whole book, so held-out character names are new to the model:

* train: Sense and Sensibility, Pride and Prejudice, Mansfield Park, Emma;
* validation: Northanger Abbey;
* test: Persuasion.

Training draws :func:`random_windows`; every evaluation reads :func:`cut_windows`, whose
windows sit at fixed places and do not overlap, so a loss over them is deterministic.
"""

from __future__ import annotations

import hashlib
import re
from importlib import resources
from pathlib import Path

import numpy as np

from flsmem.validate import one_of, positive_int

__all__ = [
    "DATA_DIR",
    "AUSTEN_DIR",
    "PROVENANCE",
    "SPLITS",
    "BOOK_SEPARATOR",
    "books",
    "load_book",
    "load_split",
    "expected_checksums",
    "verify_checksums",
    "ByteTokenizer",
    "SPACINGS",
    "random_windows",
    "cut_windows",
]

# Package data: the same in a clone and in an installed wheel.
DATA_DIR = Path(str(resources.files("flsmem.data")))
AUSTEN_DIR = DATA_DIR / "austen"
PROVENANCE = DATA_DIR / "PROVENANCE.md"

SPLITS: dict[str, tuple[str, ...]] = {
    "train": ("sensesensibility", "prideprejudice", "mansfieldpark", "emma"),
    "validation": ("northangerabbey",),
    "test": ("persuasion",),
}

# A blank line between books: the texts are paragraphs separated by blank lines, so a
# window that spans two books sees an ordinary paragraph break.
BOOK_SEPARATOR = "\n\n"

# Where :func:`cut_windows` starts its windows.
SPACINGS = ("even", "spread", "packed")


def books() -> tuple[str, ...]:
    """Names of all bundled books, in split order (train, validation, test)."""
    return tuple(name for names in SPLITS.values() for name in names)


def load_book(name: str) -> str:
    """The text of one book.

    Args:
      name: a book's name, e.g. ``"persuasion"`` (the file stem in ``data/austen/``).

    Returns:
      The whole book as a string.

    Raises:
      ValueError: ``name`` is not a bundled book.
      FileNotFoundError: the book is known but its file is missing from the checkout.
    """
    if name not in books():
        raise ValueError(f"unknown book {name!r}; known books: {', '.join(sorted(books()))}")
    path = AUSTEN_DIR / f"{name}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"book {name!r} is missing: expected {path.relative_to(DATA_DIR.parent)}")
    return path.read_text(encoding="utf-8")


def load_split(split: str) -> str:
    """The books of one split, joined by :data:`BOOK_SEPARATOR`.

    Args:
      split: ``"train"``, ``"validation"`` or ``"test"``.

    Raises:
      ValueError: ``split`` is not one of :data:`SPLITS`.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known splits: {', '.join(SPLITS)}")
    return BOOK_SEPARATOR.join(load_book(name) for name in SPLITS[split])


def expected_checksums() -> dict[str, str]:
    """SHA-256 of each bundled file, parsed from ``data/PROVENANCE.md``.

    PROVENANCE.md is the one source of truth, so it is parsed rather than copied here.

    Returns:
      ``{"emma.txt": "7c67...", ...}``.
    """
    text = PROVENANCE.read_text(encoding="utf-8")
    found = dict((m.group(2), m.group(1)) for m in re.finditer(r"^\s+([0-9a-f]{64})\s+(\S+)\s*$", text, re.M))
    if not found:
        raise ValueError(f"no SHA-256 lines found in {PROVENANCE.name}")
    return found


def verify_checksums() -> dict[str, str]:
    """Check every bundled book against ``data/PROVENANCE.md``.

    Returns:
      The verified ``{file name: sha256}``.

    Raises:
      ValueError: a file's hash differs, or a book has no listed hash.
      FileNotFoundError: a listed file is missing.
    """
    expected = expected_checksums()
    missing = [f"{name}.txt" for name in books() if f"{name}.txt" not in expected]
    if missing:
        raise ValueError(f"{PROVENANCE.name} lists no SHA-256 for {', '.join(missing)}")
    bad = []
    for filename, digest in expected.items():
        actual = hashlib.sha256((AUSTEN_DIR / filename).read_bytes()).hexdigest()
        if actual != digest:
            bad.append(f"{filename}: expected {digest}, got {actual}")
    if bad:
        raise ValueError("checksum mismatch: " + "; ".join(bad))
    return expected


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255, no special tokens.

    The books are ASCII but for one "£" in Mansfield Park, so a byte is nearly always a
    character.

    Attributes:
      vocab_size: 256.
      eos_id: None (byte-level text has no end token).
      bos_id: None.
      add_bos: False (sequences start with their first byte).
    """

    vocab_size = 256
    eos_id = None
    bos_id = None
    add_bos = False

    def encode(self, text: str) -> np.ndarray:
        """``text`` as a 1-D int32 array of its UTF-8 bytes."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        """Bytes back to text; invalid UTF-8 becomes U+FFFD rather than an error.

        Args:
          ids: a 1-D sequence or array of ints in ``[0, 256)``.
        """
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise ValueError(f"ids must be 1-D, got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"ids must lie in [0, {self.vocab_size}), got range [{ids.min()}, {ids.max()}]")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _check_tokens(tokens: np.ndarray, need: int, why: str) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    if tokens.size < need:
        raise ValueError(f"tokens has {tokens.size} entries, fewer than the {need} that {why}")
    return tokens


def random_windows(tokens: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """``batch`` windows of ``length + 1`` tokens at uniformly random offsets.

    The extra token makes inputs ``w[:, :-1]`` and next-token targets ``w[:, 1:]``.

    Args:
      tokens: 1-D token ids.
      batch: windows to draw (B).
      length: input length T.
      rng: source of the offsets; its state advances, so a saved state resumes exactly.

    Returns:
      int32 array ``[B, T + 1]``.
    """
    if batch < 1 or length < 1:
        raise ValueError(f"batch and length must be >= 1, got batch={batch}, length={length}")
    tokens = _check_tokens(tokens, length + 1, f"one window of {length + 1} tokens needs (length={length})")
    starts = rng.integers(0, tokens.size - length, size=batch)  # last start: size - length - 1
    return tokens[starts[:, None] + np.arange(length + 1)[None, :]].astype(np.int32)


def cut_windows(tokens: np.ndarray, length: int, count: int | None = None, *, spacing: str = "even",
                exact: bool = False) -> np.ndarray:
    """Non-overlapping windows of ``length + 1`` tokens at fixed places in the text.

    Deterministic, so every evaluation of the same text scores the same tokens. The
    extra token makes inputs ``w[:, :-1]`` and next-token targets ``w[:, 1:]``; a
    window for a plain forward pass over ``L`` tokens is ``length = L - 1``.

    Args:
      tokens: 1-D token ids.
      length: input length T.
      count: windows wanted; None takes every window that fits.
      spacing: where the windows start; the first always starts at token 0.
        ``"even"``: equal gaps of a whole number of tokens, so the last window may end
        a little before the text does (training's validation and test losses);
        ``"spread"``: gaps that differ by at most one token, so the last window ends
        at the text's last token (``flsmem eval`` and the regime map's prose);
        ``"packed"``: back to back, no gaps (perplexity over a text's first tokens).
      exact: fail when fewer than ``count`` windows fit, rather than take those that fit.

    Returns:
      int32 array ``[count, T + 1]`` (fewer rows when fewer fit and not ``exact``).

    Raises:
      ValueError: ``length`` or ``count`` is not a positive int, ``spacing`` is unknown,
        or ``tokens`` is too short: for one window, or with ``exact`` for ``count``;
        the message gives the tokens there are and the tokens needed.
    """
    positive_int("length", length)
    one_of("spacing", spacing, SPACINGS)
    span = length + 1
    if count is not None:
        positive_int("count", count)
    if exact and count is not None:
        tokens = _check_tokens(tokens, count * span, f"count={count} windows of {span} tokens (length={length}) need")
    else:
        tokens = _check_tokens(tokens, span, f"one window of {span} tokens (length={length}) needs")
    fit = tokens.size // span
    count = fit if count is None else min(count, fit)
    starts = _starts(tokens.size, span, count, spacing)
    return tokens[starts[:, None] + np.arange(span)[None, :]].astype(np.int32)


def _starts(size: int, span: int, count: int, spacing: str) -> np.ndarray:
    """First token of each of ``count`` windows of ``span`` tokens in ``size`` tokens."""
    if spacing == "packed":
        return np.arange(count) * span
    if spacing == "spread":
        # np.linspace rounded down, not exact integer arithmetic: the two differ by a
        # token where float rounding falls just below a whole number, and the results
        # in results/ were cut with linspace.
        return np.linspace(0, size - span, count).astype(np.int64)
    # A whole-token stride of at least span: none overlap.
    stride = (size - span) // (count - 1) if count > 1 else 0
    return np.arange(count) * stride
