"""`kvrs rpc SERVICE/METHOD '{json}'`: call any RPC of a running kvrs service, through the
server's own reflection, so no proto files and no grpcurl are needed.

    kvrs rpc kvrs.v1.GossipService/ListNodes '{"include_down": true}'
    kvrs rpc SchedulerService/SelectDecode @request.json --addr 127.0.0.1:50053
    kvrs rpc --list                      # services of the server (gossip's by default)
    kvrs rpc --list RouterService        # its methods with their message types

The request is protobuf JSON (field names as in the .proto or in lowerCamelCase; `@FILE`
reads it from a file, `-` from stdin); each response is printed as one JSON document with
the .proto's field names (one per line for a streaming RPC). A client-streaming RPC takes
a JSON array of requests. The address: `--addr`, else the service's variable
(GOSSIP_ADDR, SCHEDULER_ADDRS, ...) from the local cluster in `--dir` (what `kvrs up`
wrote) or from the environment. TLS comes from `KVRS_TLS_*` (the local cluster's client
certificate when it runs with `--tls`), as for every kvrs client.

Exit status: 0 on success, 1 when the call fails (the gRPC status and its details are
printed), 2 for bad input (unknown service or method, JSON that does not fit the request).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

_DEFAULT_PACKAGE = "kvrs.v1"
# service name -> the variable holding its address in a cluster's client environment
_ADDRESS_ENV = {
    "kvrs.v1.GossipService": "GOSSIP_ADDR",
    "kvrs.v1.SlotBrokerService": "SLOT_BROKER_ADDR",
    "kvrs.v1.CostOracleService": "COST_ORACLE_ADDR",
    "kvrs.v1.ProberService": "PROBER_ADDR",
    "kvrs.v1.RouterService": "ROUTER_ADDR",
    "kvrs.v1.SchedulerService": "SCHEDULER_ADDRS",
}


class UsageError(Exception):
    """Input the command cannot act on; the message names what is wrong."""


def register(parser: argparse.ArgumentParser) -> None:
    from kvrs.cli.launcher import DEFAULT_RUN_DIR

    parser.description = __doc__.split("\n\n")[0]
    parser.epilog = "\n\n".join(__doc__.split("\n\n")[1:])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "method",
        nargs="?",
        metavar="SERVICE/METHOD",
        help="full method name, e.g. kvrs.v1.GossipService/ListNodes (the kvrs.v1. package "
        "may be left out); with --list: a service whose methods to list",
    )
    parser.add_argument(
        "request",
        nargs="?",
        default="{}",
        metavar="JSON",
        help="the request as protobuf JSON, @FILE or - for stdin (default {})",
    )
    parser.add_argument("--addr", default="", help="host:port of the server to call")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(DEFAULT_RUN_DIR),
        help=f"the local cluster whose addresses and TLS to use (default {DEFAULT_RUN_DIR})",
    )
    parser.add_argument(
        "-H",
        "--header",
        action="append",
        default=[],
        metavar="NAME: VALUE",
        help="request metadata, repeatable",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=10.0, help="deadline of the call (default 10)"
    )
    parser.add_argument(
        "--list", action="store_true", help="list the server's services, or a service's methods"
    )


def run(args: argparse.Namespace) -> int:
    import grpc

    try:
        env = _client_env(args.dir)
        if args.list:
            service = _service_name(args.method) if args.method else ""
            address = args.addr or _address(service or "kvrs.v1.GossipService", env)
            with _channel(address, env) as channel:
                for line in _listing(channel, service):
                    print(line)
            return 0
        if not args.method or "/" not in args.method:
            raise UsageError("SERVICE/METHOD is required, e.g. kvrs.v1.GossipService/ListNodes")
        service_part, method_name = args.method.rsplit("/", 1)
        service = _service_name(service_part)
        address = args.addr or _address(service, env)
        with _channel(address, env) as channel:
            for response in _call(channel, service, method_name, args):
                print(response, flush=True)
    except UsageError as exc:
        print(f"kvrs rpc: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"kvrs rpc: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


def _client_env(run_dir: Path) -> dict[str, str]:
    """The environment, with a local cluster's addresses and client TLS laid over it."""
    from kvrs.cli.launcher import ClusterError, ClusterState

    env = dict(os.environ)
    try:
        env.update(ClusterState.load(run_dir).client_env())
    except ClusterError:
        pass  # no local cluster: the environment and --addr say where to go
    return env


def _service_name(name: str) -> str:
    return name if "." in name else f"{_DEFAULT_PACKAGE}.{name}"


def _address(service: str, env: Mapping[str, str]) -> str:
    variable = _ADDRESS_ENV.get(service)
    address = env.get(variable, "").split(",")[0].strip() if variable else ""
    if not address:
        where = f"{variable} is not set and " if variable else ""
        raise UsageError(f"--addr is required: {where}no local cluster names {service}'s address")
    return address


def _channel(address: str, env: Mapping[str, str]):
    import grpc

    from kvrs.rpc import ConfigError, GrpcSettings, channel_credentials

    try:
        settings = GrpcSettings.from_env(env)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    credentials = channel_credentials(settings)
    options = settings.channel_options()
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def _pool(channel: Any):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    database = ProtoReflectionDescriptorDatabase(channel)
    return database, DescriptorPool(database)


def _find_service(pool: Any, service: str):
    try:
        return pool.FindServiceByName(service)
    except KeyError:
        raise UsageError(f"the server has no service {service!r} (see kvrs rpc --list)") from None


def _listing(channel: Any, service: str) -> Iterator[str]:
    database, pool = _pool(channel)
    if not service:
        yield from sorted(database.get_services())
        return
    for method in _find_service(pool, service).methods:
        request = f"stream {method.input_type.full_name}" if method.client_streaming else ""
        response = f"stream {method.output_type.full_name}" if method.server_streaming else ""
        yield (
            f"{service}/{method.name}({request or method.input_type.full_name}) returns "
            f"({response or method.output_type.full_name})"
        )


def _call(channel: Any, service: str, method_name: str, args: argparse.Namespace) -> Iterator[str]:
    from google.protobuf import json_format
    from google.protobuf.message_factory import GetMessageClass

    _, pool = _pool(channel)
    descriptor = _find_service(pool, service).methods_by_name.get(method_name)
    if descriptor is None:
        raise UsageError(f"{service} has no method {method_name!r} (see kvrs rpc --list {service})")
    request_class = GetMessageClass(descriptor.input_type)
    response_class = GetMessageClass(descriptor.output_type)
    requests = _requests(_read_json(args.request), request_class, descriptor.client_streaming)
    path = f"/{service}/{method_name}"
    kinds = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }
    callable_ = kinds[(descriptor.client_streaming, descriptor.server_streaming)](
        path,
        request_serializer=lambda message: message.SerializeToString(),
        response_deserializer=response_class.FromString,
    )
    argument = iter(requests) if descriptor.client_streaming else requests[0]
    result = callable_(argument, timeout=args.timeout_s, metadata=_metadata(args.header))
    responses = result if descriptor.server_streaming else [result]
    for response in responses:
        yield json.dumps(
            json_format.MessageToDict(response, preserving_proto_field_name=True), indent=2
        )


def _read_json(source: str) -> Any:
    if source == "-":
        text = sys.stdin.read()
    elif source.startswith("@"):
        try:
            text = Path(source[1:]).read_text()
        except OSError as exc:
            raise UsageError(f"cannot read the request file: {exc}") from None
    else:
        text = source
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"the request is not JSON: {exc}") from None


def _requests(value: Any, request_class: Any, client_streaming: bool) -> list[Any]:
    from google.protobuf import json_format

    name = request_class.DESCRIPTOR.full_name
    if client_streaming and not isinstance(value, list):
        raise UsageError(f"a client-streaming method takes a JSON array of {name}")
    items = value if client_streaming else [value]
    try:
        return [json_format.ParseDict(item, request_class()) for item in items]
    except json_format.ParseError as exc:
        raise UsageError(f"the request does not fit {name}: {exc}") from None


def _metadata(headers: list[str]) -> list[tuple[str, str]]:
    metadata = []
    for header in headers:
        name, separator, value = header.partition(":")
        if not separator or not name.strip():
            raise UsageError(f"--header {header!r} is not NAME: VALUE")
        metadata.append((name.strip().lower(), value.strip()))
    return metadata
