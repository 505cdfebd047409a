"""kvrs gRPC services: thin shells over the pure core in `kvrs`."""
