"""POST /v1/completions: its request and response models (protocol.py) and its serving (serving.py)."""
