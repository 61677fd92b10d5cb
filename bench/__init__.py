"""Benchmarks of flsmem: every speed figure is a ratio measured in one run.

Each command prints a table, writes ``results/bench/<name>.json`` (figures, the
command that made them, the machine) and ``python -m bench.report`` assembles
``results/BENCHMARKS.md`` from those files. Run them from the repository root, for
example ``python -m bench.overhead --quick``.
"""
