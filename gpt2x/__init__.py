"""gpt2x: GPT-2 from scratch in PyTorch, exported to ONNX with a KV cache, run on ONNX Runtime."""

__version__ = "0.1.0"
