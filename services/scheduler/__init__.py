"""The recovery scheduler service: decode placement and recovery decisions over gRPC."""
