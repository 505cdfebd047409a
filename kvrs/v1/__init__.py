"""Generated protobuf and gRPC code for kvrs.v1 (regenerate with `make protos`; never edit)."""
