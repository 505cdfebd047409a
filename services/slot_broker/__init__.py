"""Slot broker: leases capping concurrent KV migrations cluster-wide and per link."""
