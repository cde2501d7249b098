"""ONNX input/output names and dynamic axes, defined once for export, runtime and tests: Optimum's,
onnxruntime-genai's and transformers.js's names for decoder-only models."""

from __future__ import annotations

MSFT = "com.microsoft"  # the domain of ONNX Runtime's contrib operators (MultiHeadAttention, ...)
GQA = "GroupQueryAttention"  # ONNX Runtime's attention with a shared cache buffer (the int8 and int4 exports')

INPUT_IDS = "input_ids"  # [batch, sequence] int64
ATTENTION_MASK = "attention_mask"  # [batch, past_sequence + sequence] int64, 1 = real token, 0 = padding
POSITION_IDS = "position_ids"  # [batch, sequence] int64
LOGITS = "logits"  # [batch, logits_sequence, vocab]: every position, or the last `logits_to_keep`
# Optional, default 0 (every position); k > 0: the last k only, so a prefill unembeds one row (docs/export.md).
LOGITS_TO_KEEP = "logits_to_keep"

BATCH = "batch_size"
SEQUENCE = "sequence_length"
PAST = "past_sequence_length"
TOTAL = "total_sequence_length"  # past_sequence_length + sequence_length
LOGITS_SEQUENCE = "logits_sequence_length"  # sequence_length, or min(logits_to_keep, sequence_length)

# The fixed-shape decode graph's own I/O (optimize.static_forms): GroupQueryAttention's two length inputs,
# onnxruntime-genai's names, and each row's greedy next token taken in the graph.
SEQLENS_K = "seqlens_k"  # [batch] int32: positions already in the cache (the new token's position)
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"  # [1] int32, on the host: the cache's capacity
NEXT_TOKEN = "next_token"  # [batch, 1] int64: the argmax of the logits, or the sampling form's draw
TEMPERATURE = "temperature"  # [batch] float64, the sampling form's: > 0 draws at that temperature, 0 takes the argmax
UNIFORM = "uniform"  # [batch] float64 in [0, 1): the sampling form's draw by inverse CDF (the host's seeded generator)
# The decode step with the host off its path (optimize.with_device_steps): a block of steps replayed back to back, each
# advancing the positions and writing its tokens where the next finds them, the host reading the block's tokens once.
# Each output is bound to its input's buffer: the step after reads what this one wrote.
STEPS = "steps"  # the dimension: the most steps of one block
STEP = "step"  # [1] int64: this step's index in the block (the host writes 0 before a block)
STEP_NEXT = "step_next"  # [1] int64: step + 1, written once the tokens are
SEQLENS_K_NEXT = "seqlens_k_next"  # [batch] int32: seqlens_k + 1, written after every read of seqlens_k
TOKENS = "tokens"  # [batch, steps] int64: each step's tokens at its index
TOKENS_NEXT = "tokens_next"  # [batch, steps] int64: tokens with this step's written in
UNIFORMS = "uniforms"  # [batch, steps] float64: the sampling form's uniform of each step of the block

# The mixed step's own I/O (optimize.mixed_form): every token of the step in one row [1, tokens], the decode rows' first
# (one each, on the decode group's cache: seqlens_k, total_sequence_length), then the chunk rows' (chunk_rows x
# chunk_length, on the chunk group's cache), and the positions whose logits come back.
CHUNK_SEQLENS_K = "chunk_seqlens_k"  # [chunk_rows] int32: each chunk row's past + chunk_length - 1
CHUNK_TOTAL = "chunk_total_sequence_length"  # [1] int32: the chunk group's cache capacity
KEEP = "keep"  # [kept] int64: the token positions (of input_ids' row) whose logits come back


def chunk_past_key(i: int) -> str:
    return f"chunk_past.{i}.key"  # [chunk_rows, n_head, capacity, head_dim]: the chunk rows' slots, bound in place


def chunk_past_value(i: int) -> str:
    return f"chunk_past.{i}.value"


def chunk_present_key(i: int) -> str:
    return f"chunk_present.{i}.key"


def chunk_present_value(i: int) -> str:
    return f"chunk_present.{i}.value"


def past_key(i: int) -> str:
    return f"past_key_values.{i}.key"  # [batch, n_head, past_sequence, head_dim]


def past_value(i: int) -> str:
    return f"past_key_values.{i}.value"


def present_key(i: int) -> str:
    return f"present.{i}.key"  # [batch, n_head, past_sequence + sequence, head_dim]


def present_value(i: int) -> str:
    return f"present.{i}.value"


def input_names(n_layer: int) -> list[str]:
    names = [INPUT_IDS, ATTENTION_MASK, POSITION_IDS]
    for i in range(n_layer):
        names += [past_key(i), past_value(i)]
    return names


def output_names(n_layer: int) -> list[str]:
    names = [LOGITS]
    for i in range(n_layer):
        names += [present_key(i), present_value(i)]
    return names


def dynamic_axes(n_layer: int) -> dict[str, dict[int, str]]:
    axes = {
        INPUT_IDS: {0: BATCH, 1: SEQUENCE},
        ATTENTION_MASK: {0: BATCH, 1: TOTAL},
        POSITION_IDS: {0: BATCH, 1: SEQUENCE},
        LOGITS: {0: BATCH, 1: LOGITS_SEQUENCE},
    }
    for i in range(n_layer):
        axes[past_key(i)] = axes[past_value(i)] = {0: BATCH, 2: PAST}
        axes[present_key(i)] = axes[present_value(i)] = {0: BATCH, 2: TOTAL}
    return axes


# gpt2x.json's flag for the in-place KV cache; exports before this release wrote "shared_kv_buffer": read either.
IN_PLACE_KV = "in_place_kv"
LEGACY_IN_PLACE_KV = "shared_kv_buffer"


def in_place_kv(attention: dict) -> bool:
    """Whether an export's attention layout (ExportInfo.attention) allows the in-place KV cache."""
    return bool(attention.get(IN_PLACE_KV, attention.get(LEGACY_IN_PLACE_KV, False)))
