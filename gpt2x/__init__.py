"""gpt2x: GPT-2 from scratch in PyTorch, exported to ONNX with a KV cache, run on ONNX Runtime."""

from .version import __version__

__all__ = ["__version__", "LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

# The offline API (gpt2x/serve/offline.py, docs/python.md), imported on first use: `import gpt2x` stays light.
_OFFLINE = ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput")


def __getattr__(name: str):
    if name in _OFFLINE:
        from .serve import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'gpt2x' has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*globals(), *_OFFLINE]
