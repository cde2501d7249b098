"""The enumerated choices of the command line and the library, and the progress callback type (no heavy imports)."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

# Progress messages from long library calls (the CLI shows them on stderr).
Progress = Callable[[str], None]


def no_progress(message: str) -> None:
    """The default Progress: says nothing."""


class BackendKind(str, Enum):
    torch = "torch"  # gpt2x's PyTorch model, the reference
    ort = "ort"  # ONNX Runtime on the export
    openvino = "openvino"  # OpenVINO's runtime on the export's model.onnx
    genai = "genai"  # onnxruntime-genai's generator on the export folder
    web = "web"  # onnxruntime-web (WebAssembly) on the export, in headless Chromium


class ProviderKind(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class KvCache(str, Enum):
    """ONNX Runtime's KV cache form (`ort` backend): auto (`serve`: the slots for fp32, int8 and int4 exports on the
    CPU, runtime.static_decode.slots_by_default; else in place wherever it can be on the CPU: int8 and int4 graphs, an fp32
    export's through its GroupQueryAttention twin; growing on CUDA, where `generate` decodes on the fixed cache
    wherever the generation allows), in-place (required: refused where it cannot be), growing (the
    export's own graph, each step's presents the next past), fixed (`generate`'s alone, required: one fixed-capacity
    cache, runtime.static_decode.StaticDecoder, its step a CUDA graph on CUDA), slots (the server's alone: a fixed
    slot per row, runtime.static_decode.SlotBackend, for fp32, int8 and int4 exports on the CPU). A server on the
    openvino backend takes auto (its paged slots for a bf16 or fp32 export with a prefill graph, runtime.openvino_paged,
    the backend a server with none asked takes for them: serve.replica.served_backend), slots (the paged slots) and
    in-place (its own cache)."""

    auto = "auto"
    in_place = "in-place"
    growing = "growing"
    fixed = "fixed"
    slots = "slots"

    @property
    def in_place_kv(self) -> bool | None:
        """OrtBackend's `in_place_kv` for it (fixed, slots: not an OrtBackend's step)."""
        return {KvCache.in_place: True, KvCache.growing: False}.get(self)

    def fixed_cache(self, provider: ProviderKind) -> bool | None:
        """generation.generate's `fixed_cache` for it: required (fixed), where it can be (auto on CUDA), or never."""
        if self is KvCache.fixed:
            return True
        return None if self is KvCache.auto and provider is ProviderKind.cuda else False


class Precision(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    int8 = "int8"
    int4 = "int4"
    # fp32 weights computed in bf16, as OpenVINO GenAI and vLLM's CPU build compute fp32 checkpoints (docs/export.md):
    # CPUs with AVX-512 BF16 or AMX only
    bf16 = "bf16"
