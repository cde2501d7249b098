"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: protocol.py's bodies, serving.py's translation."""
