"""Gossip service: node registry, liveness, load, link samples and membership events."""
