"""How the ``flsmem`` commands report a bad argument, in one place.

A bad argument is one line on stderr, in argparse's form ``flsmem eval: error: --windows
must be an int >= 1, got 0``, and exit status 2, with no traceback. Each command checks
its arguments inside :func:`checking` before it loads a model or writes a file; the
checks raise ``ValueError`` (the :mod:`flsmem.validate` checks, or a message of their
own) whose message starts with the argument's name and says what is allowed.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator, NoReturn

__all__ = ["usage_error", "checking"]


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
