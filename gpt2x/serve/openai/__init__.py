"""The OpenAI/vLLM-compatible API over the core, one package per endpoint (completion/, chat_completion/,
responses/: each its protocol and its serving), what they share (protocol, sampling, pending, render, errors), a
replica's service, its metrics, and the routes, declared once. Imports no Ray."""
