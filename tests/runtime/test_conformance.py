"""One conformance suite for every backend and each of its cache forms (runtime/base.py's Backend and
KVCache protocols): the same contract checks on each pair that runs on this machine, against an
independent reference, the PyTorch model's forward over the whole sequence without a cache.

Every pair: a left-padded batch prefilled and decoded step by step; its cache's rows reordered
(permuted, dropped, taken twice); its arrays (`to_numpy`). Where the record declares them: a cache
from those arrays (`takes_past`), two batches merged (`joins_rows`), positions dropped (`rolls_back`),
greedy steps (`argmax_where_logits_are`). That a backend lacks the methods of what it does not
declare is test_backends.py's test_each_capability_comes_with_its_methods; CUDA's pairs are
test_cuda.py's. A pair whose runtime is missing here fails: the test extra installs them all."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from gpt2x.choices import BackendKind, Precision, ProviderKind
from gpt2x.evaluate.parity import TOLERANCES
from gpt2x.numerics import positions
from gpt2x.runtime.genai import GenaiState
from gpt2x.runtime.openvino import OpenVinoKVCache
from gpt2x.runtime.ort import GrowingCache, InPlaceCache
from gpt2x.runtime.pytorch import TorchBackend, TorchCache
from gpt2x.runtime.registry import backend_class, capabilities_of
from gpt2x.runtime.web import WebCache
from gpt2x.tokenizer import EOT_ID, encode

from ..helpers import PROMPTS, check_step_greedy

MAX_REL = TOLERANCES[Precision.fp32].max_rel

# (backend kind, the cache form its steps must return, the export it opens: the fp32 export's
# MultiHeadAttention graph or that graph rewritten to GroupQueryAttention; None: the model itself).
PAIRS = {
    "torch": (BackendKind.torch, TorchCache, None),
    "ort-growing": (BackendKind.ort, GrowingCache, "mha"),
    "ort-in-place": (BackendKind.ort, InPlaceCache, "gqa"),
    "openvino-mha": (BackendKind.openvino, OpenVinoKVCache, "mha"),
    "openvino-gqa": (BackendKind.openvino, OpenVinoKVCache, "gqa"),
    "genai": (BackendKind.genai, GenaiState, "mha"),
    "web": (BackendKind.web, WebCache, "mha"),
}


def pairs_that(capability: str) -> list[str]:
    """The pairs whose backend's record declares `capability` (capabilities_of: a missing runtime
    fails the collection, never drops its pairs)."""
    return [name for name, (kind, _, _) in PAIRS.items() if getattr(capabilities_of(kind), capability)]


@pytest.fixture(scope="module")
def tiny(tiny_export):
    """The run's shared tiny model, its fp32 export and that export with GroupQueryAttention."""
    model, _, mha = tiny_export()
    return model, {"mha": mha, "gqa": tiny_export(gqa=True)[2]}


@pytest.fixture(scope="module")
def reference(tiny):
    return TorchBackend(tiny[0])


@pytest.fixture(scope="module")
def opened(tiny):
    """opened(pair) -> its backend, opened when first asked for and shared by the module's tests
    (the web pair's is the module's one Chromium)."""
    model, infos = tiny
    backends: dict = {}

    def get(name: str):
        if name not in backends:
            kind, form, graph = PAIRS[name]
            if kind is BackendKind.torch:
                backends[name] = TorchBackend(model)
            else:
                options = {"in_place_kv": form is InPlaceCache} if kind is BackendKind.ort else {}
                backends[name] = backend_class(kind)(infos[graph], ProviderKind.cpu, 1, **options)
        return backends[name]

    yield get
    for backend in backends.values():
        backend.close()


@dataclass
class Batch:
    """A batch as a backend holds it: every token fed so far (pads included), its mask and its cache."""

    ids: np.ndarray
    mask: np.ndarray
    past: object
    logits: np.ndarray | None  # the last step's


def left_padded(prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    rows = [encode(p) for p in prompts]
    width = max(map(len, rows))
    ids = np.full((len(rows), width), EOT_ID, dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def expect(reference: TorchBackend, batch: Batch, logits: np.ndarray, what: str) -> None:
    """`logits` are the reference's at the last position of the batch's whole sequence."""
    want = reference.run(batch.ids, batch.mask, positions(batch.mask, batch.ids.shape[1]), None)[0][:, -1]
    assert logits.shape == want.shape, what
    assert rel(logits, want) <= MAX_REL, f"{what}: max_rel {rel(logits, want):.2e}"


def prefill(backend, reference, prompts: list[str], form: type) -> Batch:
    ids, mask = left_padded(prompts)
    logits, past = backend.step(ids, mask, positions(mask, ids.shape[1]), None)
    assert type(past) is form and (past.rows, past.length) == ids.shape
    batch = Batch(ids, mask, past, logits)
    expect(reference, batch, logits, "prefill")
    return batch


def step(backend, reference, batch: Batch, tokens, what: str) -> Batch:
    tokens = np.asarray(tokens, dtype=np.int64)
    mask = np.concatenate([batch.mask, np.ones((len(tokens), 1), dtype=np.int64)], axis=1)
    logits, past = backend.step(tokens[:, None], mask, positions(mask, 1), batch.past)
    after = Batch(np.concatenate([batch.ids, tokens[:, None]], axis=1), mask, past, logits)
    assert (past.rows, past.length) == mask.shape, what
    expect(reference, after, logits, what)
    return after


def script(rows: int, steps: int, seed: int) -> np.ndarray:
    """Tokens fed at each step (steps, rows): chosen here, not by the backend, so the reference's
    sequence does not depend on what is checked; no <|endoftext|>, which genai feeds by a replay."""
    return np.random.default_rng(seed).integers(0, EOT_ID, (steps, rows))


def begin(name: str, opened, reference):
    backend, form = opened(name), PAIRS[name][1]
    return backend, form, prefill(backend, reference, PROMPTS, form)


def test_every_cache_form_of_every_backend_has_its_pairs():
    forms = {(kind, form) for kind, form, _ in PAIRS.values()}
    assert forms == {(kind, form) for kind in BackendKind for form in backend_class(kind).cache_forms}


@pytest.mark.parametrize("name", list(PAIRS))
def test_a_left_padded_batch_decodes_as_the_reference(name, opened, reference):
    backend, _, batch = begin(name, opened, reference)
    for i, tokens in enumerate(script(3, 4, seed=1)):
        batch = step(backend, reference, batch, tokens, f"step {i + 1}")


@pytest.mark.parametrize("name", list(PAIRS))
def test_reordered_rows_decode_as_the_reference(name, opened, reference):
    """Rows permuted, one dropped and one taken twice (beam search); each copy of the twice-taken row
    then decodes tokens of its own."""
    backend, _, batch = begin(name, opened, reference)
    batch = step(backend, reference, batch, script(3, 1, seed=2)[0], "before the reorder")
    rows = np.array([2, 0, 0])
    past = batch.past.reorder(rows)
    assert (past.rows, past.length) == (3, batch.mask.shape[1])
    batch = Batch(batch.ids[rows], batch.mask[rows], past, None)
    for i, tokens in enumerate(script(3, 2, seed=3)):
        batch = step(backend, reference, batch, tokens, f"step {i + 1} after the reorder")


@pytest.mark.parametrize("name", list(PAIRS))
def test_to_numpy_gives_the_cache_and_a_cache_from_it_continues_identically(name, opened, reference):
    """2 * n_layer float32 arrays (B, H, P, D), key then value per layer, equal to the reference's
    at every real position; where the backend takes a past, one made from them steps as the cache
    they came from (the same logits) and gives them back unchanged."""
    backend, form, batch = begin(name, opened, reference)
    batch = step(backend, reference, batch, script(3, 1, seed=4)[0], "before to_numpy")
    arrays = batch.past.to_numpy()
    _, want = reference.run(batch.ids, batch.mask, positions(batch.mask, batch.ids.shape[1]), None)
    want = want.to_numpy()
    assert len(arrays) == len(want) == 2 * reference.model.config.n_layer
    real = batch.mask.astype(bool)
    for i, (got, ref) in enumerate(zip(arrays, want)):
        assert got.dtype == np.float32 and got.shape == ref.shape, (i, got.shape, ref.shape)
        assert rel(got.transpose(0, 2, 1, 3)[real], ref.transpose(0, 2, 1, 3)[real]) <= MAX_REL, i
    if not backend.capabilities.takes_past:
        return
    made = backend.past_from_numpy(arrays)
    assert type(made) is form and (made.rows, made.length) == batch.mask.shape
    assert all(np.array_equal(a, b) for a, b in zip(made.to_numpy(), arrays))
    own, made = batch, Batch(batch.ids, batch.mask, made, None)
    for i, tokens in enumerate(script(3, 2, seed=5)):
        made = step(backend, reference, made, tokens, f"step {i + 1} from past_from_numpy")
        own = step(backend, reference, own, tokens, f"step {i + 1} from the cache itself")
        assert np.array_equal(made.logits, own.logits), f"step {i + 1}"


@pytest.mark.parametrize("name", pairs_that("joins_rows"))
def test_merged_batches_decode_as_the_reference(name, opened, reference):
    """A batch whose longest row leaves, merged with a batch of two joining rows at the width its
    kept rows use: the leading columns dropped, the joiners moved right, rows interleaved."""
    backend, form, batch = begin(name, opened, reference)
    batch = step(backend, reference, batch, script(3, 1, seed=6)[0], "before the merge")
    joiner = prefill(backend, reference, ["O", "Now is the"], form)
    rows = np.array([3, 0, 4, 1])  # the joiner's rows are numbered after the batch's
    kept = batch.mask[:2]
    width = kept.shape[1] - int(np.argmax(kept.any(0)))
    assert joiner.mask.shape[1] < width < batch.mask.shape[1]

    def fit(a: np.ndarray) -> np.ndarray:
        return a[:, a.shape[1] - width:] if a.shape[1] >= width else np.pad(a, [(0, 0), (width - a.shape[1], 0)])

    past = batch.past.merge(rows, joiner.past, width)
    assert type(past) is form and (past.rows, past.length) == (4, width)
    merged = Batch(np.concatenate([fit(batch.ids), fit(joiner.ids)])[rows],
                   np.concatenate([fit(batch.mask), fit(joiner.mask)])[rows], past, None)
    for i, tokens in enumerate(script(4, 2, seed=7)):
        merged = step(backend, reference, merged, tokens, f"step {i + 1} after the merge")


@pytest.mark.parametrize("name", pairs_that("rolls_back"))
def test_a_truncated_cache_decodes_as_the_reference_on_the_shorter_sequence(name, opened, reference):
    """Three steps, two of them dropped (speculative decoding's rollback), then another token."""
    backend, _, batch = begin(name, opened, reference)
    keep = batch.mask.shape[1] + 1
    for i, tokens in enumerate(script(3, 3, seed=8)):
        batch = step(backend, reference, batch, tokens, f"step {i + 1}")
    past = batch.past.truncate(keep)
    assert (past.rows, past.length) == (3, keep)
    short = Batch(batch.ids[:, :keep], batch.mask[:, :keep], past, None)
    for i, tokens in enumerate(script(3, 2, seed=9)):
        short = step(backend, reference, short, tokens, f"step {i + 1} after the truncation")


@pytest.mark.parametrize("name", pairs_that("argmax_where_logits_are"))
def test_greedy_steps_are_the_argmax_of_steps(name, opened):
    """step_greedy's tokens are NumPy's argmax of step's logits, from a prompt and from a past."""
    assert type(check_step_greedy(opened(name))) is PAIRS[name][1]
