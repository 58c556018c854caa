"""Emulated devices on real time: conditions, attested keys, the SDK over HTTP or in process, and the real-time fleet."""
