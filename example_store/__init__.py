"""example_store."""
