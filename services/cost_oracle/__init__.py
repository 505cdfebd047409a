"""The cost oracle service: transfer and compute time predictions over gRPC."""
