"""The `soap` command line: a thin dispatcher over soap.commands.*.

Each command module defines `add_parser(subparsers)` and `run(args) -> int`. Any `SoapError` (bad
input) becomes one line `error: ...` on stderr and exit code 2; other exceptions too, unless `--debug`
asks for the traceback.

`process_main` is the process entry point (`python -m soap`, the `soap` script); tests call `main`.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
import unicodedata

from tracer.errors import SoapError

COMMANDS = ("trace", "plan", "compare", "simulate", "execute", "tune", "replan", "calibrate", "profiles", "validate", "export",
            "export-hf")


def error_line(message: str) -> str:
    """`error: MESSAGE` on one line whatever the message echoes: line breaks, other control characters
    (a path holding `\\n`, `\\r` or an ANSI escape) and lone surrogates are written as Python escapes."""
    def shown(ch: str) -> str:
        if ch != "\t" and unicodedata.category(ch) in ("Cc", "Zl", "Zp", "Cs"):
            return ch.encode("unicode_escape", "backslashreplace").decode("ascii")
        return ch

    return "error: " + "".join(map(shown, message))


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors in soap's one-line form."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(error_line(f"{message} (see `{self.prog} --help`)"), file=sys.stderr)
        raise SystemExit(2)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The full parser; given `argv`, only the named command's module is imported (some import torch,
    which costs seconds), and the others appear as bare entries for the usage line."""
    parser = _Parser(prog="soap", description=__doc__.splitlines()[0])
    parser.commands = {}
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    chosen = next((a for a in argv or () if not a.startswith("-")), None)
    for name in COMMANDS:
        if argv is not None and chosen in COMMANDS and name != chosen:
            sub.add_parser(name)
            continue
        try:
            module = importlib.import_module(f"soap.commands.{name.replace('-', '_')}")
        except ModuleNotFoundError as exc:
            if exc.name != f"soap.commands.{name.replace('-', '_')}":
                raise
            continue
        cmd = module.add_parser(sub)
        cmd.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
        cmd.set_defaults(_run=module.run)
        parser.commands[name] = cmd
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed; an argument the command does not take is reported by the command's parser, so the
    error points to `soap COMMAND --help`."""
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.commands.get(getattr(args, "command", None), parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = parse(argv)
        return int(args._run(args) or 0)
    except SoapError as exc:
        if debug:
            raise
        print(error_line(str(exc)), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI promises no traceback without --debug
        if debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(error_line(f"{type(exc).__name__}: {first} (rerun with --debug for the traceback)"), file=sys.stderr)
        return 2


FAST_EXIT_COMMANDS = frozenset({"plan", "compare"})
"""Commands that leave by `os._exit` when they succeed: once a plan is printed and written, the
interpreter's teardown (freeing every module and every object of the search, 0.2 to 0.7 s on a 2-core
machine) does nothing the user needs. Not for commands that run workers or hold process groups."""


def process_main() -> None:
    """`main` for a whole process: exit with its code. A successful fast-exit command first runs the
    `atexit` handlers (temporary-file finalizers among them) and flushes stdout and stderr, so nothing
    written is lost, then skips the teardown. Not under a profiler or tracer (cProfile, coverage): they
    write their results at exit."""
    code = main()
    watched = sys.getprofile() is not None or sys.gettrace() is not None
    if code == 0 and not watched and sys.argv[1:2] and sys.argv[1] in FAST_EXIT_COMMANDS:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(code)


if __name__ == "__main__":
    process_main()
