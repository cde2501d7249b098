"""POST /v1/chat/completions: its models (protocol.py), the chat template (template.py) and its serving (serving.py),
which renders the prompt and serves it as completion/serving.py serves a completions request."""
