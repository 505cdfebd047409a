"""Benchmarks: `python -m bench.<name>` measures one part of kvrs and prints a table."""
