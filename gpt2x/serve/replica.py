"""What a replica is, whichever way it runs (single_process.py in this process, ray/ on Ray Serve):
what it loads (`ReplicaConfig`), where it serves (`ServeSettings`), its service opened and closed
(`open_service`, `close_service`), what the CLI reports (`describe`), and the draft it opens,
resolved by the command before any replica starts (`prepare_draft`). Nothing here imports Ray."""

from __future__ import annotations

import os
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..choices import BackendKind, KvCache, Progress, ProviderKind, no_progress
from ..errors import UsageError, installed
from ..generation.speculative import DraftSettings, ModelDrafter
from ..onnx.artifact import ExportInfo, read_export
from ..runtime.base import PAGED_PRECISIONS, Backend
from ..tokenizer import get_encoding
from ..workflows.backends import choose_backend, export_backend
from ..workflows.drafts import NGRAM_DRAFT, open_drafter, resolve_draft
from .core.engine import EngineSettings
from .core.prefix_disk import BlockIdentity
from .openai.chat_completion.template import export_template, find_template
from .openai.routes import MAX_BODY_BYTES, Cors
from .openai.service import CompletionService

APP_NAME = "gpt2x"
STOP_GRACE_S = 3.0  # at a stop, requests in flight get this long to finish before they end with an error
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SHUTTING_DOWN = "the server is shutting down"


@dataclass(frozen=True)
class ReplicaConfig:
    """What every replica needs to load and serve: sent to the replicas, so plain values only."""

    export: str  # the export folder, an absolute path that exists on every node
    model_id: str  # the name clients send as "model" (no request can name another, or a path)
    backend: str = BackendKind.ort.value
    provider: str = ProviderKind.cpu.value
    threads: int | None = None
    engine: EngineSettings = field(default_factory=EngineSettings)
    api_keys: tuple[str, ...] = ()  # any of them, as Authorization: Bearer KEY (none: no key needed)
    cors: Cors | None = None  # cross-origin requests answered (one replica in this process only)
    max_body_bytes: int = MAX_BODY_BYTES
    # ONNX Runtime's in-place KV cache (int8/int4 graphs). None: wherever the graph allows it; True
    # requires it, False refuses it. A batch's rows leave and join inside the in-place buffers
    # (kvbuffers.merge_rows, copying only the rows that move), and a step writes only its new
    # positions, where the growing cache copies the whole cache into new tensors every step (at 16
    # rows of ~560 positions, 0.7 GB a step). Fresh buffers are in small pages (ort.unset_arrays), so a
    # join into larger ones no longer pays for zeroing them whole. Measured with gpt2x loadtest on the
    # 2-core VM (2026-11-25, int8, c=16): 545 tok/s in place against 406 growing (TTFT p50 117 against
    # 106 ms), and 97 against 41 tok/s with 544-token prompts sharing 512-token prefixes.
    in_place_kv: bool | None = None
    # The fixed slots instead (runtime.static_decode.SlotBackend, fp32, int8 or int4 on the CPU; --kv-cache slots): a slot
    # per row, twice max_batch_size of them (the spare ones for a beam search or a prompt scored beside a full batch),
    # and a joining prompt's chunks run in the decode steps' forwards; on the openvino backend, its paged slots
    # (runtime.openvino_paged.PagedSlotBackend, fp32 and bf16). None (--kv-cache auto): the ort backend's exports on
    # the CPU that the slots run (runtime.static_decode.slots_by_default), the openvino backend's bf16 exports and fp32
    # ones with a prefill graph (runtime.openvino_paged.paged_by_default; `served_backend` takes that backend for them).
    fixed_slots: bool | None = False
    # Speculative decoding (core/engine.py, at max batch size 1): the draft as the user named it (int4,
    # int8, ngram, a model or export folder; None: none), and what each replica opens next to its
    # backend (workflows.open_drafter): `ngram` or the draft's export folder, resolved and exported by
    # the command before the server starts (prepare_draft); None: `draft` itself.
    draft: str | None = None
    draft_source: str | None = None
    draft_settings: DraftSettings = field(default_factory=DraftSettings)
    # Under Ray Serve, the application's hub (ray/hub.py's MetricsHub), by name: set by deploy.application.
    # None: each replica's /metrics is its own, and a stop is Ray Serve's alone.
    metrics_hub: str | None = None
    # /v1/chat/completions' Jinja2 template: the text of --chat-template's file (None: the export
    # folder's tokenizer_config.json chat_template, if it has one; openai/chat_completion/template.py)
    chat_template: str | None = None
    # Without either: gpt2x's default template (True), or chat refused with a 400 (--no-default-chat-template)
    default_chat_template: bool = True
    # A LoRA adapter's export served beside its base (--adapter NAME=FOLDER): the base's model id (/v1/models' parent)
    parent: str | None = None


@dataclass(frozen=True)
class ServeSettings:
    """Where and how many: replicas, the HTTP address, the Ray cluster (None: a local one, or none at
    all when embedded), and `ray`: Ray Serve even for one replica on this machine."""

    replicas: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    address: str | None = None
    cpus_per_replica: float = 1.0
    route_prefix: str = "/"
    app_name: str = APP_NAME
    ray: bool = False

    @property
    def embedded(self) -> bool:
        """One replica on this machine, in this process (serve_in_process), unless Ray is asked for."""
        return self.replicas == 1 and self.address is None and not self.ray

    def validate(self) -> None:
        if self.replicas < 1:
            raise UsageError(f"replicas must be at least 1, got {self.replicas}", option="replicas")
        if not 0 <= self.port <= 65535:
            raise UsageError(f"port must be in [0, 65535], got {self.port}", option="port")
        if self.port == 0 and not self.embedded:  # each node's proxy would take a port of its own
            raise UsageError("port 0 (a port the system chooses) is for one replica in this process; give Ray Serve "
                             "a port", option="port")
        if self.cpus_per_replica < 0:
            raise UsageError(f"cpus_per_replica must be >= 0, got {self.cpus_per_replica}", option="cpus_per_replica")
        if self.address is None:
            needed = self.replicas * self.cpus_per_replica
            if needed > (os.cpu_count() or 1):
                raise UsageError(f"replicas: {self.replicas} replicas of {self.cpus_per_replica:g} CPU need {needed:g} CPUs; "
                                 f"this machine has {os.cpu_count()} (fewer replicas, or a smaller cpus_per_replica)",
                                 option="replicas")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.route_prefix.rstrip('/')}"


def has_chat_template(export_folder: Path) -> bool:
    """Whether the export records a chat template of its own (tokenizer_config.json's)."""
    return export_template(export_folder) is not None


def open_service(config: ReplicaConfig, replica: str = "") -> CompletionService:
    """A replica's service: the export's backend (and draft) opened, its engine started."""
    info = read_export(Path(config.export))
    get_encoding()  # built now, not by the first request (~55 ms)
    backend = open_backend(config, info)
    drafter = None
    if config.draft is not None:  # on the target's backend and provider; a CPU draft gets 1 thread
        drafter = open_drafter(config.draft_source or config.draft, backend, BackendKind(config.backend),
                               ProviderKind(config.provider), None, config.draft_settings)
    return CompletionService(backend, config.engine, config.model_id, replica, drafter, config.draft_settings,
                             config.draft, find_template(Path(config.export), config.chat_template,
                                                           config.default_chat_template), block_identity(info, backend))


def open_backend(config: ReplicaConfig, info: ExportInfo) -> Backend:
    """The export's backend as a replica serves it, warmed up: the fixed slots (`on_slots`) or `config.backend`."""
    # The batch's rows never hold more slots than it has rows (the finished ones leave before joiners take theirs);
    # the spare ones, resident only once used, hold a beam search or a prompt scored beside a full batch.
    batch, provider, slots = config.engine.max_batch_size, ProviderKind(config.provider), on_slots(config, info)
    if slots and BackendKind(config.backend) is BackendKind.openvino:
        from ..runtime.openvino_paged import PagedSlotBackend, paged_kv_precision

        backend = PagedSlotBackend(info, provider, config.threads, slots=2 * batch,
                                   kv_cache_precision=paged_kv_precision(info))
    elif slots:
        from ..runtime.static_decode import SlotBackend, held_from_start

        backend = SlotBackend(info, provider, config.threads, slots=2 * batch,
                              resident=held_from_start(info, provider, batch))
    else:
        backend = export_backend(BackendKind(config.backend), info, ProviderKind(config.provider), config.threads,
                                 in_place_kv=config.in_place_kv)
    if backend.capabilities.warms_up:
        backend.warm_up()
    return backend


def served_backend(info: ExportInfo, provider: ProviderKind, kv_cache: KvCache = KvCache.auto, ort_asked: bool = False,
                   asked_as: str = "a bf16 export") -> BackendKind:
    """The backend a server runs the export on where none is asked: the openvino backend where its paged slots serve
    the export by default (runtime.openvino_paged.paged_over_ort: a bf16 export, or an fp32 one with an OpenVINO
    prefill graph that takes a past and no int8 KV cache) with --kv-cache auto or slots, unless what is asked is the ort backend's to run
    (`ort_asked`: an option of its own given, --prefill or --kv-cache-dtype, or a --draft, whose model runs on the
    target's runtime); else the precision's default (workflows.backends.choose_backend: ort, or openvino for bf16; `asked_as`
    names the export where bf16 is refused)."""
    kind = choose_backend(None, info.precision, provider, asked_as=asked_as)
    if kind is BackendKind.openvino or ort_asked or kv_cache not in (KvCache.auto, KvCache.slots) or info.prefill is None \
            or info.precision not in PAGED_PRECISIONS or not installed("openvino"):
        return kind
    from ..runtime.openvino_paged import paged_over_ort  # OpenVINO's module: where the export has its graph

    return BackendKind.openvino if paged_over_ort(info, provider) else kind


def paged_holds_int8_kv(info: ExportInfo, backend: BackendKind, kv_cache: KvCache) -> bool:
    """Whether a server of the export on `backend` with `kv_cache` holds an int8 KV cache on the openvino backend's
    paged slots: OpenVINO's u8 cache, where the export gated it (ExportInfo.paged_int8_kv)."""
    return backend is BackendKind.openvino and kv_cache in (KvCache.auto, KvCache.slots) and info.paged_int8_kv is not None


def on_slots(config: ReplicaConfig, info: ExportInfo) -> bool:
    """Whether the replica serves the export on the fixed slots: as asked, or by default (`fixed_slots` None) where the ort
    backend's slots run it (runtime.static_decode.slots_by_default), or the openvino backend's paged ones
    (runtime.openvino_paged.paged_by_default)."""
    if config.fixed_slots is not None:
        return config.fixed_slots
    if BackendKind(config.backend) is BackendKind.openvino:
        from ..runtime.openvino_paged import paged_by_default  # OpenVINO's module: the openvino backend's servers only

        return paged_by_default(info, ProviderKind(config.provider))
    if BackendKind(config.backend) is not BackendKind.ort:
        return False
    from ..runtime.static_decode import slots_by_default  # ONNX Runtime's module: the ort backend's servers only

    return slots_by_default(info, ProviderKind(config.provider))


def block_identity(info: ExportInfo, backend: Backend) -> BlockIdentity:
    """What the export's prefix-cache blocks depend on besides their tokens (their folder on disk): its files, the
    backend, and the dtype its cache stores (Capabilities.stores_kv_dtype; the others' float32, KVCache.stored), and
    where its cache holds another (Capabilities.kv_cache_dtype: a u8 cache's blocks, dequantized), that one's too."""
    caps = backend.capabilities
    kv_dtype = np.dtype(backend.kv_dtype).name if caps.stores_kv_dtype else "float32"
    name = backend.name if caps.kv_cache_dtype is None else f"{backend.name}, {caps.kv_cache_dtype} cache"
    return BlockIdentity(dict(info.meta["files"]), name, kv_dtype)


def listed_as(config: ReplicaConfig) -> tuple[int, str, str]:
    """What /v1/models lists of one of several models besides its id and parent, from its export's record: its
    context, its precision, and its root (its export; a LoRA adapter's export: the adapter's folder, as vLLM lists a
    LoRA module)."""
    info = read_export(Path(config.export))
    adapter = info.meta["model"].get("adapter") if config.parent is not None else None
    return info.config.n_positions, info.precision.value, adapter["path"] if adapter else config.export


def close_service(service: CompletionService) -> None:
    """The engine stopped, then what `open_service` opened closed (left open if the engine's thread
    could not be stopped: it still uses them)."""
    if service.close():
        service.backend.close()
        if isinstance(service.drafter, ModelDrafter):
            service.drafter.backend.close()


def describe(config: ReplicaConfig, settings: ServeSettings) -> dict:
    """What is served, for the CLI's report (no API key). `ray`: the cluster's address, "local" (a
    Ray instance of its own), or None (embedded: one process, no Ray)."""
    draft = {} if config.draft is None else {"draft": config.draft, "draft_settings": asdict(config.draft_settings)}
    ray = None if settings.embedded else settings.address or "local"
    return {"url": settings.url, "model": config.model_id, "export": config.export, "backend": config.backend,
            "provider": config.provider, "replicas": settings.replicas, "ray": ray,
            "engine": asdict(config.engine), **draft, "api_key": bool(config.api_keys),
            "cors": None if config.cors is None else asdict(config.cors),
            **({} if config.parent is None else {"parent": config.parent})}


def prepare_draft(draft: str, target: ExportInfo, backend: BackendKind = BackendKind.ort,
                  provider: ProviderKind = ProviderKind.cpu, revision: str | None = None,
                  progress: Progress = no_progress, notice: Progress = no_progress) -> str:
    """What the replicas open as the draft of `target` (run by `backend` on `provider`): `ngram`, or
    the absolute path of the draft's export (workflows.resolve_draft: exported first when missing).
    Run by the command before any replica starts, so that no replica exports anything or races
    another to do it, and what open_drafter would refuse in the replicas is refused here, in one line."""
    info = resolve_draft(draft, target.meta["model"]["name"], target.config.vocab_size, backend, provider, revision,
                         progress, notice)
    return NGRAM_DRAFT if info is None else str(info.folder.resolve())
