"""Secure Aggregation (sans-I/O). Implemented in its own issue."""
