"""The model layer: GPT-2's config, the PyTorch model, Hugging Face checkpoints, LoRA adapters, anatomy, training.

Only `gpt2`, `weights`, `adapters` (with peft and transformers) and `train` import torch; `config`, `hf_format`,
`checkpoints` and `anatomy` do not, so the ONNX Runtime path can read configs and locate checkpoints without it."""
