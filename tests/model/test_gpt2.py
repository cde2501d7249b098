"""Our GPT-2 against transformers' GPT2LMHeadModel (independent reference) and against itself
(cached vs uncached, batched vs per-row)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2LMHeadModel

from gpt2x.model.anatomy import total_params
from gpt2x.model.config import PRESETS, GPT2Config
from gpt2x.model.gpt2 import GPT2
from gpt2x.model.weights import load_model

from ..helpers import make_hf_model

EXPECTED_PARAMS = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "distilgpt2": 81_912_576,
}
ATOL = 1e-4


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_preset_parameter_counts(name):
    cfg = PRESETS[name][1]
    with torch.device("meta"):
        model = GPT2(cfg)
    assert model.num_parameters() == EXPECTED_PARAMS[name]
    assert total_params(cfg) == EXPECTED_PARAMS[name]  # the `inspect` arithmetic agrees


def padded_batch(gen: torch.Generator, lengths: list[int], vocab: int):
    """Left-padded ids and mask for rows of the given lengths."""
    width = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=gen)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1
        ids[i, : width - n] = 50256
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_full_forward_matches_transformers(tmp_path, safe):
    hf = make_hf_model(tmp_path, seed=1, safe=safe)
    ours, _ = load_model(str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    ids, mask, pos = padded_batch(gen, [17, 9, 13], 50257)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got, _ = ours(ids, mask, pos)
    real = mask.bool()  # padded slots have no meaning
    assert got.shape == ref.shape
    assert (got - ref)[real].abs().max().item() <= ATOL


def test_cached_decoding_matches_transformers_and_full_forward(tiny_hf):
    folder, hf = tiny_hf
    ours, _ = load_model(str(folder))
    gen = torch.Generator().manual_seed(1)
    ids, mask, pos = padded_batch(gen, [6, 11], 50257)
    extra = torch.randint(0, 50257, (2, 8), generator=gen)
    with torch.no_grad():
        logits, past = ours(ids, mask, pos)
        hf_out = hf(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        hf_past = hf_out.past_key_values
        for t in range(extra.shape[1]):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            step_pos = mask.sum(-1, keepdim=True) - 1
            logits, past = ours(extra[:, t : t + 1], mask, step_pos, past)
            hf_out = hf(input_ids=extra[:, t : t + 1], attention_mask=mask, position_ids=step_pos,
                        past_key_values=hf_past, use_cache=True)
            hf_past = hf_out.past_key_values
            assert (logits - hf_out.logits).abs().max().item() <= ATOL
        # The whole sequence at once, without a cache, ends at the same logits.
        full_ids = torch.cat([ids, extra], 1)
        full, _ = ours(full_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
        assert (full[:, -1] - logits[:, -1]).abs().max().item() <= ATOL
        assert past[0][0].shape == (2, 4, full_ids.shape[1], 8)


@pytest.mark.parametrize("keep", [1, 3, 40])
def test_logits_to_keep_runs_the_last_block_at_those_positions_and_matches_transformers(tiny_hf, keep):
    """A left-padded batch's chunk on a past, its last `keep` positions' logits (the last block then runs its
    attention output and MLP there only; more than the chunk keeps all of it) against transformers' logits at those
    positions, and every layer's key and value at every position against its cache."""
    folder, hf = tiny_hf
    ours, _ = load_model(str(folder))
    gen = torch.Generator().manual_seed(4)
    ids, mask, pos = padded_batch(gen, [9, 20], 50257)
    with torch.no_grad():
        _, past = ours(ids[:, :12], mask[:, :12], pos[:, :12])
        logits, presents = ours(ids[:, 12:], mask, pos[:, 12:], past, logits_to_keep=keep)
        hf_past = hf(input_ids=ids[:, :12], attention_mask=mask[:, :12], position_ids=pos[:, :12],
                     use_cache=True).past_key_values
        want = hf(input_ids=ids[:, 12:], attention_mask=mask, position_ids=pos[:, 12:], past_key_values=hf_past,
                  use_cache=True)
    assert logits.shape == (2, min(keep, 8), 50257)
    assert (logits - want.logits[:, -keep:]).abs().max().item() <= ATOL
    real = mask.bool()  # (B, P+T): padding's key and value are never read
    for layer, (k, v) in enumerate(presents):
        hf_k, hf_v = want.past_key_values.layers[layer].keys, want.past_key_values.layers[layer].values
        assert k.shape == (2, 4, 20, 8)
        for ours_kv, hf_kv in ((k, hf_k), (v, hf_v)):  # (B, H, P+T, D) -> (real positions, H, D)
            assert (ours_kv.transpose(1, 2)[real] - hf_kv.transpose(1, 2)[real]).abs().max().item() <= ATOL


def test_left_padded_batch_equals_per_row_runs(tiny_hf):
    ours, _ = load_model(str(tiny_hf[0]))
    gen = torch.Generator().manual_seed(2)
    lengths = [3, 12, 7, 1]
    ids, mask, pos = padded_batch(gen, lengths, 50257)
    with torch.no_grad():
        batched, _ = ours(ids, mask, pos)
        for i, n in enumerate(lengths):
            alone, _ = ours(ids[i : i + 1, -n:])  # no mask, default positions
            assert (batched[i, -n:] - alone[0]).abs().max().item() <= ATOL


def test_empty_past_is_the_first_step(tiny_hf):
    """past_len = 0 tensors (as the ONNX graph gets on its first step) change nothing."""
    ours, _ = load_model(str(tiny_hf[0]))
    ids = torch.randint(0, 50257, (2, 5), generator=torch.Generator().manual_seed(3))
    cfg = ours.config
    empty = [(torch.zeros(2, cfg.n_head, 0, cfg.head_dim),) * 2 for _ in range(cfg.n_layer)]
    with torch.no_grad():
        a, _ = ours(ids)
        b, _ = ours(ids, past_key_values=empty)
    assert torch.equal(a, b)


def test_bundled_model_loads_in_transformers_identically():
    """The shipped weights are plain Hugging Face GPT-2: transformers reads them to the same logits."""
    from gpt2x.model.checkpoints import bundled_dir

    ours, _ = load_model("shakespeare")
    hf = GPT2LMHeadModel.from_pretrained(bundled_dir(), dtype=torch.float32).eval()
    ids = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (ours(ids)[0] - hf(ids).logits).abs().max().item() <= ATOL


def test_config_validation():
    with pytest.raises(ValueError):
        GPT2Config(n_embd=30, n_head=4)
    with pytest.raises(ValueError):
        GPT2Config(n_layer=0)
