"""The ``kuat`` command line: parses arguments and calls the library (nothing else).

Each subcommand lives in its own module ``kuat.cli.<name>`` with two functions:
``add_parser(subparsers)`` (registers its ``argparse`` parser, importing nothing heavy) and
``run(args) -> int`` (the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

_COMMANDS = ["demo", "convert", "inspect", "verify", "merge", "bench", "doctor"]


def build_parser() -> argparse.ArgumentParser:
    from kuat import __version__

    parser = argparse.ArgumentParser(
        prog="kuat", description="kuat: fast data loading for PyTorch training."
    )
    parser.add_argument("--version", action="version", version=f"kuat {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"kuat.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"kuat.cli.{name}":
                continue
            raise
        p = module.add_parser(sub)
        p.allow_abbrev = False  # --worker is a typo, not --workers
        p.set_defaults(_run=module.run, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported with the command's own usage, not the top level's
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    from kuat.errors import KuatError

    try:
        status = int(args._run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return status
    except BrokenPipeError:
        # `kuat inspect x | head`: the reader left early. Exit quietly as cat or ls do, and point
        # stdout at /dev/null so that the interpreter's own flush at exit cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KuatError as e:
        print(f"kuat {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.filename is None:
            raise  # no path named: not the user's file system, a traceback helps more
        # a path the command line or the environment named (a cache root in a read-only or
        # missing place, a file where a directory should be): say which, as cp or tar would
        logging.getLogger("kuat").debug("kuat %s failed", args.command, exc_info=True)
        print(f"kuat {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
