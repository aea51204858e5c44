"""CLI subcommands: each module has ``register(subparsers, bench_subparsers)`` adding its parsers.

A parser's ``func(args) -> int`` runs the command. Errors meant for the user are raised as
:class:`kvforge.errors.UserError` and printed as one line by :func:`kvforge.cli.main`.
"""

COMMAND_MODULES = [
    "kvforge.commands.generate",
    "kvforge.commands.demo",
    "kvforge.commands.cache",
    "kvforge.commands.serve",
    "kvforge.commands.presses",
    "kvforge.commands.eval",
    "kvforge.commands.rag",
    "kvforge.commands.models",
]
