"""The OpenAI/vLLM-compatible API over the core: the request and response schema, a request turned
into SamplingSettings, output rendering, errors, chat templates, a replica's service, its metrics, and
the routes, declared once. Imports no Ray."""
