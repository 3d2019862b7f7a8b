"""Drop-in adapters for training tools."""
