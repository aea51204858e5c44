"""The ``kvforge`` command line: ``main(argv) -> int``; subcommands live in :mod:`kvforge.commands`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from kvforge import __version__
from kvforge.commands import COMMANDS
from kvforge.commands._common import check_names, preflight
from kvforge.errors import UserError
from kvforge.redact import RedactFilter, redact_text


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``kvforge generate: error: argument --compression-ratio: must be in [0, 1),
    got 1.2 (see kvforge generate --help)`` instead of the whole usage block above the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvforge", description="Compress, store and reuse LLM KV caches.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    parser.add_argument("--version", action="version", version=f"kvforge {__version__}")
    parser.add_argument("--config", default=None, help=f"TOML file of option defaults (default: ${CONFIG_ENV}); "
                        "top-level keys apply to every command that has the option, [generate], [bench.decode]... "
                        "tables to one command; KVFORGE_<OPTION> variables override it, the command line overrides "
                        "both")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="speed benchmarks (one JSON line per configuration)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for command in COMMANDS:
        command.register(sub, bench_sub)
    for _, command in _commands(parser):
        command.formatter_class = _DefaultsFormatter  # defaults shown in --help
        for action in command._actions:
            if action.help is None and action.option_strings:  # argparse prints no default for an option without help
                action.help = "" if action.default in (None, False, []) else "(default: %(default)s)"
    return parser


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except secrets (API keys, store URLs that may hold a password) and empty ones."""

    SECRET = frozenset({"api_key", "upstream_api_key", "store"})

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").strip()
        if action.dest in self.SECRET or action.default in (None, False, [], argparse.SUPPRESS) or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)".strip()


CONFIG_ENV = "KVFORGE_CONFIG"
ENV_PREFIX = "KVFORGE_"
_NOT_SETTINGS = {"help", "version", "config", "command", "bench_command", "cache_command", "models_command", "func"}


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every (sub)command parser with its path, e.g. (("generate",), p), (("bench", "reuse"), p)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.append(((*path, name), child))
                found.extend(_commands(child, (*path, name)))
    return found


def _config_path(argv: list[str], environ: Any) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return environ.get(CONFIG_ENV) or None


def _read_config(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    import tomllib

    try:
        return tomllib.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"cannot read config file {path}: {e}") from e


def _setting(action: argparse.Action, value: Any, source: str) -> Any:
    """``value`` (a string from the environment, or a TOML value) converted and checked like a command-line value."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if isinstance(value, str):
            if value.lower() not in {"1", "0", "true", "false", "yes", "no", "on", "off", ""}:
                raise UserError(f"{source}: expected true or false, got {value!r}")
            value = value.lower() in {"1", "true", "yes", "on"}
        return bool(value) if isinstance(action, argparse._StoreTrueAction) else not bool(value)
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_setting_one(action, v, source) for v in items]
    return _setting_one(action, value, source)


def _setting_one(action: argparse.Action, value: Any, source: str) -> Any:
    if not isinstance(value, str | int | float) or isinstance(value, bool):  # a table, list, date or boolean
        raise UserError(f"{source}: expected {_expected(action)}, got {redact_text(repr(value))} ({_toml_kind(value)})")
    if action.type is None and not isinstance(value, str):  # options read as text (URLs, names, paths)
        raise UserError(
            f"{source}: expected {_expected(action)}, got {redact_text(repr(value))} ({_toml_kind(value)}): quote it"
        )
    if action.type is not None and isinstance(value, str | int | float) and not isinstance(value, bool):
        try:
            value = action.type(str(value)) if isinstance(value, str) or action.type is not str else value
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            raise UserError(f"{source}: {e}") from None
    if action.choices is not None and value not in action.choices:
        from kvforge.errors import unknown_name

        raise unknown_name(source, str(value), [str(c) for c in action.choices])
    return value


def _expected(action: argparse.Action) -> str:
    kind = getattr(action.type, "__name__", None)
    names = {"int": "an integer", "float": "a number", "positive_int": "an integer >= 1",
             "ratio": "a fraction in [0, 1)", "non_negative_float": "a number >= 0",
             "temperature": "0 or a number >= 1e-5", None: "a string"}
    return names.get(kind, "a value")


def _toml_kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)


def _check_config_names(config: dict[str, Any], parser: argparse.ArgumentParser) -> None:
    """Every table of the config names a command and every key an option of it (top level: of any command), with a
    "did you mean" for typos: ``[generat]`` and ``[generate] max-new-token = 3`` are errors, never ignored."""
    import difflib

    commands = dict(_commands(parser))

    def options(command: Any) -> set[str]:
        return {a.dest.replace("_", "-") for a in command._actions if a.option_strings and a.dest not in _NOT_SETTINGS}

    every = set().union(*(options(c) for c in commands.values()))

    def refuse(what: str, name: str, where: str, choices: set[str]) -> UserError:
        close = difflib.get_close_matches(name, sorted(choices), n=2, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        listing = f" choose from: {', '.join(sorted(choices))}" if choices else " it has none"
        return UserError(f"unknown config {what} {name!r}{where}{hint}{listing}")

    def walk(table: dict[str, Any], path: tuple[str, ...]) -> None:
        known = options(commands[path]) if path else every
        tables = {p[len(path)] for p in commands if len(p) == len(path) + 1 and p[: len(path)] == path}
        where = f" in [{'.'.join(path)}]" if path else ""
        for key, value in table.items():
            if isinstance(value, dict):
                if key not in tables:
                    raise refuse("table", key, where, tables)
                walk(value, (*path, key))
            elif key.replace("_", "-") not in known:
                raise refuse("key", key, where, known)

    walk(config, ())


def apply_settings(parser: argparse.ArgumentParser, argv: list[str], environ: Any = None) -> None:
    """Make the config file and ``KVFORGE_<OPTION>`` variables the defaults of every command that takes the option."""
    environ = os.environ if environ is None else environ
    config = _read_config(_config_path(argv, environ))
    _check_config_names(config, parser)
    top = {k: v for k, v in config.items() if not isinstance(v, dict)}
    for path, command in _commands(parser):
        table: Any = config
        for part in path:
            table = table.get(part, {}) if isinstance(table, dict) else {}
        own = {k: v for k, v in table.items() if not isinstance(v, dict)} if isinstance(table, dict) else {}
        defaults = {}
        for action in command._actions:
            if not action.option_strings or action.dest in _NOT_SETTINGS:
                continue
            env_name = ENV_PREFIX + action.dest.upper()
            key = action.dest.replace("_", "-")
            if environ.get(env_name, "") != "":  # an empty variable (VAR= kvforge ...) counts as unset
                defaults[action.dest] = _setting(action, environ[env_name], f"${env_name}")
            elif key in own or action.dest in own:
                defaults[action.dest] = _setting(action, own.get(key, own.get(action.dest)), f"config {key}")
            elif key in top or action.dest in top:
                defaults[action.dest] = _setting(action, top.get(key, top.get(action.dest)), f"config {key}")
        if defaults:
            command.set_defaults(**defaults)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (errors are one line on stderr, no traceback)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        apply_settings(parser, argv)
    except UserError as e:
        print(f"kvforge: error: {redact_text(str(e))}", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a one-line argument error (already printed)
        return e.code if isinstance(e.code, int) else 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactFilter())  # no secret in any log line, whoever logs it
    try:
        check_names(args)  # typos in press/task/model/... names fail here, before torch is imported
        preflight(args)  # an unreachable store or hub, also before torch
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"kvforge: error: {redact_text(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvforge: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvforge presses | head -1`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit must not fail again
        return 141


if __name__ == "__main__":
    sys.exit(main())
