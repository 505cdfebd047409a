"""Endpoint picker: Envoy ext_proc that routes gateway traffic to the decode instance kvrs picks."""
