"""How the ``flsmem`` commands report a bad argument, in one place.

A bad argument is one line on stderr, in argparse's form ``flsmem eval: error: --windows
must be an int >= 1, got 0``, and exit status 2, with no traceback. Each command checks
its arguments inside :func:`checking` before it loads a model or writes a file; the
checks raise ``ValueError`` (the :mod:`flsmem.validate` checks, or a message of their
own) whose message starts with the argument's name and says what is allowed.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Iterator, NoReturn

__all__ = ["ShowDefaults", "make_parser", "usage_error", "checking", "read_text"]

# A default longer than this (a whole catalogue of policies or tasks) is described in
# the option's own help instead.
_LONGEST_DEFAULT = 40


class ShowDefaults(argparse.HelpFormatter):
    """``--help`` that ends each option's line with its default, ``(default: 50)``.

    Left out: options whose help already gives its default ("(default: ..."), flags, and options
    with no default (None) or one too long to read at a glance."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "(default" in text or default is None or isinstance(default, bool)
                or default == argparse.SUPPRESS):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        if len(shown) > _LONGEST_DEFAULT:
            return text
        shown = (shown or repr(shown)).replace("%", "%%")  # argparse %-formats the help it is given
        return f"{text} (default: {shown})"


def make_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The parser of a command run as ``prog``: the first paragraph of its module's ``doc``
    as the description, and each option's default in ``--help`` (:class:`ShowDefaults`)."""
    return argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0], formatter_class=ShowDefaults)


def usage_error(command: str, message: str) -> NoReturn:
    """What ``argparse.ArgumentParser.error`` does, without the usage lines: print
    ``<command>: error: <message>`` to stderr and exit with status 2."""
    print(f"{command}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


@contextlib.contextmanager
def checking(command: str) -> Iterator[None]:
    """Within it, a ``ValueError`` is a bad argument of ``command``: :func:`usage_error`."""
    try:
        yield
    except ValueError as error:
        usage_error(command, str(error))


def read_text(argument: str, source: str) -> str:
    """The UTF-8 text of the file ``source`` (``-``: standard input), for ``argument``.

    Raises:
      ValueError: naming ``argument``: no such file, a folder, unreadable, not UTF-8
        text (a binary file), or empty.
    """
    name = "standard input" if source == "-" else source
    try:
        if source == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(source, "rb") as f:
                data = f.read()
    except FileNotFoundError:
        raise ValueError(f"{argument}: no such file: {source}") from None
    except IsADirectoryError:
        raise ValueError(f"{argument}: {source} is a folder, not a text file") from None
    except OSError as error:
        raise ValueError(f"{argument}: cannot read {name}: {error.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{argument}: {name} is not UTF-8 text (a binary file?)") from None
    if "\x00" in text:
        raise ValueError(f"{argument}: {name} is not UTF-8 text (it holds NUL bytes: a binary file?)")
    if not text.strip():
        raise ValueError(f"{argument}: {name} is empty")
    return text
