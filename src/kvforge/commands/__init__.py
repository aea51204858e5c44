"""CLI subcommands: each module has ``register(subparsers, bench_subparsers)`` adding its parsers.

A parser's ``func(args) -> int`` runs the command. Errors meant for the user are raised as
:class:`kvforge.errors.UserError` and printed as one line by :func:`kvforge.cli.main`.
"""

from kvforge.commands import cache, demo, eval, generate, models, presses, rag, serve

COMMANDS = (generate, demo, cache, serve, presses, eval, rag, models)  # in --help's order
