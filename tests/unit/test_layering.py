"""Imports point down only: a forbidden import anywhere in the tree fails here.

    kvrs/ core          no grpc, protobuf stubs, redis, torch, aiohttp, services, nor the
                        edge packages above it (kvrs.rpc, kvrs.client, kvrs.cli)
    kvrs/rpc, client    no services, redis, torch, aiohttp
    services/common     no other service
    services/<name>     services.common and other services' `client` modules only

Every import statement counts, also those inside functions (lazy imports are imports
too). CONTRIBUTING.md gives the reasons.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

IO_LIBRARIES = ("grpc", "grpc_health", "grpc_reflection", "redis", "torch", "aiohttp")
CORE_FORBIDDEN = (*IO_LIBRARIES, "services", "kvrs.v1", "kvrs.rpc", "kvrs.client", "kvrs.cli")
EDGE_FORBIDDEN = ("services", "redis", "torch", "aiohttp")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module.count(".") < 2:
                # `from services.router import peers` names a module as an attribute.
                found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(f"{prefix}.") for prefix in prefixes)


def _layer(rel: str) -> str:
    if rel.startswith("kvrs/v1/"):
        return "generated"
    if rel.startswith("kvrs/cli/") or rel == "kvrs/__main__.py":
        return "cli"
    if rel.startswith("kvrs/rpc/") or rel == "kvrs/client.py":
        return "edge"
    if rel.startswith("kvrs/"):
        return "core"
    if rel.startswith("services/common/"):
        return "common"
    if rel.startswith("services/"):
        return "service"
    return "other"


def _violation(rel: str, module: str) -> str | None:
    layer = _layer(rel)
    if layer == "core" and _within(module, CORE_FORBIDDEN):
        return "the core imports no I/O library, generated code or edge package"
    if layer == "edge" and _within(module, EDGE_FORBIDDEN):
        return "kvrs.rpc and kvrs.client import no server code"
    parts = module.split(".")
    if parts[0] != "services" or len(parts) < 2:
        return None
    target = parts[1]
    if layer == "common" and target != "common":
        return "services.common imports no service"
    if layer == "service":
        own = rel.split("/")[1]
        if target in (own, "common"):
            return None
        if len(parts) >= 3 and parts[2] == "client":
            return None
        if len(parts) == 2:
            return None  # `from services import x` is checked through `services.x.<name>`
        return "a service imports only services.common and other services' client modules"
    return None


def _files() -> list[Path]:
    return sorted(
        path
        for top in ("kvrs", "services")
        for path in (ROOT / top).rglob("*.py")
        if _layer(path.relative_to(ROOT).as_posix()) != "generated"
    )


def violations() -> list[str]:
    found = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        for line, module in _imports(path):
            why = _violation(rel, module)
            if why is not None:
                found.append(f"{rel}:{line}: imports {module} ({why})")
    return found


def test_no_module_imports_across_its_layer():
    assert violations() == []


@pytest.mark.parametrize(
    ("rel", "module"),
    [
        ("kvrs/placement.py", "grpc"),
        ("kvrs/sim/engine.py", "torch.nn"),
        ("kvrs/recovery.py", "services.common"),
        ("kvrs/costmodel.py", "kvrs.client"),
        ("kvrs/rpc/channels.py", "services.common.telemetry"),
        ("kvrs/client.py", "redis.asyncio"),
        ("services/common/gossip_view.py", "services.gossip.client"),
        ("services/prober/probing.py", "services.router.records"),
        ("services/router/servicer.py", "services.scheduler.convert"),
    ],
)
def test_each_rule_catches_a_forbidden_import(rel, module):
    assert _violation(rel, module) is not None


@pytest.mark.parametrize(
    ("rel", "module"),
    [
        ("kvrs/placement.py", "numpy"),
        ("kvrs/client.py", "grpc"),
        ("kvrs/cli/demo.py", "services.gossip.client"),
        ("services/router/peers.py", "services.common.core_pb"),
        ("services/prober/server.py", "services.worker.client"),
        ("services/router/flow.py", "services.router.records"),
    ],
)
def test_allowed_imports_pass(rel, module):
    assert _violation(rel, module) is None


def test_the_scan_sees_lazy_imports_inside_functions(tmp_path):
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    import torch\n    from services.router import peers\n")
    assert [module for _, module in _imports(source)] == [
        "torch",
        "services.router",
        "services.router.peers",
    ]


def test_the_client_imports_only_kvrs_grpc_protobuf_and_the_standard_library():
    tree = ast.parse((ROOT / "kvrs" / "client.py").read_text())
    # Imports for annotations only (under `if TYPE_CHECKING:`) are not loaded.
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    allowed = {"kvrs", "grpc", "google", "__future__", *sys.stdlib_module_names}
    loaded = {
        name.split(".")[0]
        for node in ast.walk(tree)
        if id(node) not in typing_only
        for name in (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            else []
        )
    }
    assert loaded <= allowed, sorted(loaded - allowed)
