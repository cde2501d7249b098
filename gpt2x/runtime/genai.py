"""onnxruntime-genai backend (no torch): its Generator owns the KV cache and runs the model; gpt2x chooses every
token and genai only feeds it. genai 0.18 cannot feed a chosen token to a batch, so batches step through a
one-hot `set_logits` or a replay of their histories (padding, EOS and beam search: docs/backends.md).
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import onnxruntime_genai as og

from ..choices import ProviderKind
from ..errors import ArtifactError, ProviderError
from ..onnx import names as io
from ..onnx.artifact import ExportInfo
from ..onnx.interop import GENAI_CONFIG_FILE
from ..tokenizer import EOT_ID
from .base import GENAI_CAPABILITIES, GENAI_MAX_BATCH, Closable, Released
from .providers import CUDA_HELP, ORT_PROVIDERS, physical_cores, refuse_fp16_on_cpu

GENAI_PROVIDERS = {ProviderKind.cuda: "cuda"}  # genai's names; the CPU is its default (no provider)


class _Lane:
    """One genai Generator and, per row, every token it was fed (for replays)."""

    __slots__ = ("gen", "batch", "tokens", "length", "onehot", "owner")

    def __init__(self, gen, batch: int, capacity: int):
        self.gen = gen  # None for a row that has had no real token yet
        self.batch = batch
        self.tokens = np.empty((batch, capacity), dtype=np.int32)
        self.length = 0
        self.onehot: np.ndarray | None = None  # (batch, V) zeros, a 1 set per step then cleared
        self.owner: GenaiState | None = None  # the one state that may step this generator

    def record(self, ids: np.ndarray) -> None:
        n = ids.shape[1]
        self.tokens[:, self.length : self.length + n] = ids
        self.length += n


class GenaiState:
    """The past of a GenaiBackend: either one generator for the whole batch (`batched`, no padding)
    or one single-row generator per row, with the attention mask that places each row's real
    tokens. Stepping from a state makes it stale, as the generators it holds move on."""

    __slots__ = ("owner", "lanes", "batched", "mask")

    def __init__(self, owner: GenaiBackend, lanes: list[_Lane], batched: bool, mask: np.ndarray):
        self.owner = owner
        self.lanes = lanes
        self.batched = batched
        self.mask = mask  # (B, positions so far): the columns each row's tokens occupy
        for lane in lanes:
            lane.owner = self

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @property
    def stale(self) -> bool:
        return any(lane.owner is not self for lane in self.lanes)

    def reorder(self, rows: np.ndarray) -> GenaiState:
        """The rows gathered by `rows`, by replaying: genai cannot gather its cache."""
        return self.owner.reordered(self, rows)

    def to_numpy(self) -> list[np.ndarray]:
        """From genai's last present outputs; padding slots of a per-row state are zeros."""
        return self.owner.present_arrays(self)

    stored = to_numpy


class GenaiBackend(Closable):
    """One export folder on onnxruntime-genai, gpt2x's thread count and provider laid over its genai_config.json."""

    name = "genai"
    # The generator owns its cache: no past from elsewhere, no joins, no rollback.
    capabilities = GENAI_CAPABILITIES
    cache_forms = (GenaiState,)

    def __init__(self, info: ExportInfo, provider: ProviderKind = ProviderKind.cpu, threads: int | None = None):
        refuse_fp16_on_cpu(info, provider)
        refused = self.capabilities.refuse_export(self.name, info.folder, info.precision, provider)
        if refused is not None:
            raise refused
        if provider is not ProviderKind.cpu and ORT_PROVIDERS[provider] not in ort.get_available_providers():
            raise ProviderError(f"ONNX Runtime {ort.__version__} here has no {ORT_PROVIDERS[provider]}; {CUDA_HELP}")
        self.info = info
        self.model_name = info.meta["model"]["name"]
        self.cfg = info.config
        self.n_positions = self.cfg.n_positions
        self.vocab_size = self.cfg.vocab_size
        self.provider = provider
        self.model = self._load(info, provider, threads)
        self._params: dict[int, og.GeneratorParams] = {}
        self._present_names = io.output_names(self.cfg.n_layer)[1:]

    @staticmethod
    def _load(info: ExportInfo, provider: ProviderKind, threads: int | None):
        folder = info.folder
        if not (folder / GENAI_CONFIG_FILE).is_file():
            raise ArtifactError(f"{folder} has no {GENAI_CONFIG_FILE} (an export older than gpt2x's interop files: export it again)")
        overlay = {"model": {
            "eos_token_id": EOT_ID,
            "pad_token_id": -1,  # no id is padding: genai would read pads at the end of a row
            "decoder": {"session_options": {"intra_op_num_threads": threads or physical_cores(),
                                            "inter_op_num_threads": 1, "log_severity_level": 3}},
        }}
        try:
            config = og.Config(str(folder))
            config.overlay(json.dumps(overlay))
            config.clear_providers()
            if provider in GENAI_PROVIDERS:
                config.append_provider(GENAI_PROVIDERS[provider])
            if provider is ProviderKind.cuda:  # fp32 in fp32, as gpt2x's own sessions (providers.create_session)
                config.set_provider_option(GENAI_PROVIDERS[provider], "use_tf32", "0")
            model = og.Model(config)
        except Exception as e:  # genai raises RuntimeError with ORT's or its own message
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            error = ProviderError if provider is not ProviderKind.cpu and "cuda" in first.lower() else ArtifactError
            raise error(f"onnxruntime-genai cannot load {folder} on {provider.value}: {first}") from None
        if model.device_type.lower() != ("cpu" if provider is ProviderKind.cpu else GENAI_PROVIDERS[provider]):
            raise ProviderError(f"onnxruntime-genai opened {folder} on {model.device_type}, not {provider.value}; {CUDA_HELP}")
        return model

    # -- generators

    def _generator(self, batch: int):
        params = self._params.get(batch)
        if params is None:
            params = og.GeneratorParams(self.model)
            # Greedy and no logits processing: generate_next_token then takes the one-hot's token.
            params.set_search_options(batch_size=batch, max_length=self.n_positions, min_length=0, do_sample=False,
                                      num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0)
            self._params[batch] = params
        return og.Generator(self.model, params)

    def _new_lane(self, batch: int, tokens: np.ndarray) -> _Lane:
        """A lane with a fresh generator of `batch` rows, fed `tokens` (batch, L)."""
        lane = _Lane(self._generator(batch), batch, self.n_positions)
        self._append(lane, tokens)
        return lane

    @staticmethod
    def _append(lane: _Lane, ids: np.ndarray) -> None:
        lane.gen.append_tokens(np.ascontiguousarray(ids, dtype=np.int32))
        lane.record(ids)

    def _replay(self, lane: _Lane) -> None:
        """Feed the lane's generator its whole history again, as one prefill."""
        lane.gen.rewind_to(0)
        lane.gen.append_tokens(lane.tokens[:, : lane.length])

    @staticmethod
    def _logits(lane: _Lane, n: int, last_only: bool) -> np.ndarray:
        """The last `n` positions' logits (batch, n, V) of the lane's last run, or the last one's (batch, V)."""
        if last_only:
            return lane.gen.get_logits().reshape(lane.batch, -1)
        out = lane.gen.get_output(io.LOGITS)
        return out[:, out.shape[1] - n :]

    def close(self) -> None:
        self.model = Released(self.name)
        self._params.clear()

    # -- running

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past):
        return self._feed(input_ids, attention_mask, past, last_only=False)

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past):
        return self._feed(input_ids, attention_mask, past, last_only=True)

    def _feed(self, ids: np.ndarray, mask: np.ndarray, past: GenaiState | None, last_only: bool):
        if isinstance(self.model, Released):  # closed: onnxruntime-genai would be handed the stand-in
            self.model.model  # noqa: B018 (raises the one-line ProviderError)
        B, T = ids.shape
        width = 0 if past is None else past.length
        if mask.shape != (B, width + T) or (past is not None and past.rows != B):
            rows = B if past is None else past.rows
            raise ValueError(f"attention_mask is {mask.shape}; the cache holds {rows} rows of {width} positions, "
                             f"and {B} x {T} new ids were given")
        if width + T > self.n_positions:
            raise ValueError(f"{width} + {T} positions exceed the model's context ({self.n_positions})")
        if past is not None and past.stale:
            raise ValueError("this cache was already stepped from (or reordered); step from the cache the last step returned")
        new_mask = mask[:, width:]
        if past is None:
            if new_mask.all() and B <= GENAI_MAX_BATCH:
                lane = self._new_lane(B, ids)
                return self._logits(lane, T, last_only), GenaiState(self, [lane], True, mask)
            past = GenaiState(self, [_Lane(None, 1, self.n_positions) for _ in range(B)], False, mask[:, :0])
        elif past.batched and not new_mask.all():
            past = self._split(past)
        if past.batched:
            return self._step_batched(past.lanes[0], ids, last_only), GenaiState(self, past.lanes, True, mask)
        return self._step_rows(past.lanes, ids, new_mask, last_only), GenaiState(self, past.lanes, False, mask)

    def _step_batched(self, lane: _Lane, ids: np.ndarray, last_only: bool) -> np.ndarray:
        T = ids.shape[1]
        if lane.batch == 1:  # genai's continuous decoding: a single row appends any tokens
            self._append(lane, ids)
        elif T == 1 and not (ids == EOT_ID).any():
            self._step_onehot(lane, ids[:, 0])
            lane.record(ids)
        else:  # several tokens, or EOS: genai would not feed them as given
            lane.record(ids)
            self._replay(lane)
        return self._logits(lane, T, last_only)

    def _step_onehot(self, lane: _Lane, tokens: np.ndarray) -> None:
        if lane.onehot is None:
            lane.onehot = np.zeros((lane.batch, self.vocab_size), dtype=np.float32)
        rows = np.arange(lane.batch)
        lane.onehot[rows, tokens] = 1.0
        lane.gen.set_logits(lane.onehot)  # copied into genai's logits
        lane.onehot[rows, tokens] = 0.0
        lane.gen.generate_next_token()
        picked = lane.gen.get_next_tokens()
        if not np.array_equal(picked, tokens):
            raise RuntimeError(f"onnxruntime-genai fed {picked.tolist()} instead of {tokens.tolist()}")

    def _step_rows(self, lanes: list[_Lane], ids: np.ndarray, new_mask: np.ndarray, last_only: bool) -> np.ndarray:
        B, T = ids.shape
        logits = np.zeros((B, self.vocab_size) if last_only else (B, T, self.vocab_size), dtype=np.float32)
        for r, lane in enumerate(lanes):
            real = new_mask[r].astype(bool)
            n = int(real.sum())
            if not n:
                continue
            row = ids[r : r + 1, real]
            if lane.gen is None:
                lane.gen = self._generator(1)
            self._append(lane, row)
            if last_only:
                logits[r] = self._logits(lane, n, True)[0]
            else:
                logits[r, real] = self._logits(lane, n, False)[0]
        return logits

    def _split(self, past: GenaiState) -> GenaiState:
        """A batched state as single-row generators (for a step that brings padding)."""
        lane = past.lanes[0]
        rows = [self._new_lane(1, lane.tokens[r : r + 1, : lane.length]) for r in range(lane.batch)]
        return GenaiState(self, rows, False, past.mask)

    def reordered(self, past: GenaiState, rows: np.ndarray) -> GenaiState:
        """GenaiState.reorder."""
        if past.stale:
            raise ValueError("this cache was already stepped from (or reordered); reorder the cache the last step returned")
        rows = np.asarray(rows, dtype=np.int64)
        mask = past.mask[rows]
        if not past.batched:
            taken: set[int] = set()
            lanes = []
            for r in rows.tolist():
                src = past.lanes[r]
                if r in taken and src.gen is not None:
                    src = self._new_lane(1, src.tokens[:, : src.length])
                elif r in taken:
                    src = _Lane(None, 1, self.n_positions)
                taken.add(r)
                lanes.append(src)
            return GenaiState(self, lanes, False, mask)
        lane = past.lanes[0]
        if rows.size == lane.batch and np.array_equal(rows, np.arange(lane.batch)):
            return GenaiState(self, [lane], True, mask)
        gathered = lane.tokens[rows, : lane.length]
        if rows.size == lane.batch and lane.batch > 1:  # the same batch size: rewind this generator
            lane.tokens[:, : lane.length] = gathered
            self._replay(lane)
            return GenaiState(self, [lane], True, mask)
        if rows.size > GENAI_MAX_BATCH:
            return GenaiState(self, [self._new_lane(1, gathered[r : r + 1]) for r in range(rows.size)], False, mask)
        return GenaiState(self, [self._new_lane(rows.size, gathered)], True, mask)

    # -- the cache in gpt2x's layout

    def present_arrays(self, present: GenaiState) -> list[np.ndarray]:
        """GenaiState.to_numpy."""
        if present.stale:
            raise ValueError("this cache was already stepped from (or reordered); read the cache the last step returned")
        if present.batched:
            lane = present.lanes[0]
            return [lane.gen.get_output(n)[:, :, : lane.length].astype(np.float32) for n in self._present_names]
        B, P = present.mask.shape
        shape = (B, self.cfg.n_head, P, self.cfg.head_dim)
        out = [np.zeros(shape, dtype=np.float32) for _ in self._present_names]
        for r, lane in enumerate(present.lanes):
            if lane.gen is None:
                continue
            cols = np.flatnonzero(present.mask[r])
            for arr, n in zip(out, self._present_names):
                arr[r][:, cols] = lane.gen.get_output(n)[0, :, : lane.length]
        return out

    def peak_device_memory_mb(self) -> float | None:
        return None
