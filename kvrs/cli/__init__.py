"""The `kvrs` command line: one module per subcommand, imported only when it runs.

Each subcommand module defines `register(parser)` (adds its arguments) and
`run(args) -> int` (the exit status). Modules import heavy dependencies (torch, grpc)
inside `run`, so `kvrs cost` answers in milliseconds.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "cost": ("kvrs.cli.cost", "print every recovery option's cost as JSON"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrs", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text)
        command.set_defaults(_module=module_name)
        importlib.import_module(module_name).register(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return importlib.import_module(args._module).run(args)


if __name__ == "__main__":
    sys.exit(main())
