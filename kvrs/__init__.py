"""kvrs: network-aware decode placement and KV-cache recovery for disaggregated LLM inference."""

__version__ = "0.1.0"
