"""Files that make an export folder loadable by other tools (Optimum, transformers, tokenizers, transformers.js,
onnxruntime-genai), derived from the GPT2Config, onnx.names and the shipped BPE files (docs/interop.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..errors import UsageError
from ..fileio import write_atomic
from ..model.config import GPT2Config
from ..model.hf_format import config_to_hf
from ..tokenizer import EOT_ID, EOT_TOKEN, verified_bpe_file
from . import names as io
from .artifact import MODEL_FILE

HF_CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
GENAI_CONFIG_FILE = "genai_config.json"
INTEROP_FILES = (HF_CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE,
                 SPECIAL_TOKENS_FILE, GENAI_CONFIG_FILE)

# <|endoftext|> as the added token of GPT-2's tokenizer.json on the Hugging Face hub.
_EOT_ADDED = {"content": EOT_TOKEN, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": True, "special": True}


def hf_config(cfg: GPT2Config) -> dict:
    """A transformers `GPT2Config` config.json describing the exported graph (GPT2LMHeadModel)."""
    return config_to_hf(cfg) | {
        # What the graph computes, stated rather than left to transformers' defaults.
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "use_cache": True,  # Optimum feeds past_key_values.* only when the config says so
    }


def generation_config() -> dict:
    """transformers' generation_config.json for GPT-2 (Optimum reads it if present)."""
    return {"bos_token_id": EOT_ID, "eos_token_id": EOT_ID}


def tokenizer_json() -> dict:
    """GPT-2's tokenizer.json (Hugging Face tokenizers format) from the BPE files in the package."""
    vocab = json.loads(verified_bpe_file("encoder.json").read_text(encoding="utf-8"))
    lines = verified_bpe_file("vocab.bpe").read_text(encoding="utf-8").split("\n")
    merges = [line for line in lines[1:] if line]  # line 0 is "#version: 0.2"; "a b" = merge a and b
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": EOT_ID, **_EOT_ADDED}],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level | {"trim_offsets": False},
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def special_tokens_map() -> dict:
    return {"bos_token": EOT_TOKEN, "eos_token": EOT_TOKEN, "unk_token": EOT_TOKEN}


# The chat template a served model without its own falls back to, and the bundled model's export carries (docs/serving):
# a play's script, as the bundled model was trained on and GPT-2 has read: each turn its speaker's name in capitals
# and a colon on a line of its own, then its text and a blank line; the reply opens as ASSISTANT's.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}:\n{{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)


def check_chat_template(text: str, origin: str) -> None:
    """One UsageError line where `text` is not a Jinja2 template (compiled as chat templates are served: sandboxed)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(text)
    except TemplateSyntaxError as e:
        raise UsageError(f"{origin} is not a Jinja2 template: {e.message} (line {e.lineno})", option="chat-template") from None


def chat_template_of(folder: Path):
    """The chat_template an export folder's tokenizer_config.json records (a string, or transformers' list of named
    templates), or None."""
    try:
        config = json.loads((Path(folder) / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("chat_template") if isinstance(config, dict) else None


def tokenizer_config(cfg: GPT2Config, chat_template=None) -> dict:
    """tokenizer_config.json: GPT-2's fast tokenizer, no prefix space, no clean-up of spaces on decode; with
    `chat_template`, the Jinja2 template transformers' apply_chat_template and vLLM read."""
    return {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,  # decode must give back the text exactly
        "errors": "replace",
        "model_max_length": cfg.n_positions,
        "added_tokens_decoder": {str(EOT_ID): _EOT_ADDED},
        **special_tokens_map(),
        **({"chat_template": chat_template} if chat_template is not None else {}),
    }


def _pattern(name_of_layer: Callable[[int], str]) -> str:
    """onnx.names' per-layer name as onnxruntime-genai's printf pattern, e.g. 'present.%d.key'."""
    marker = 987654321
    pattern = name_of_layer(marker).replace(str(marker), "%d")
    if pattern.count("%d") != 1 or any(pattern % i != name_of_layer(i) for i in (0, 7, 12)):
        raise ValueError(f"cannot turn {name_of_layer(marker)!r} into a per-layer pattern")
    return pattern


def genai_config(cfg: GPT2Config, filename: str | None = None, provider: str | None = None,
                 share_buffer: bool = False) -> dict:
    """genai_config.json: the generic "decoder" type (genai's "gpt2" wants a combined past_%d cache). `share_buffer`
    only for GroupQueryAttention graphs, which update one buffer in place (docs/interop.md)."""
    filename = filename or MODEL_FILE
    return {
        "model": {
            "type": "decoder",
            "bos_token_id": EOT_ID,
            "eos_token_id": EOT_ID,
            "pad_token_id": EOT_ID,
            "vocab_size": cfg.vocab_size,
            "context_length": cfg.n_positions,
            "decoder": {
                "filename": filename,
                "session_options": {"log_id": "onnxruntime-genai",
                                    "provider_options": [{provider: {}}] if provider else []},
                "hidden_size": cfg.n_embd,
                "head_size": cfg.head_dim,
                "num_attention_heads": cfg.n_head,
                "num_key_value_heads": cfg.n_head,
                "num_hidden_layers": cfg.n_layer,
                "inputs": {
                    "input_ids": io.INPUT_IDS,
                    "attention_mask": io.ATTENTION_MASK,
                    "position_ids": io.POSITION_IDS,
                    "past_key_names": _pattern(io.past_key),
                    "past_value_names": _pattern(io.past_value),
                },
                "outputs": {
                    "logits": io.LOGITS,
                    "present_key_names": _pattern(io.present_key),
                    "present_value_names": _pattern(io.present_value),
                },
            },
        },
        "search": {
            "do_sample": False,
            "num_beams": 1,
            "num_return_sequences": 1,
            "max_length": cfg.n_positions,
            "min_length": 0,
            "past_present_share_buffer": share_buffer,
            "repetition_penalty": 1.0,
            "length_penalty": 1.0,
            "diversity_penalty": 0.0,
            "no_repeat_ngram_size": 0,
            "early_stopping": True,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }


def write_interop_files(folder: Path, cfg: GPT2Config, genai_provider: str | None = None,
                        share_buffer: bool = False, chat_template: str | None = None) -> list[str]:
    """Write every interop file into `folder`, each atomically (tokenizer_config.json with `chat_template` where
    given); returns their names."""
    folder = Path(folder)
    contents = {
        HF_CONFIG_FILE: hf_config(cfg),
        GENERATION_CONFIG_FILE: generation_config(),
        TOKENIZER_FILE: tokenizer_json(),
        TOKENIZER_CONFIG_FILE: tokenizer_config(cfg, chat_template),
        SPECIAL_TOKENS_FILE: special_tokens_map(),
        GENAI_CONFIG_FILE: genai_config(cfg, provider=genai_provider, share_buffer=share_buffer),
    }
    for name, data in contents.items():
        write_atomic(folder / name, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return list(contents)
