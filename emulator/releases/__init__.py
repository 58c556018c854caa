"""onnxruntime releases: an environment per release, worker processes that train on it, the measured support record, the kernel probe."""
