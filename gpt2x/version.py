"""gpt2x's version, defined once (the package's `__version__`, pyproject's dynamic version): a leaf module, so that
every layer may name it without importing the package's root."""

__version__ = "0.1.0"
