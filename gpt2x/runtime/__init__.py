"""The runtime layer: the Backend protocol (base), ONNX Runtime sessions and providers, the ONNX Runtime
backend (ort, no torch) and the PyTorch reference backend (pytorch)."""
