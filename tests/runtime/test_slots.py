"""SlotDecoder, the serving engine's fixed slots, on the CPU provider: rows that join by a prefill into a free slot (in
one forward or in chunks), decode at their own lengths, and leave, each row's logits against the PyTorch model's forward
of that row's whole sequence without a cache, and no row's cache touched by another's join."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpt2x.choices import Precision, ProviderKind
from gpt2x.errors import ProviderError
from gpt2x.runtime.static_decode import SlotDecoder


@pytest.fixture(scope="module")
def tiny(tiny_export):
    model, _, info = tiny_export(Precision.fp32)
    return model, info


def torch_last_logits(model, ids: list[int]) -> np.ndarray:
    """The PyTorch model's logits at the last position of `ids`, one forward without a cache."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits, _ = model(x, torch.ones_like(x), torch.arange(len(ids))[None], None)
    return logits[0, -1].numpy()


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    """fp32 against fp32, summed in another order: within 1e-4 of the logits' scale, and the same argmax."""
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert got.argmax() == want.argmax()


# SlotDecoder.mixed_prefill: prefills as mixed steps (the serving backend's), or on the prefill's own graph.
@pytest.mark.parametrize("mixed_prefill", [False, True], ids=["prefill-graph", "mixed-prefill"])
def test_rows_join_decode_at_their_own_lengths_and_leave_as_if_each_ran_alone(tiny, mixed_prefill):
    model, info = tiny
    rng = np.random.default_rng(5)
    V = info.config.vocab_size
    decoder = SlotDecoder(info, ProviderKind.cpu, slots=3, capacity=48, mixed_prefill=mixed_prefill)
    rows: dict[int, list[int]] = {}  # slot -> the sequence it holds

    def join(slot: int, prompt: list[int], chunks: tuple[int, ...] = ()) -> None:
        start = 0
        for end in (*chunks, len(prompt)):  # a prompt in one forward, or in chunks after what the slot holds
            logits = decoder.prefill(slot, np.array(prompt[start:end]))
            assert_close(logits, torch_last_logits(model, prompt[:end]))
            start = end
        rows[slot] = list(prompt) + [int(logits.argmax())]

    def steps(n: int) -> None:
        for _ in range(n):
            tokens = np.zeros(decoder.slots, np.int64)
            for slot, seq in rows.items():
                tokens[slot] = seq[-1]
            logits = decoder.step(tokens)
            for slot, seq in rows.items():
                assert_close(logits[slot], torch_last_logits(model, seq))
                seq.append(int(logits[slot].argmax()))
            np.testing.assert_array_equal(decoder.lengths[list(rows)], [len(seq) - 1 for seq in rows.values()])

    join(1, rng.integers(0, V, 7).tolist())
    steps(3)  # one row, slots 0 and 2 free
    join(2, rng.integers(0, V, 4).tolist())  # a shorter row joins beside a longer one
    steps(4)
    kept = [kv.numpy()[2].copy() for kv in decoder._kv]  # slot 2's cache, whole
    decoder.release(1)
    del rows[1]
    join(0, rng.integers(0, V, 10).tolist(), chunks=(6,))  # in two chunks, in the slot below
    # the join wrote its own slot alone: slot 2's rows are byte for byte what they were
    assert all(np.array_equal(kv.numpy()[2], before) for kv, before in zip(decoder._kv, kept))
    steps(4)
    join(1, rng.integers(0, V, 3).tolist())  # a freed slot taken again: what it held before is not read
    steps(3)
    assert sorted(rows) == [0, 1, 2] and decoder.lengths.tolist() == [len(rows[s]) - 1 for s in range(3)]


def test_what_does_not_fit_is_refused_and_a_step_needs_a_row(tiny):
    _, info = tiny
    decoder = SlotDecoder(info, ProviderKind.cpu, slots=2, capacity=8)
    with pytest.raises(ValueError, match="no slot holds a sequence"):
        decoder.step(np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="slot 2 is not one of 0..1"):
        decoder.prefill(2, np.array([1, 2]))
    decoder.prefill(0, np.arange(6))
    with pytest.raises(ValueError, match="slot 0 holds 6 positions of 8: 3 more do not fit"):
        decoder.prefill(0, np.arange(3))
    decoder.step(np.array([1, 0]))
    decoder.step(np.array([1, 0]))
    with pytest.raises(ValueError, match="slot 0 is full"):
        decoder.step(np.array([1, 0]))
    with pytest.raises(ValueError, match="capacity"):
        SlotDecoder(info, ProviderKind.cpu, capacity=info.config.n_positions + 1)


def test_an_export_the_fixed_slots_cannot_run_is_one_line(tiny_export):
    info = tiny_export(Precision.fp16)[2]
    with pytest.raises(ProviderError, match="fp16"):
        SlotDecoder(info, ProviderKind.cpu)


@pytest.mark.parametrize("batched", [False, True], ids=["model", "batched-graph"])
def test_int8_rows_on_the_slots_decode_and_mix_as_onnx_runtimes_int8_backend(tiny_export, batched):
    """An int8 export on the slots (its own GroupQueryAttention graph, a float cache): a row's prefill, a mixed step's
    decode row and chunk against the ort backend's int8 forward of each row alone (float cache, no cache passed),
    within int8's batch variance (its activations are quantized per step). With its batched decode graph asked for (as
    serving runs it where the export's record timed it faster), the reference is the ort backend on that graph: the
    mixed step's kept positions gathered ahead of its dynamically quantized unembedding."""
    from gpt2x.numerics import positions
    from gpt2x.runtime.ort import OrtBackend

    info = tiny_export(Precision.int8, batched=batched)[2]
    reference = OrtBackend(info, threads=1, kv_cache_dtype="float", batched=batched or None)

    def alone(ids: list[int]) -> np.ndarray:
        x = np.array([ids])
        m = np.ones_like(x)
        return reference.run(x, m, positions(m, x.shape[1]), None)[0][0, -1]

    def close(got: np.ndarray, want: np.ndarray) -> None:
        assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()

    rng = np.random.default_rng(3)
    V = info.config.vocab_size
    decoder = SlotDecoder(info, ProviderKind.cpu, slots=2, capacity=48, batched=batched)
    assert decoder.batched is batched
    first = rng.integers(0, V, 9).tolist()
    logits = decoder.prefill(0, np.array(first))
    close(logits, alone(first))
    row = first + [int(logits.argmax())]
    joiner = rng.integers(0, V, 12).tolist()
    decode, last = decoder.step_mixed(np.array([row[-1], 0]), np.array([True, False]), 1, np.array(joiner[:7]))
    close(decode[0], alone(row))
    close(last, alone(joiner[:7]))


@pytest.mark.parametrize("mixed_prefill", [False, True], ids=["prefill-graph", "mixed-prefill"])
def test_an_int8_cache_on_the_slots_decodes_and_mixes_as_the_ort_backends_int8_cache(tiny_export, monkeypatch, mixed_prefill):
    """An int8 export whose record kept the int8 cache's scales, with the int8 cache asked for: the slots hold int8 (a
    quarter of the float cache's bytes), and a row's prefill, its decode steps, and a mixed step's decode row and chunk
    give the ort backend's logits on its own int8 cache (in place) for the same sequences; the prefix cache's copy of a
    slot is int8, and a past made of it decodes on."""
    from gpt2x.numerics import positions
    from gpt2x.runtime.kvdtype import KV_DTYPE_ENV
    from gpt2x.runtime.ort import OrtBackend
    from gpt2x.runtime.static_decode import SlotBackend

    info = tiny_export(Precision.int8, int8_kv=True)[2]
    monkeypatch.setenv(KV_DTYPE_ENV, "int8")  # for this test's backends (not the export's own gate, which sets it)
    reference = OrtBackend(info, threads=1)
    assert reference.kv_dtype == np.int8

    def ort_steps(ids: list[int], steps: list[int]) -> list[np.ndarray]:
        """The ort backend's last logits after the prompt `ids`, then after each of `steps`, on its int8 cache."""
        x = np.array([ids])
        m = np.ones_like(x)
        logits, past = reference.step(x, m, positions(m, x.shape[1]), None)
        out = [logits[0]]
        for t in steps:
            m = np.ones((1, m.shape[1] + 1), np.int64)
            logits, past = reference.step(np.array([[t]]), m, positions(m, 1), past)
            out.append(logits[0])
        return out

    def close(got: np.ndarray, want: np.ndarray) -> None:
        assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()

    rng = np.random.default_rng(4)
    V = info.config.vocab_size
    decoder = SlotDecoder(info, ProviderKind.cpu, slots=2, capacity=48, mixed_prefill=mixed_prefill)
    assert decoder.dtype == np.int8 and all(a.dtype == np.int8 for a in decoder._arrays)
    first = rng.integers(0, V, 9).tolist()
    logits = [decoder.prefill(0, np.array(first))]
    nxt = [int(logits[0].argmax())]
    for _ in range(3):
        logits.append(decoder.step(np.array([nxt[-1], 0]))[0])
        nxt.append(int(logits[-1].argmax()))
    for got, want in zip(logits, ort_steps(first, nxt[:-1])):
        close(got, want)
    joiner = rng.integers(0, V, 12).tolist()
    decode, last = decoder.step_mixed(np.array([nxt[-1], 0]), np.array([True, False]), 1, np.array(joiner[:7]))
    close(decode[0], ort_steps(first, nxt)[-1])
    close(last, ort_steps(joiner[:7], [])[0])
    nxt.append(int(decode[0].argmax()))
    after = decoder.step(np.array([nxt[-1], int(last.argmax())]))  # both read what the mixed step wrote
    close(after[0], ort_steps(first, nxt)[-1])
    close(after[1], ort_steps(joiner[:7], [int(last.argmax())])[-1])

    backend = SlotBackend(info, slots=2, capacity=48)
    x = np.array([first])
    _, cache = backend.step(x, np.ones_like(x), None, None)
    kept = cache.stored()
    assert kept[0].dtype == np.int8 and kept[0].shape[2] == len(first)
    del cache
    past = backend.past_from_numpy(kept)
    logits, _ = backend.step(np.array([[nxt[0]]]), np.ones((1, len(first) + 1), np.int64), None, past)
    close(logits[0], ort_steps(first, nxt[:1])[-1])


def test_the_backends_caches_hold_each_slot_once_and_free_what_they_let_go(tiny):
    """SlotBackend's caches: a prefill takes the lowest free slots (refused whole where too few are free), a merge hands
    the kept slots on and frees the leavers', a row taken twice is copied (its twin's logits the same), and a cache let
    go frees what it holds."""
    import gc

    from gpt2x.runtime.static_decode import SlotBackend

    model, info = tiny
    backend = SlotBackend(info, slots=4, capacity=32)
    ids = np.array([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1]])  # the first row left-padded: its three tokens alone run
    logits, batch = backend.step(ids, mask, None, None)
    assert batch.slots.tolist() == [0, 1] and backend.decoder.lengths[:2].tolist() == [3, 4]
    assert_close(logits[0], torch_last_logits(model, [5, 6, 7]))
    with pytest.raises(RuntimeError, match="3 rows need a slot each and 2 of 4 are free"):
        backend.step(np.zeros((3, 2), np.int64), np.ones((3, 2), np.int64), None, None)
    assert sorted(backend._free) == [2, 3]
    _, joiner = backend.step(np.array([[12, 13]]), np.ones((1, 2), np.int64), None, None)
    assert joiner.slots.tolist() == [2]
    merged = batch.merge(np.array([1, 2, 2]), joiner, width=0)  # row 0 leaves; the joiner's row twice
    assert merged.slots.tolist() == [1, 2, 0] and batch.slots.size == 0 and joiner.slots.size == 0
    assert backend.decoder.lengths.tolist() == [2, 4, 2, 0] and sorted(backend._free) == [3]
    tokens = np.array([[3], [14], [14]])
    logits, same = backend.step(tokens, np.ones((3, 5), np.int64), None, merged)
    assert same is merged
    assert_close(logits[1], torch_last_logits(model, [12, 13, 14]))
    np.testing.assert_array_equal(logits[1], logits[2])  # the copy decodes as its original
    del merged, same
    gc.collect()
    assert sorted(backend._free) == [0, 1, 2, 3] and not backend.decoder.lengths.any()


@pytest.mark.parametrize("mixed_prefill", [False, True], ids=["prefill-graph", "mixed-prefill"])
def test_a_chunk_mixed_into_a_decode_step_is_the_chunk_and_the_step_run_apart(tiny, mixed_prefill):
    """SlotDecoder.step_mixed: the decode rows' logits and the chunk's last position's, from one forward, each against
    the PyTorch model's forward of that row alone; chunks into a fresh slot and on a past, in a slot among the decode
    rows (its dummy token after the chunk) and above them. What cannot mix is refused."""
    model, info = tiny
    rng = np.random.default_rng(7)
    V = info.config.vocab_size
    decoder = SlotDecoder(info, ProviderKind.cpu, slots=5, capacity=48, mixed_prefill=mixed_prefill)
    rows: dict[int, list[int]] = {}
    for slot, n in ((0, 7), (2, 4)):
        prompt = rng.integers(0, V, n).tolist()
        rows[slot] = prompt + [int(decoder.prefill(slot, np.array(prompt)).argmax())]
    for slot, length in ((1, 19), (4, 13), (3, 5)):  # among the decode rows, above them, between
        prompt, done = rng.integers(0, V, length).tolist(), 0
        while done < length:
            tokens = np.zeros(5, np.int64)
            active = np.zeros(5, bool)
            for s, seq in rows.items():
                tokens[s], active[s] = seq[-1], True
            chunk = np.array(prompt[done:done + 8])
            logits, last = decoder.step_mixed(tokens, active, slot, chunk)
            done += len(chunk)
            assert_close(last, torch_last_logits(model, prompt[:done]))
            for s, seq in rows.items():
                assert_close(logits[s], torch_last_logits(model, seq))
                seq.append(int(logits[s].argmax()))
        rows[slot] = prompt + [int(last.argmax())]
        assert decoder.lengths.tolist() == [len(rows[s]) - 1 if s in rows else 0 for s in range(5)]
    assert decoder.mixed_runs == 3 + 2 + 1
    active = np.array([True, False, True, False, False])
    assert not decoder.mixes(active, 0, np.array([1]))  # a decode row's own slot
    assert not decoder.mixes(np.zeros(5, bool), 1, np.array([1]))  # no decode row
    assert not decoder.mixes(active, 1, np.arange(48 - decoder.lengths[1]))  # no room for its dummy token after it
    with pytest.raises(ValueError, match="does not mix"):
        decoder.step_mixed(np.zeros(5, np.int64), active, 0, np.array([1]))


def test_the_backend_runs_a_later_chunk_in_the_next_decode_step_or_drops_it_with_its_row(tiny):
    """SlotBackend.step_later: the chunk waits, then runs in the batch's next decode step (one mixed forward, the
    chunk's row then holding it, as a prefill would); a row let go before that step runs nothing."""
    import gc

    from gpt2x.runtime.static_decode import SlotBackend

    model, info = tiny
    backend = SlotBackend(info, slots=4, capacity=32)
    _, batch = backend.step(np.array([[5, 6, 7]]), np.ones((1, 3), np.int64), None, None)
    joiner = backend.step_later(np.array([[8, 9, 10, 11]]), np.ones((1, 4), np.int64), None, None)
    assert joiner.slots.tolist() == [1] and backend.decoder.lengths[:2].tolist() == [3, 0]  # not run yet
    logits, _ = backend.step(np.array([[12]]), np.ones((1, 4), np.int64), None, batch)
    assert backend.decoder.mixed_runs == 1 and backend.decoder.lengths[:2].tolist() == [4, 4]
    assert_close(logits[0], torch_last_logits(model, [5, 6, 7, 12]))
    logits, _ = backend.step(np.array([[13]]), np.ones((1, 5), np.int64), None, joiner)  # the joiner's next token
    assert_close(logits[0], torch_last_logits(model, [8, 9, 10, 11, 13]))
    backend.step_later(np.array([[1, 2]]), np.ones((1, 2), np.int64), None, None)
    gc.collect()  # the cache step_later returned is gone: its row left, and its chunk with it
    assert backend._pending == [] and backend.decoder.lengths[2] == 0


def torch_past(model, rows: list[list[int]]) -> list[np.ndarray]:
    """The PyTorch model's cache of each row's tokens (each row alone, no cache), as 2 * n_layer arrays (B, H, P, D)
    right-aligned to the longest row, zeros before a shorter one: what the prefix cache hands a backend."""
    P = max(len(r) for r in rows)
    out = None
    for b, ids in enumerate(rows):
        if not ids:
            continue
        x = torch.tensor([ids])
        with torch.no_grad():
            _, presents = model(x, torch.ones_like(x), torch.arange(len(ids))[None], None)
        arrays = [t.numpy()[0] for kv in presents for t in kv]
        if out is None:
            out = [np.zeros((len(rows), a.shape[0], P, a.shape[2]), np.float32) for a in arrays]
        for o, a in zip(out, arrays):
            o[b, :, P - len(ids):] = a
    return out


def test_a_past_made_elsewhere_is_written_into_the_slots_at_the_first_step(tiny):
    """SlotBackend.past_from_numpy (the prefix cache's blocks): PyTorch's cache of three rows' first tokens (12, 5 and
    none), right-aligned; the rest of each prompt run on it, left-padded as the runner sends it, gives each row's last
    logits as PyTorch's forward of the whole prompt, and each row's slot then holds exactly its prompt. A one-token rest
    on every row's past decodes; the cache reads back as it went in."""
    from gpt2x.runtime.static_decode import SlotBackend

    model, info = tiny
    rng = np.random.default_rng(11)
    V = info.config.vocab_size
    prompts = [rng.integers(0, V, n).tolist() for n in (15, 9, 2)]
    cached = [12, 5, 0]
    backend = SlotBackend(info, slots=4, capacity=40)
    past = backend.past_from_numpy(torch_past(model, [p[:c] for p, c in zip(prompts, cached)]))
    for got, want in zip(past.to_numpy(), torch_past(model, [p[:c] for p, c in zip(prompts, cached)])):
        np.testing.assert_array_equal(got, want)  # not yet written: read back as given
    K, T = max(cached), max(len(p) - c for p, c in zip(prompts, cached))
    ids = np.zeros((3, T), np.int64)
    mask = np.zeros((3, K + T), np.int64)
    for b, (p, c) in enumerate(zip(prompts, cached)):
        rest = p[c:]
        ids[b, T - len(rest):] = rest
        mask[b, K - c:K] = 1
        mask[b, K + T - len(rest):] = 1
    logits, cache = backend.step(ids, mask, None, past)
    for b, p in enumerate(prompts):
        assert_close(logits[b], torch_last_logits(model, p))
    assert backend.decoder.lengths[cache.slots].tolist() == [len(p) for p in prompts]
    for got, want in zip(cache.stored(), torch_past(model, prompts)):
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())

    del cache, past  # the rows leave: their slots are free again
    # Every row's rest one token: where each row has a past, the decode step runs them; a row without one (a
    # one-token prompt) is a prefill.
    for lengths in ((6, 3), (6, 3, 1)):
        one = [rng.integers(0, V, n).tolist() for n in lengths]
        past = backend.past_from_numpy(torch_past(model, [p[:-1] for p in one]))
        mask = np.array([[0] * (6 - n) + [1] * n for n in lengths])
        logits, cache = backend.step(np.array([[p[-1]] for p in one]), mask, None, past)
        for b, p in enumerate(one):
            assert_close(logits[b], torch_last_logits(model, p))
        del cache, past


@pytest.mark.parametrize("mix_chunks", [True, False], ids=["mixed-prefill", "prefill-graph"])
def test_run_gives_every_position_of_each_rows_own_tokens(tiny, mix_chunks):
    """SlotBackend.run (a prompt's logprobs): each row's new tokens' logits at every position, a left-padded row's
    padding columns zero, on no past and on a past made elsewhere, against PyTorch's forward of the whole sequence."""
    from gpt2x.runtime.static_decode import SlotBackend

    model, info = tiny
    rng = np.random.default_rng(13)
    V = info.config.vocab_size
    backend = SlotBackend(info, slots=4, capacity=40, mix_chunks=mix_chunks)

    def torch_logits(ids: list[int]) -> np.ndarray:
        x = torch.tensor([ids])
        with torch.no_grad():
            return model(x, torch.ones_like(x), torch.arange(len(ids))[None], None)[0][0].numpy()

    prompts = [rng.integers(0, V, n).tolist() for n in (7, 4)]
    ids = np.array([prompts[0], [0, 0, 0] + prompts[1]])
    mask = (np.arange(7)[None] >= np.array([[0], [3]])).astype(np.int64)
    logits, cache = backend.run(ids, mask, None, None)
    assert logits.shape == (2, 7, V) and not logits[1, :3].any()
    for got, p in ((logits[0], prompts[0]), (logits[1, 3:], prompts[1])):
        np.testing.assert_allclose(got, torch_logits(p), atol=1e-4 * np.abs(got).max())
    del cache
    seq = rng.integers(0, V, 9).tolist()
    past = backend.past_from_numpy(torch_past(model, [seq[:5]]))
    logits, _ = backend.run(np.array([seq[5:]]), np.ones((1, 9), np.int64), None, past)
    np.testing.assert_allclose(logits[0], torch_logits(seq)[5:], atol=1e-4 * np.abs(logits).max())


@pytest.mark.parametrize("mix_chunks", [False, True])
def test_prompts_starting_together_run_in_one_forward_and_decode_as_if_each_ran_alone(tiny, mix_chunks):
    """A wave of prompts: SlotBackend's prefill of a left-padded batch of two lengths runs in one forward
    (SlotDecoder.prefill_rows: the prefill graph on an empty past, its attention bias masking the padding, its presents
    written into their slots, each row's at its slot's front), where prefills are mixed steps or not, and so do joiners'
    whole prompts held for a later step (`flush`). Each row's logits, and then its decode steps', against PyTorch's
    forward of its sequence; a slot already held is refused."""
    from gpt2x.runtime.static_decode import SlotBackend

    model, info = tiny
    rng = np.random.default_rng(23)
    V = info.config.vocab_size
    backend = SlotBackend(info, slots=8, capacity=40, mix_chunks=mix_chunks)
    backend.warm_up()
    prompts = [rng.integers(0, V, n).tolist() for n in (6, 9, 6, 6)]
    ids = np.array([[0] * (9 - len(p)) + p for p in prompts])
    mask = (np.arange(9)[None] >= 9 - np.array([[len(p)] for p in prompts])).astype(np.int64)
    runs = []
    real = backend.decoder.prefill_rows
    backend.decoder.prefill_rows = lambda slots, x, mask=None: runs.append(x.shape) or real(slots, x, mask)
    logits, cache = backend.step(ids, mask, None, None)
    assert runs == [(4, 9)]  # the three 6-token prompts and the 9-token one together
    seqs = [list(p) for p in prompts]
    for _ in range(3):
        for b, seq in enumerate(seqs):
            assert_close(logits[b], torch_last_logits(model, seq))
            seq.append(int(logits[b].argmax()))
        mask = np.concatenate([mask, np.ones((4, 1), np.int64)], axis=1)
        logits, cache = backend.step(np.array([[s[-1]] for s in seqs]), mask, None, cache)
    with pytest.raises(ValueError, match="distinct free slots"):
        backend.decoder.prefill_rows(cache.slots[:2], np.zeros((2, 3), np.int64))
    # joiners' whole prompts held for a later step (step_later), run together where the step cannot mix them
    joiners = [rng.integers(0, V, 5).tolist() for _ in range(3)] + [rng.integers(0, V, 4).tolist()]
    runs.clear()
    later = backend.step_later(np.array([[0] + j if len(j) == 4 else j for j in joiners]),
                               (np.arange(5)[None] >= np.array([[0], [0], [0], [1]])).astype(np.int64), None, None)
    backend.flush()
    assert runs == [(4, 5)]
    tokens = np.zeros(backend.decoder.slots, np.int64)
    tokens[later.slots] = [int(rng.integers(0, V)) for _ in joiners]
    active = np.zeros(backend.decoder.slots, bool)
    active[later.slots] = True
    logits = backend.decoder.step(tokens, active)
    for slot, j in zip(later.slots.tolist(), joiners):
        assert_close(logits[slot], torch_last_logits(model, j + [int(tokens[slot])]))


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.int8])
def test_fresh_prompts_on_the_exports_openvino_prefill_fill_their_slots_and_decode_on(tiny_export, precision,
                                                                                      monkeypatch):
    """Where the export's OpenVINO prefill runs fresh prompts (asked for here: the record's choice is a timing), a
    wave of one length, one of three lengths (left-padded: each row then moved to the front of its slot) and a lone
    prompt run there, OpenVINO writing their keys and values into the slots' own memory (an int8 export's int8 cache,
    quantized as ONNX Runtime's is), and so do prompts into slots apart and joiners' prompts held for a later step
    (into fresh arrays, then copied); prompts too short for it run each alone, ONNX Runtime's prefill session never
    opened; their logits and the decode steps after them against the same prompts on ONNX Runtime's slots (fp32:
    within f32's summation order; int8: within int8's batch variance)."""
    from gpt2x.runtime.kvdtype import KV_DTYPE_ENV
    from gpt2x.runtime.static_decode import SlotBackend

    info = tiny_export(precision, openvino_prefill=True, int8_kv=precision is Precision.int8)[2]
    if precision is Precision.int8:
        monkeypatch.setenv(KV_DTYPE_ENV, "int8")  # the cache the export's record may or may not choose
    tolerance = 1e-4 if precision is Precision.fp32 else 5e-2
    rng = np.random.default_rng(31)
    V = info.config.vocab_size
    waves = [[rng.integers(0, V, 7).tolist() for _ in range(3)], [rng.integers(0, V, n).tolist() for n in (7, 4, 6)]]
    lone = rng.integers(0, V, 5).tolist()

    def run(prefill: str) -> list[np.ndarray]:
        backend = SlotBackend(info, slots=6, capacity=32, prefill=prefill, threads=1)
        backend.warm_up()
        on_openvino = backend.decoder._openvino is not None
        assert on_openvino == (prefill == "openvino")
        assert (backend.decoder._prefill is None) == on_openvino  # ONNX Runtime's prefill session only without it
        if precision is Precision.int8:
            assert backend.decoder.dtype == np.int8
        out = []
        for batch in (*waves, [lone]):
            P = max(len(p) for p in batch)
            ids = np.array([[0] * (P - len(p)) + p for p in batch])
            mask = (np.arange(P)[None] >= P - np.array([[len(p)] for p in batch])).astype(np.int64)
            logits, cache = backend.step(ids, mask, None, None)
            for _ in range(2):
                out.append(logits)
                mask = np.concatenate([mask, np.ones((len(batch), 1), np.int64)], axis=1)
                logits, cache = backend.step(logits.argmax(axis=1)[:, None], mask, None, cache)
            del cache  # its slots freed for the next batch
        # slot 1 held: two prompts then take slots 0 and 2 (OpenVINO writes fresh arrays, then copied in), and two
        # joiners' whole prompts held for a later step run together when flushed
        held = backend.step(np.array([lone]), np.ones((1, 5), np.int64), None, None)[1]
        held2 = backend.step(np.array([lone]), np.ones((1, 5), np.int64), None, None)[1]
        del held
        pair = waves[1][:2]
        ids = np.array([[0] * (7 - len(p)) + p for p in pair])
        mask = (np.arange(7)[None] >= 7 - np.array([[len(p)] for p in pair])).astype(np.int64)
        logits, cache = backend.step(ids, mask, None, None)
        assert sorted(cache.slots.tolist()) == [0, 2]
        later = backend.step_later(ids, mask, None, None)
        backend.flush()
        for c in (cache, later):
            tokens = np.zeros(backend.decoder.slots, np.int64)
            tokens[c.slots] = [3, 5]
            active = np.zeros(backend.decoder.slots, bool)
            active[c.slots] = True
            out.append(backend.decoder.step(tokens, active)[c.slots])
        out.append(logits)
        del held2, cache, later
        # two one-token prompts, too short for OpenVINO: together on ONNX Runtime's prefill without it, each alone with
        # it (its prefill session never opened)
        logits, cache = backend.step(np.array([[5], [9]]), np.ones((2, 1), np.int64), None, None)
        out.append(logits)
        assert (backend.decoder._prefill is None) == on_openvino
        del cache
        return out

    for got, want in zip(run("openvino"), run("onnxruntime")):
        assert np.abs(got - want).max() <= tolerance * np.abs(want).max()
        assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() >= 0.5


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.int8])
def test_rows_on_a_past_run_together_on_the_exports_openvino_prefill_and_decode_on(tiny_export, precision, monkeypatch):
    """Rows' next tokens after what their slots hold, on the export's OpenVINO prefill graph on a past (asked for here:
    the record's choice is a timing), all of them in one forward: the prefix cache's pasts of three lengths with rests of
    two (in fresh arrays, each past right-aligned and each rest left-padded, then copied after what its slot holds),
    with a fresh prompt beside them (run alone); a wave of one past and one rest in consecutive slots (in the slots'
    own memory); and chunks held for a later step (flushed together). Their logits and the decode steps after them
    against the same rows on ONNX Runtime's slots, each row alone (fp32: within f32's summation order; int8: within
    int8's batch variance)."""
    from gpt2x.runtime.kvdtype import KV_DTYPE_ENV
    from gpt2x.runtime.static_decode import SlotBackend

    model, _, info = tiny_export(precision, openvino_prefill=True, int8_kv=precision is Precision.int8)
    if precision is Precision.int8:
        monkeypatch.setenv(KV_DTYPE_ENV, "int8")
    tolerance = 1e-4 if precision is Precision.fp32 else 5e-2
    rng = np.random.default_rng(41)
    V = info.config.vocab_size
    # prompts, the tokens cached (the last none: a fresh prompt beside them, run alone)
    ragged = [rng.integers(0, V, n).tolist() for n in (15, 9, 12, 4)], [12, 5, 8, 0]
    wave = [rng.integers(0, V, 12).tolist() for _ in range(3)], [8, 8, 8]
    chunks = [rng.integers(0, V, n).tolist() for n in (9, 6)]

    def run(prefill: str) -> tuple[list[np.ndarray], int]:
        backend = SlotBackend(info, slots=6, capacity=32, prefill=prefill, threads=1)
        backend.warm_up()
        together = []
        held = backend.decoder.prefill_held
        monkeypatch.setattr(backend.decoder, "prefill_held",
                            lambda slots, rows: together.append(held(slots, rows)) or together[-1])
        out = []
        for prompts, cached in (ragged, wave):
            past = backend.past_from_numpy(torch_past(model, [p[:c] for p, c in zip(prompts, cached)]))
            K, T = max(cached), max(len(p) - c for p, c in zip(prompts, cached))
            ids = np.zeros((len(prompts), T), np.int64)
            mask = np.zeros((len(prompts), K + T), np.int64)
            for b, (p, c) in enumerate(zip(prompts, cached)):
                ids[b, T - len(p) + c:] = p[c:]
                mask[b, K - c:K] = mask[b, K + T - len(p) + c:] = 1
            logits, cache = backend.step(ids, mask, None, past)
            assert backend.decoder.lengths[cache.slots].tolist() == [len(p) for p in prompts]
            for _ in range(2):
                out.append(logits)
                mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
                logits, cache = backend.step(logits.argmax(axis=1)[:, None], mask, None, cache)
            del cache, past
        # two prompts' first 4 tokens prefilled, then their rests (5 and 2 tokens) held for a later step, flushed together
        logits, cache = backend.step(np.array([p[:4] for p in chunks]), np.ones((2, 4), np.int64), None, None)
        rests = np.array([chunks[0][4:], [0] * 3 + chunks[1][4:]])
        mask = np.array([[1] * 9, [1] * 4 + [0] * 3 + [1] * 2])
        backend.step_later(rests, mask, None, cache)
        backend.flush()
        assert backend.decoder.lengths[cache.slots].tolist() == [9, 6]
        tokens = np.zeros(backend.decoder.slots, np.int64)
        tokens[cache.slots] = [3, 5]
        active = np.zeros(backend.decoder.slots, bool)
        active[cache.slots] = True
        out.append(backend.decoder.step(tokens, active)[cache.slots])
        del cache
        return out, sum(t is not None for t in together)

    got, ran = run("openvino")
    want, none = run("onnxruntime")
    assert (ran, none) == (3, 0)  # the three prefills on a past ran on OpenVINO, each in one forward
    for g, w in zip(got, want):
        assert np.abs(g - w).max() <= tolerance * np.abs(w).max()
        assert (g.argmax(axis=1) == w.argmax(axis=1)).mean() >= 0.5


def test_a_waves_cache_as_the_prefix_cache_keeps_it_is_its_slots_own_memory_and_each_rows_kv(tiny):
    """SlotCache.stored of prompts of one length in consecutive slots (a wave): views of the slots (no copy before
    the wave's first step), each row's keys and values those of PyTorch's forward of its prompt; rows of two lengths:
    copies, right-aligned."""
    from gpt2x.runtime.static_decode import SlotBackend

    model, info = tiny
    rng = np.random.default_rng(29)
    V = info.config.vocab_size
    backend = SlotBackend(info, slots=6, capacity=40)
    for lengths in ((5, 5, 5), (3, 6)):
        prompts = [rng.integers(0, V, n).tolist() for n in lengths]
        P = max(lengths)
        ids = np.array([[0] * (P - len(p)) + p for p in prompts])
        mask = (np.arange(P)[None] >= P - np.array([[len(p)] for p in prompts])).astype(np.int64)
        _, cache = backend.step(ids, mask, None, None)
        stored = cache.stored()
        assert all(np.shares_memory(a, b) for a, b in zip(stored, backend.decoder._arrays)) == (len(set(lengths)) == 1)
        for got, want in zip(stored, torch_past(model, prompts)):
            np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
        del cache, stored


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.int8])
def test_a_rows_logits_do_not_depend_on_what_the_other_slots_hold(tiny_export, precision):
    """A decode row's logits are a function of its own slot and token alone, bit for bit, for a given set of slots
    stepped: what the other slots hold (their tokens, lengths, whether they advance), and what its own slot holds beyond
    its length (a rollback's rejected positions, left in place: SlotCache.truncate), change nothing. This would fail on
    any CPU if an int8 graph quantized its activations with one scale for the step's rows (it quantizes each row's
    128-wide blocks: MatMulNBits' accuracy_level 4), or if the attention read past a row's seqlens_k. (What can change a
    row's int8 logits is the number of slots stepped: ONNX Runtime's int8 kernels round a row of one-row and of
    several-row steps differently by ~1e-7, and an activation's int8 rounding can turn that into ~1e-2 of the logits,
    measured on AVX-512 VNNI: tests/generation/test_speculative.py compares a rollback in the same slots.)"""
    info = tiny_export(precision)[2]
    rng = np.random.default_rng(17)
    V = info.config.vocab_size
    decoder = SlotDecoder(info, ProviderKind.cpu, slots=4, capacity=32, threads=1, mixed_prefill=True)
    decoder.prefill(1, rng.integers(0, V, 10))
    decoder.lengths[1] = 6  # rolled back: positions 6..9 left as they were
    decoder.prefill(3, rng.integers(0, V, 5))
    token = int(rng.integers(0, V))

    def step_slot_1(other: int, both: bool, take: bool = False) -> np.ndarray:
        """Slot 1's logits on `token` at position 6, slots 0..3 stepped (0 and 2 free), slot 3 on `other`
        (advancing where `both`), read from every slot's or (`take`) from slot 1's alone; slot 1 then rolled back."""
        lengths = decoder.lengths.copy()
        tokens, active = np.array([0, token, 0, other]), np.array([False, True, False, both])
        logits = decoder.step(tokens, active, take=np.array([1]))[0] if take else decoder.step(tokens, active)[1]
        decoder.lengths[:] = lengths
        return logits

    want = step_slot_1(0, both=False)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(step_slot_1(0, both=False, take=True), want)
    for other, both in ((int(rng.integers(0, V)), True), (0, False)):
        for a in decoder._arrays:  # slot 1's rejected positions, the free slots and slot 3 hold something else
            junk = rng.integers(-100, 100, a[:, :, 6:].shape) if a.dtype == np.int8 else rng.normal(0, 50, a[:, :, 6:].shape)
            a[:, :, 6:] = junk.astype(a.dtype)  # slot 1's from its next position on (which the step writes)
            a[[0, 2], :, :6] = junk[[0, 2], :, :6].astype(a.dtype)
        decoder.release(3)
        decoder.prefill(3, rng.integers(0, V, int(rng.integers(2, 9))))  # another row, of another length
        np.testing.assert_array_equal(step_slot_1(other, both), want)
