"""Dependencies by role: the base install (client and CLI) pulls no torch, and works
without it; each role's extra brings what its code imports; `dev` is every role."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
HEAVY = {"torch", "redis", "aiohttp", "prometheus-client", "matplotlib"}


def _name(requirement: str) -> str:
    return Requirement(requirement).name.lower().replace("_", "-")


def _closure(requirements: list[str]) -> set[str]:
    """Every distribution the requirements pull, transitively, as installed here (extras
    of the dependencies themselves left out, as pip leaves them out)."""
    seen: set[str] = set()
    pending = [Requirement(text) for text in requirements]
    while pending:
        requirement = pending.pop()
        name = requirement.name.lower().replace("_", "-")
        if name in seen or (requirement.marker and not requirement.marker.evaluate()):
            continue
        seen.add(name)
        for text in importlib.metadata.requires(name) or []:
            nested = Requirement(text)
            if nested.marker is None or nested.marker.evaluate({"extra": ""}):
                pending.append(nested)
    return seen


def test_the_base_install_pulls_no_torch_redis_or_http_server():
    assert _closure(PROJECT["dependencies"]) & HEAVY == set()


def test_each_role_brings_its_libraries_and_dev_brings_every_role():
    extras = PROJECT["optional-dependencies"]
    assert {"redis", "aiohttp", "prometheus-client"} <= {_name(r) for r in extras["services"]}
    assert {"torch", "kvrs"} <= {_name(r) for r in extras["worker"]}
    assert "matplotlib" in {_name(r) for r in extras["sim"]}
    dev = [Requirement(r) for r in extras["dev"]]
    assert any(r.name == "kvrs" and {"services", "worker", "sim"} <= r.extras for r in dev)


def test_the_cli_and_the_client_run_where_torch_redis_and_aiohttp_are_missing():
    # None in sys.modules makes `import torch` raise ImportError, as on a base install.
    probe = (
        "import sys\n"
        "for name in ('torch', 'redis', 'aiohttp', 'matplotlib'):\n"
        "    sys.modules[name] = None\n"
        "import kvrs.client\n"
        "from kvrs.cli import COMMANDS, main\n"
        "for command in COMMANDS:\n"
        "    try:\n"
        "        main([command, '--help'])\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, (command, exc.code)\n"
        "sys.exit(main(['cost', '--model', 'opt-13b', '--prompt-tokens', '1477',\n"
        "               '--bandwidth-gbps', '25']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert '"action"' in result.stdout
