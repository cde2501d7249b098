"""The files that make an export folder loadable by other tools (gpt2x.interop), read back by those
tools' own code: transformers' config and tokenizer loaders, Hugging Face tokenizers, and an ONNX
Runtime session fed by the names genai_config.json gives, against transformers' GPT2LMHeadModel
built from the written config.json and the same weights."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from gpt2x import tokenizer as tk
from gpt2x.choices import Precision
from gpt2x.errors import Gpt2xError
from gpt2x.evaluate.parity import TOLERANCES
from gpt2x.model.config import GPT2Config
from gpt2x.model.weights import load_model
from gpt2x.onnx import interop
from gpt2x.onnx.artifact import MODEL_FILE, read_export
from gpt2x.onnx.names import in_place_kv
from gpt2x.workflows.exports import export_model as export

SAMPLES = [
    "Hello world",
    "",
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "   leading, trailing and   inner runs   ",
    "tabs\t\tand\nnewlines\r\n\n\n",
    "I'm, you're, we've, they'll, he'd, it's, 'tis, DON'T",
    "spaces before punctuation , . ! ? and do n't , I 'm",
    "3.14159 1,000,000 2026-11-21 0x1F 1e-5",
    "naïve café — “quotes” ‘single’ ﬁ ﷽",
    "日本語 中文 한국어 Ἐν ἀρχῇ",
    "emoji 😀👍🏽 family 👨‍👩‍👧",
    "a<|endoftext|>b",
    "<|endoftext|>",
    " <|endoftext|>\n<|endoftext|> x",
]
# Not the default GPT2Config, so that every field must come from the config given.
ODD = GPT2Config(vocab_size=50257, n_positions=77, n_embd=48, n_layer=3, n_head=6, layer_norm_epsilon=1e-6)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("interop")
    names = interop.write_interop_files(folder, ODD)
    return folder, names


def test_files_written_atomically(files):
    folder, names = files
    assert sorted(names) == sorted(interop.INTEROP_FILES)
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)  # no temporary files left
    for name in names:
        assert isinstance(json.loads((folder / name).read_text(encoding="utf-8")), dict)


def test_config_json_loads_in_transformers(files):
    from transformers import GPT2Config as HFConfig

    hf = HFConfig.from_pretrained(files[0])
    assert (hf.vocab_size, hf.n_positions, hf.n_ctx, hf.n_embd, hf.n_layer, hf.n_head, hf.layer_norm_epsilon) == (
        ODD.vocab_size, ODD.n_positions, ODD.n_positions, ODD.n_embd, ODD.n_layer, ODD.n_head, ODD.layer_norm_epsilon)
    assert hf.model_type == "gpt2" and hf.architectures == ["GPT2LMHeadModel"]
    assert hf.activation_function == "gelu_new" and hf.n_inner is None
    assert hf.bos_token_id == hf.eos_token_id == 50256
    assert hf.use_cache is True and hf.tie_word_embeddings is True
    assert hf.scale_attn_weights and not hf.scale_attn_by_inverse_layer_idx and not hf.add_cross_attention


def test_genai_config_fields(files):
    cfg = json.loads((files[0] / interop.GENAI_CONFIG_FILE).read_text())
    model, decoder = cfg["model"], cfg["model"]["decoder"]
    assert model["context_length"] == 77 and model["vocab_size"] == 50257
    assert model["eos_token_id"] == model["pad_token_id"] == model["bos_token_id"] == 50256
    assert (decoder["hidden_size"], decoder["head_size"], decoder["num_attention_heads"],
            decoder["num_key_value_heads"], decoder["num_hidden_layers"]) == (48, 8, 6, 6, 3)
    assert decoder["filename"] == MODEL_FILE
    assert cfg["search"]["past_present_share_buffer"] is False and cfg["search"]["max_length"] == 77


@pytest.fixture(scope="module")
def hf_tokenizers(files):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = str(files[0] / interop.TOKENIZER_FILE)
    return {
        "tokenizers": Tokenizer.from_file(path),
        "PreTrainedTokenizerFast": PreTrainedTokenizerFast(tokenizer_file=path, clean_up_tokenization_spaces=False),
        "AutoTokenizer": AutoTokenizer.from_pretrained(files[0]),  # + tokenizer_config.json, special_tokens_map.json
    }


@pytest.mark.parametrize("text", SAMPLES)
def test_tokenizer_json_encodes_and_decodes_like_gpt2x(hf_tokenizers, text):
    ids = tk.encode(text)
    assert tk.decode(ids) == text
    for name, tok in hf_tokenizers.items():
        if name == "tokenizers":
            got = tok.encode(text).ids
            back = tok.decode(got, skip_special_tokens=False)
        else:
            got = tok(text, add_special_tokens=False)["input_ids"]
            back = tok.decode(got)
        assert got == ids, name
        assert back == text, name


def test_tokenizer_known_ids(hf_tokenizers):
    tok = hf_tokenizers["AutoTokenizer"]
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert tok.eos_token_id == tok.bos_token_id == 50256 and len(tok) == 50257
    assert tok.model_max_length == 77


def test_corrupt_bpe_file_is_refused(monkeypatch, tmp_path):
    bad = tmp_path / "vocab.bpe"
    bad.write_bytes(tk.bpe_file("vocab.bpe").read_bytes() + b"x")
    real = tk.bpe_file
    monkeypatch.setattr(tk, "bpe_file", lambda name: bad if name == "vocab.bpe" else real(name))
    with pytest.raises(Gpt2xError, match="corrupt"):
        interop.tokenizer_json()


# ---------------------------------------------------------------- a real export


@pytest.fixture(scope="module")
def exported(tiny_hf, tmp_path_factory):
    """conftest's tiny transformers model exported by gpt2x (which writes the interop files), and a
    Hugging Face folder pairing the written config.json with transformers' own weights."""
    hf_folder, _ = tiny_hf
    model, source = load_model(str(hf_folder))
    root = tmp_path_factory.mktemp("interop-export")
    info = export(model, source, root / "tiny-fp32", precision=Precision.fp32, check_parity=False)
    copy = info.folder
    described = root / "described"
    described.mkdir()
    shutil.copy(copy / interop.HF_CONFIG_FILE, described)
    shutil.copy(hf_folder / "model.safetensors", described)
    return copy, described


def test_export_writes_and_hashes_the_interop_files(exported):
    copy, _ = exported
    info = read_export(copy)
    assert set(interop.INTEROP_FILES) <= set(info.meta["files"])  # sized (checked on load) and hashed (gpt2x verify)
    assert info.config == load_model(str(exported[1]))[0].config
    genai = json.loads((copy / interop.GENAI_CONFIG_FILE).read_text())
    assert genai["search"]["past_present_share_buffer"] is in_place_kv(info.attention) is False


def test_share_buffer_only_where_asked(tmp_path):
    interop.write_interop_files(tmp_path, ODD, share_buffer=True)
    assert json.loads((tmp_path / interop.GENAI_CONFIG_FILE).read_text())["search"]["past_present_share_buffer"] is True


def test_genai_names_are_the_graph_names(exported):
    copy, _ = exported
    decoder = json.loads((copy / interop.GENAI_CONFIG_FILE).read_text())["model"]["decoder"]
    proto = onnx.load(str(copy / decoder["filename"]), load_external_data=False)
    n = decoder["num_hidden_layers"]
    ins, outs = decoder["inputs"], decoder["outputs"]
    want_in = [ins["input_ids"], ins["attention_mask"], ins["position_ids"]]
    want_out = [outs["logits"]]
    for i in range(n):
        want_in += [ins["past_key_names"] % i, ins["past_value_names"] % i]
        want_out += [outs["present_key_names"] % i, outs["present_value_names"] % i]
    defaults = {t.name for t in proto.graph.initializer}  # inputs with a default (logits_to_keep): fed by nobody
    assert sorted(i.name for i in proto.graph.input if i.name not in defaults) == sorted(want_in)
    assert sorted(o.name for o in proto.graph.output) == sorted(want_out)
    past = next(i for i in proto.graph.input if i.name == ins["past_key_names"] % 0)
    dims = [d.dim_value for d in past.type.tensor_type.shape.dim]
    assert dims[1] == decoder["num_key_value_heads"] and dims[3] == decoder["head_size"]


def test_config_json_describes_the_graph(exported):
    """transformers' GPT2LMHeadModel from the written config.json and the same weights gives the
    logits the ONNX file gives, fed by genai_config.json's names: a prefill with left padding, then a
    decode step on the returned cache."""
    from transformers import GPT2LMHeadModel

    copy, described = exported
    hf = GPT2LMHeadModel.from_pretrained(described, dtype=torch.float32).eval()
    decoder = json.loads((copy / interop.GENAI_CONFIG_FILE).read_text())["model"]["decoder"]
    ins, outs = decoder["inputs"], decoder["outputs"]
    n, heads, head = decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]
    sess = ort.InferenceSession(str(copy / decoder["filename"]), providers=["CPUExecutionProvider"])
    out_names = [o.name for o in sess.get_outputs()]

    ids = torch.randint(0, 50257, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    empty = np.zeros((2, heads, 0, head), dtype=np.float32)
    feeds = {ins["input_ids"]: ids.numpy(), ins["attention_mask"]: mask.numpy(), ins["position_ids"]: pos.numpy()}
    feeds |= {ins[k] % i: empty for i in range(n) for k in ("past_key_names", "past_value_names")}
    got = dict(zip(out_names, sess.run(None, feeds)))
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    tol = TOLERANCES[Precision.fp32].max_rel
    real = mask.bool().numpy()
    want = ref.logits.numpy()
    assert np.abs(got[outs["logits"]][real] - want[real]).max() <= tol * np.abs(want[real]).max()

    nxt = torch.tensor([[11], [13]])
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    pos2 = mask2.sum(-1, keepdim=True) - 1
    feeds = {ins["input_ids"]: nxt.numpy(), ins["attention_mask"]: mask2.numpy(), ins["position_ids"]: pos2.numpy()}
    for i in range(n):
        feeds[ins["past_key_names"] % i] = got[outs["present_key_names"] % i]
        feeds[ins["past_value_names"] % i] = got[outs["present_value_names"] % i]
    step = dict(zip(out_names, sess.run(None, feeds)))
    with torch.no_grad():
        ref2 = hf(input_ids=nxt, attention_mask=mask2, position_ids=pos2, past_key_values=ref.past_key_values, use_cache=True)
    want2 = ref2.logits.numpy()
    assert step[outs["logits"]].shape == (2, 1, 50257)
    assert np.abs(step[outs["logits"]] - want2).max() <= tol * np.abs(want2).max()
    assert not np.allclose(want2[0], want2[1])  # the rows differ, so a mix-up would show
