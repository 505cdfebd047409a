"""The `kvrs` command line: one module per subcommand, imported only when it runs.

Each subcommand module defines `register(parser)` (adds its arguments) and
`run(args) -> int` (the exit status). Only the chosen subcommand's module is imported,
so `kvrs cost` never loads torch or grpc and answers in milliseconds.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "cost": ("kvrs.cli.cost", "print every recovery option's cost as JSON"),
    "sim": ("kvrs.cli.sim", "run a simulator experiment"),
    "calibrate": ("kvrs.cli.calibrate", "measure a worker model's prefill/extend profile"),
    "up": ("kvrs.cli.cluster", "start a local cluster as processes"),
    "down": ("kvrs.cli.cluster", "stop the local cluster"),
    "status": ("kvrs.cli.cluster", "show instances, links and slots of a cluster"),
    "demo": ("kvrs.cli.demo", "run requests through a local cluster and kill a decode worker"),
    "rpc": ("kvrs.cli.rpc", "call any RPC of a running service through server reflection"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvrs", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {name: sub.add_parser(name, help=text) for name, (_, text) in COMMANDS.items()}
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    if chosen is not None:
        importlib.import_module(COMMANDS[chosen][0]).register(commands[chosen])
    args = parser.parse_args(argv)
    return importlib.import_module(COMMANDS[args.command][0]).run(args)


if __name__ == "__main__":
    sys.exit(main())
