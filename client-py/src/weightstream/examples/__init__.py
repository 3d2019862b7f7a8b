"""Runnable examples of weightstream (``python -m weightstream.examples.<name>``)."""
