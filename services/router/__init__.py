"""The router: kvrs's front door (Generate: prefill, placement, transfer, decode, recovery)."""
