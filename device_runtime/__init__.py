"""device_runtime."""
