"""Weights off the broker: the broker announces versions, the bytes go from trainer rank 0 to
the generators through a shared-memory store (same host) or a bucketed stream (other hosts)."""
