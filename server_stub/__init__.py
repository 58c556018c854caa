"""server_stub."""
