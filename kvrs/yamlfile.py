"""Configuration files read as YAML, with numbers as YAML 1.2 and JSON write them.

PyYAML implements YAML 1.1, where a float needs a dot: `1e-05` (what Python's `json`
writes for 0.00001) and `400e9` load as strings, and a policy parameter or a link
rate given that way fails far from the file that gave it. Every kvrs YAML or JSON
file (simulator configurations, topologies) is read here, with exponent-only floats
resolved as numbers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

__all__ = ["load_yaml"]


class _Loader(yaml.SafeLoader):
    """The safe loader, reading `1e-05` as a float."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(path: str | Path) -> Any:
    """The document in the YAML (or JSON) file at `path`; None for an empty file."""
    return yaml.load(Path(path).read_text(), Loader=_Loader)
