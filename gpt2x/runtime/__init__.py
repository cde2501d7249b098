"""Runtimes: the Backend protocol and the backends that run an export (or, for the reference, the model)."""
