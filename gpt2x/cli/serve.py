"""`gpt2x serve`: an export behind an OpenAI-compatible completions API, in this process (one replica on
this machine: serve/single_process.py) or on Ray Serve (replicas, a cluster, or `--ray`: serve/ray/)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..bench.results import BenchResult
from ..bench.system import cpu_model
from ..choices import BackendKind, KvCache, Precision, ProviderKind
from ..errors import MissingDependencyError, UsageError
from ..generation.speculative import DraftSettings
from ..onnx.artifact import METADATA_FILE
from ..runtime.providers import physical_cores
from ..runtime.registry import capabilities_of, named, refuse_unsupported
from ..serve.core.prefix_cache import DEFAULT_PREFIX_CACHE_MB
from ..serve.core.prefix_disk import DEFAULT_PREFIX_CACHE_DISK_MB
from ..serve.core.scheduler import EngineSettings
from ..workflows.adapters import check_adapters, parse_adapters
from ..workflows.backends import choose_backend, require_provider
from ..workflows.drafts import DRAFT_HELP
from ..workflows.exports import resolve_export
from .options import (
    SERVED_BACKEND_DEFAULT,
    ExportsOpt,
    KvCacheOpt,
    KvDtypeOpt,
    NumSpeculativeTokensOpt,
    PrecisionOpt,
    PrefillOpt,
    RevisionOpt,
    Status,
    ThreadsOpt,
    err,
    given_by_user,
    notice,
    ort_options_given,
    out,
    progress_to,
    read_api_keys,
    read_chat_template,
    read_text_file,
    refuse_int8_kv,
    refuse_kv_cache,
)

EPILOG = ("Examples:\n\n"
    "  gpt2x serve --model shakespeare\n\n"
    "  gpt2x serve --onnx ~/.cache/gpt2x/exported/gpt2-int8 --replicas 2 --port 8000\n\n"
    "  gpt2x serve --model gpt2 --precision fp16 --provider cuda\n\n"
    "  gpt2x serve --model gpt2 --draft int8 --num-speculative-tokens 6\n\n"
    "  gpt2x serve --model shakespeare --model gpt2 --models-max 1\n\n"
    "  gpt2x serve --model gpt2 --adapter poet=./poet-lora --adapter legal=./legal-lora\n\n"
    "  gpt2x serve --onnx /mnt/exports/gpt2-int8 --address ray://HEAD:10001 --host 0.0.0.0 --api-key \"$KEY\"\n\n"
    "Then: curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' "
    "-d '{\"prompt\": \"ROMEO:\", \"max_tokens\": 32}'")

# Not served: the reference (capabilities.reference) and a backend run in a page to measure it (capabilities.page).
SERVED = (BackendKind.ort, BackendKind.openvino, BackendKind.genai)
SERVE_MODULES = ("fastapi", "uvicorn", "httpx", "prometheus_client", "jinja2")  # the serve extra
RAY_MODULES = ("ray",)  # the ray extra: --replicas > 1, --address, --ray


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require_serve_extra() -> None:
    missing = [m for m in SERVE_MODULES if not _installed(m)]
    if missing:
        raise MissingDependencyError(f"gpt2x serve needs {', '.join(missing)}: pip install 'gpt2x[serve]'")


def require_ray_extra(why: str) -> None:
    """Ray Serve, for `why` (the option that asks for it); one machine's one replica runs without it."""
    missing = [m for m in RAY_MODULES if not _installed(m)]
    if missing:
        raise MissingDependencyError(f"gpt2x serve {why} serves through Ray Serve, which needs {', '.join(missing)}: "
                                     "pip install 'gpt2x[ray]'")


def from_bench(ctx: typer.Context, path: Path, backend: BackendKind | None, provider: ProviderKind, precision: Precision | None,
               max_batch_size: int | None) -> tuple[BackendKind, ProviderKind, Precision, int | None]:
    """--from-bench: the served configuration a saved `gpt2x bench` measured fastest at decoding; a flag
    given on the command line wins over it."""
    result = BenchResult.from_user_file(read_text_file(path, "--from-bench file"), f"--from-bench {path}")
    # The served batch decides where it was measured: the fastest at batch 4 need not be the fastest at 16.
    best = (max_batch_size is not None and result.best("decode", among=SERVED, batch=max_batch_size)) or \
        result.best("decode", among=SERVED)
    if best is None:
        raise UsageError(f"--from-bench {path}: it measured no configuration of {', '.join(k.value for k in SERVED)} "
                         "that passed its parity gate")
    env, here = result.environment, (cpu_model(), physical_cores())
    if (env.cpu, env.cores) != here:
        notice(f"warning: --from-bench {path} was measured on {env.cpu} ({env.cores} cores), "
               f"not on this machine ({here[0]}, {here[1]} cores)")

    def given(name: str) -> bool:
        return given_by_user(ctx, name)

    backend = backend if given("backend") else best.backend
    provider = provider if given("provider") else result.settings.provider
    precision = precision if precision is not None else best.precision
    if max_batch_size is not None and best.batch != max_batch_size:
        notice(f"note: {path} measured no decoding at batch {max_batch_size}, the batch served; its choice is the "
               f"fastest at batch {best.batch} (gpt2x bench --batch lists the batches it measures)")
    if max_batch_size is None and best.batch > 1:
        max_batch_size = best.batch
    notice(f"from {path}: --backend {backend.value} --provider {provider.value} --precision {precision.value}"
           + ("" if max_batch_size is None else f" --max-batch-size {max_batch_size}")
           + f" (measured {best.decode_tokens_per_s:.1f} decode tok/s at batch {best.batch})")
    return backend, provider, precision, max_batch_size


def export_sources(models: list[str], onnx_dirs: list[Path], models_dir: Path | None) -> list[tuple[str | None, Path | None]]:
    """What to serve, as (model, export folder) pairs for resolve_export, in order: each --model, each --onnx, then
    every export in --models-dir (by folder name). One --model with one --onnx is that one export, checked against
    the model (as with a single model always); none at all: the default model."""
    if len(models) <= 1 and len(onnx_dirs) <= 1 and models_dir is None:
        return [(models[0] if models else None, onnx_dirs[0] if onnx_dirs else None)]
    found: list[Path] = []
    if models_dir is not None:
        if not models_dir.is_dir():
            raise UsageError(f"--models-dir {models_dir} is not a folder", option="models-dir")
        found = sorted(d for d in models_dir.iterdir() if (d / METADATA_FILE).is_file())
        if not found:
            raise UsageError(f"--models-dir {models_dir} holds no export (no subfolder with a {METADATA_FILE})",
                             option="models-dir")
    return [(m, None) for m in models] + [(None, d) for d in [*onnx_dirs, *found]]


def cors_settings(origins: Optional[str], methods: str, headers: str, credentials: bool):
    """--allowed-origins and its companions as routes.Cors (None: no cross-origin requests answered); one UsageError
    line for a value that is not a JSON list of strings."""
    from ..serve.openai.routes import Cors

    if origins is None:
        if credentials:
            raise UsageError("--allow-credentials needs --allowed-origins", option="allow-credentials")
        return None
    lists = {name: _json_list(value, name) for name, value in
             (("allowed-origins", origins), ("allowed-methods", methods), ("allowed-headers", headers))}
    return Cors(lists["allowed-origins"], lists["allowed-methods"], lists["allowed-headers"], credentials)


def _json_list(value: str, option: str) -> tuple[str, ...]:
    try:
        items = json.loads(value)
    except ValueError:
        items = None
    if not isinstance(items, list) or not all(isinstance(i, str) and i for i in items):
        raise UsageError(f"--{option} must be a JSON list of strings, as vLLM's (e.g. '[\"https://example.org\"]'), "
                         f"got {value[:60]!r}", option=option)
    return tuple(items)


def serve(
    ctx: typer.Context,
    model: Annotated[Optional[list[str]], typer.Option(
        "--model", "-m", help="As for `export` (default: shakespeare); checked against --onnx metadata when given. "
        "Repeatable: several models in one server, routed by the request's `model` (docs/serving/index.md).")] = None,
    revision: RevisionOpt = None,
    exports: ExportsOpt = None,
    prefill: PrefillOpt = None,
    kv_cache_dtype: KvDtypeOpt = None,
    precision: PrecisionOpt = None,
    onnx_dir: Annotated[Optional[list[Path]], typer.Option(
        "--onnx", help="Export folder (default: EXPORTS/MODEL-PRECISION, see --exports; made first if missing). "
        "Repeatable, and with --model: each a model of its own (one --model with one --onnx: that export).")] = None,
    models_dir: Annotated[Optional[Path], typer.Option(
        help="Serve every export in this folder (each subfolder with a gpt2x.json), after any --model and --onnx.",
        show_default=False)] = None,
    adapter: Annotated[Optional[list[str]], typer.Option(
        "--adapter", metavar="NAME=FOLDER", show_default=False,
        help="A PEFT LoRA adapter folder served as the model NAME beside the one --model: merged into its weights "
        "and exported once (as `gpt2x export --adapter`, reused on restart). Repeatable; needs the adapters extra "
        "(docs/serving/index.md#lora-adapters).")] = None,
    models_max: Annotated[Optional[int], typer.Option(min=1, show_default=False,
        help="Several models: keep at most this many loaded; each loads on its first request, and the least recently "
        "used idle one is closed to make room (default: every model loaded at start).")] = None,
    idle_unload_s: Annotated[Optional[float], typer.Option(show_default=False,
        help="Several models: close a model idle this many seconds (loaded again on its next request).")] = None,
    backend: Annotated[Optional[BackendKind], typer.Option(
        help=f"Runtime of each replica: ort, openvino or genai ({SERVED_BACKEND_DEFAULT}).", show_default=False)] = None,
    provider: Annotated[ProviderKind, typer.Option(help="Device of each replica.")] = ProviderKind.cpu,
    threads: ThreadsOpt = None,
    replicas: Annotated[int, typer.Option(help="Replicas, each with the model loaded once.")] = 1,
    host: Annotated[str, typer.Option(help="Address to bind (127.0.0.1: this machine only; 0.0.0.0 for every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port (0: one the system chooses, told in the ready line; one replica in this process only).")] = 8000,
    address: Annotated[Optional[str], typer.Option(help="An existing Ray cluster (ray://HEAD:10001 or auto) instead of a local Ray instance.")] = None,
    use_ray: Annotated[bool, typer.Option("--ray", help=(
        "Serve through Ray Serve even with one replica on this machine (by default one replica runs in this "
        "process, without Ray; more replicas, or --address, always use Ray)."))] = False,
    api_key: Annotated[Optional[list[str]], typer.Option(envvar="GPT2X_API_KEY", show_default=False,
        help="Require Authorization: Bearer KEY on every request but /health and /version; repeatable, any of the "
        "keys given is accepted (GPT2X_API_KEY: keys separated by spaces).")] = None,
    api_key_file: Annotated[Optional[Path], typer.Option(show_default=False,
        help="More keys, one a line (blank lines and lines starting with # skipped), as llama-server's.")] = None,
    allowed_origins: Annotated[Optional[str], typer.Option(show_default=False,
        help='Answer cross-origin requests from browser pages of these origins: a JSON list (vLLM\'s flag), '
        'e.g. \'["https://example.org"]\' or \'["*"]\'. Default: none (vLLM\'s is every origin). One replica in '
        'this process only.')] = None,
    allowed_methods: Annotated[str, typer.Option(help="With --allowed-origins: the methods allowed, a JSON list.")] = '["*"]',
    allowed_headers: Annotated[str, typer.Option(help="With --allowed-origins: the headers allowed, a JSON list.")] = '["*"]',
    allow_credentials: Annotated[bool, typer.Option(
        "--allow-credentials", help="With --allowed-origins: allow credentials (cookies, Authorization).")] = False,
    served_model_name: Annotated[Optional[list[str]], typer.Option(
        help="The model id clients send (default: the export's model name); with several models, once per model, in "
        "their order (every --model, then every --onnx, then --models-dir's).")] = None,
    max_batch_size: Annotated[Optional[int], typer.Option(
        help="Requests decoded together per replica (1: no batching). Default: 16, or 1 with --draft.", show_default=False)] = None,
    max_waiting: Annotated[int, typer.Option(help="Requests waiting per replica; more are answered 429.")] = 64,
    continuous: Annotated[bool, typer.Option(help="Waiting requests join a running batch between decode steps (--no-continuous: static batches).")] = True,
    batch_wait_ms: Annotated[Optional[float], typer.Option(
        help="A new batch waits up to this long for requests arriving together (0: later ones join at the next step). "
        "Default: after a batch that ran several rows at once, or where several requests wait already, until requests "
        "stop arriving for 5 ms (20 ms at most); none for a lone request after a batch of one.", show_default=False)] = None,
    prefix_cache_mb: Annotated[float, typer.Option(
        help="Host memory per replica for the KV of prompt prefixes, reused by later prompts that begin the same way "
        "(automatic prefix caching; 0: off).")] = DEFAULT_PREFIX_CACHE_MB,
    prefix_cache_dir: Annotated[Optional[Path], typer.Option(
        help="Keep the prefix cache's blocks in this folder too (a folder per export, each block checked before use), "
        "so that a restarted server serving the same export reads them back instead of prefilling again.",
        show_default=False)] = None,
    prefix_cache_disk_mb: Annotated[float, typer.Option(
        help="With --prefix-cache-dir: at most this much disk per export, the least recently used blocks removed "
        "first.")] = DEFAULT_PREFIX_CACHE_DISK_MB,
    prefill_chunk: Annotated[Optional[int], typer.Option(
        help="Prompts joining a running batch are prefilled this many tokens per decode step, so running requests "
        "keep streaming (0: whole); whole too where the joiners outnumber the requests running. Default: on the fixed "
        "slots (--kv-cache slots), whose chunks run in the decode step's own forward, 24 and one more per request "
        "running (8 at int8 and int4 on a CPU without VNNI or AMX, 20 at fp32 without AVX-512; the openvino backend's "
        "paged slots: 64 on a CPU with AMX, 40 without); 256 elsewhere.",
        show_default=False)] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(
        help="The step's token budget (vLLM's): a joining prompt's chunk is what the running requests leave of it, one "
        "token each, in place of --prefill-chunk (keep it well above the requests that run at once: at or below them a "
        "chunk is one token). With --kv-cache slots the chunk runs in the decode step's own forward, so a step costs "
        "about this many tokens.", show_default=False)] = None,
    scheduling_policy: Annotated[str, typer.Option(
        help="Which waiting request runs next: fcfs (arrival order) or priority (a request's `priority`, lowest "
        "first; arrival order among equals).")] = "fcfs",
    cpus_per_replica: Annotated[float, typer.Option(help="CPUs Ray reserves for each replica.")] = 1.0,
    kv_cache: KvCacheOpt = KvCache.auto,
    draft: Annotated[Optional[str], typer.Option(
        help=f"Speculative decoding with this draft: {DRAFT_HELP}. The output is the target's own. "
        "Each replica then decodes one request at a time (max batch size 1).")] = None,
    num_speculative_tokens: NumSpeculativeTokensOpt = DraftSettings.num_speculative_tokens,
    draft_adaptive: Annotated[bool, typer.Option(
        help="Adapt K to acceptance and fall back to plain decoding while drafting does not pay (timed); "
        "--no-draft-adaptive always drafts K, so that a seeded sampled request is reproduced exactly "
        "(as gpt2x generate --draft D --no-draft-adaptive gives it).")] = True,
    chat_template: Annotated[Optional[str], typer.Option(
        "--chat-template", metavar="FILE|TEXT", help="A Jinja2 chat template, a file or the template's text, for /v1/chat/completions (default: the export's "
        "tokenizer_config.json chat_template, else gpt2x's default one, a play's script).", show_default=False)] = None,
    default_chat_template: Annotated[bool, typer.Option(
        help="Where neither --chat-template nor the export gives a chat template, chat with gpt2x's default one, "
        "saying so in one line at start (llama-server's behaviour); --no-default-chat-template answers chat "
        "requests 400 instead.")] = True,
    bench_file: Annotated[Optional[Path], typer.Option(
        "--from-bench", help="Serve the configuration this saved `gpt2x bench --output FILE` measured fastest at decoding "
        "(backend, provider, precision and, above batch 1, --max-batch-size), at --max-batch-size where given and measured; "
        "flags given here win.",
        show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print what is served as one JSON line on stdout once ready.")] = False,
) -> None:
    """Serve an export with an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /version, /metrics, /tokenize, /detokenize) until Ctrl-C or SIGTERM (to it or its process group): requests in flight get 3 s, then it stops.
    One replica on this machine runs in this process; --replicas N > 1, --address or --ray serve through Ray Serve."""
    require_serve_extra()
    # deferred: FastAPI and uvicorn are the serve extra (Ray Serve the ray extra), and the CLI starts without them
    from ..serve.core.engine import refuse_batched_draft
    from ..serve.replica import (
        ReplicaConfig,
        ServeSettings,
        describe,
        has_chat_template,
        paged_holds_int8_kv,
        prepare_draft,
        served_backend,
    )
    from ..serve.single_process import serve_in_process

    if bench_file is not None:
        backend, provider, precision, max_batch_size = from_bench(ctx, bench_file, backend, provider, precision, max_batch_size)
    asked_backend = backend  # None: each model on the backend its export's record runs by default
    backend = choose_backend(backend, precision, provider, next(iter(onnx_dir or ()), None))
    if backend not in SERVED:
        caps = capabilities_of(backend)
        why = "is the reference" if caps.reference else f"runs the export in a browser page ({caps.runtime}), to measure it there"
        raise UsageError(f"--backend {backend.value} {why}; it is not served: serve an export with {named(list(SERVED))}")
    if batch_wait_ms is not None and batch_wait_ms < 0:  # checked here: the engine's own check would name its seconds field
        raise UsageError(f"--batch-wait-ms must be >= 0, got {batch_wait_ms:g}")
    if max_batch_size is None:
        max_batch_size = 1 if draft is not None else 16
    # read here: the replicas are sent its text, not a path they may lack
    template = None if chat_template is None else read_chat_template(chat_template)
    keys = tuple(api_key or ()) + (read_api_keys(api_key_file) if api_key_file is not None else ())
    cors = cors_settings(allowed_origins, allowed_methods, allowed_headers, allow_credentials)
    draft_settings = DraftSettings(num_speculative_tokens=num_speculative_tokens, adaptive=draft_adaptive)
    engine = EngineSettings(max_batch_size=max_batch_size, max_waiting=max_waiting, continuous=continuous,
                            batch_wait_s=None if batch_wait_ms is None else batch_wait_ms / 1000, prefill_chunk=prefill_chunk,
                            max_num_batched_tokens=max_num_batched_tokens,
                            prefix_cache_mb=prefix_cache_mb,
                            prefix_cache_dir=None if prefix_cache_dir is None else str(prefix_cache_dir.resolve()),
                            prefix_cache_disk_mb=prefix_cache_disk_mb,
                            scheduling_policy=scheduling_policy)
    settings = ServeSettings(replicas=replicas, host=host, port=port, address=address, cpus_per_replica=cpus_per_replica,
                             ray=use_ray)
    settings.validate()
    sources = export_sources(list(model or ()), list(onnx_dir or ()), models_dir)
    names = list(served_model_name or ())
    if names and len(names) != len(sources):
        raise UsageError(f"--served-model-name is given {len(names)} time(s) for {len(sources)} model(s): give it once "
                         "per model, in their order, or not at all", option="served-model-name")
    adapters = parse_adapters(list(adapter or ()), list(model or ()), list(onnx_dir or ()), models_dir, names)
    several = len(sources) > 1 or bool(adapters) or models_max is not None or idle_unload_s is not None
    if (models_max is not None or idle_unload_s is not None) and not settings.embedded:  # before Ray is asked for
        raise UsageError("--models-max and --idle-unload-s load and close models in the one-process server; on Ray "
                         "Serve each model is a deployment that stays loaded: drop them, or --replicas, --address and "
                         "--ray", option="models-max" if models_max is not None else "idle-unload-s")
    if idle_unload_s is not None and idle_unload_s <= 0:
        raise UsageError(f"--idle-unload-s must be > 0, got {idle_unload_s:g}", option="idle-unload-s")
    if (len(sources) > 1 or adapters) and draft is not None:
        raise UsageError("--draft serves one model: give a single --model or --onnx", option="draft")
    if not settings.embedded and cors is not None:  # Ray Serve's ingress app is built before any config reaches it
        raise UsageError("--allowed-origins is served by one replica in this process; with Ray Serve, answer "
                         "cross-origin requests in front of it (a reverse proxy)", option="allowed-origins")
    if not settings.embedded:  # before the export is prepared: the one line comes at once
        require_ray_extra(f"--replicas {replicas}" if replicas > 1 else f"--address {address}" if address else "--ray")
    if draft is not None:
        refuse_batched_draft(max_batch_size)
    refuse_kv_cache(kv_cache, backend, served=True, precision=precision, provider=provider)
    refuse_int8_kv(precision, None if any(folder is None for _, folder in sources) else sources[0][1])
    if address is None:
        require_provider([backend], provider)
    if precision is not None:  # before an export is made that the backend would refuse
        refuse_unsupported(backend, provider, precision)
    check_adapters(adapters, sources[0][0], revision)  # each read against the base, before any export
    configs = []
    with Status("preparing the export") as status:
        # every source, then each adapter: the base (sources[0]) with it merged in, exported once, as a model of its own
        for i, (name, folder, lora) in enumerate([*((m, f, None) for m, f in sources), *((sources[0][0], None, a) for a in adapters)]):
            info = resolve_export(name, revision, precision, folder, progress=progress_to(status), notice=notice,
                                  adapter=None if lora is None else lora.folder)
            model_backend = backend if asked_backend is not None else \
                served_backend(info, provider, kv_cache, ort_asked=ort_options_given(ctx, info) or draft is not None,
                               asked_as=f"{info.folder}, a bf16 export,")
            refuse_int8_kv(info.precision, info.folder, model_backend,
                           paged_holds=paged_holds_int8_kv(info, model_backend, kv_cache))
            if model_backend is not backend:  # not the first folder's (a bf16 export beside others): checked as it was
                refuse_kv_cache(kv_cache, model_backend, served=True, precision=info.precision, provider=provider)
                if address is None:
                    require_provider([model_backend], provider)
            refuse_unsupported(model_backend, provider, info.precision)  # a folder's, before any replica starts
            draft_source = None if draft is None else prepare_draft(draft, info, model_backend, provider, revision,
                                                                     progress=progress_to(status), notice=notice)
            configs.append(ReplicaConfig(
                export=str(info.folder.resolve()),
                model_id=lora.name if lora else names[i] if names else info.meta["model"]["name"],
                parent=None if lora is None else configs[0].model_id,
                backend=model_backend.value, provider=provider.value,
                threads=threads if threads or replicas == 1 else max(1, int(cpus_per_replica)),
                engine=engine, api_keys=keys, cors=cors, draft=draft, draft_source=draft_source,
                draft_settings=draft_settings, chat_template=template, default_chat_template=default_chat_template,
                in_place_kv=kv_cache.in_place_kv,
                fixed_slots=None if kv_cache is KvCache.auto else kv_cache is KvCache.slots,
            ))
            if template is None and default_chat_template and not has_chat_template(info.folder):
                notice(f"warning: {info.folder} has no chat template: /v1/chat/completions uses gpt2x's default (a "
                       "play's script; --chat-template FILE for another, --no-default-chat-template to refuse chat)")
    ids = [c.model_id for c in configs]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise UsageError(f"two models would be served as {twice[0]!r} ({', '.join(c.export for c in configs if c.model_id == twice[0])}): "
                         "give each its own --served-model-name", option="served-model-name")
    config = configs[0]
    if host not in ("127.0.0.1", "localhost", "::1") and not keys:
        notice(f"warning: serving on {host} without an API key (--api-key or GPT2X_API_KEY)")

    def ready(url: str) -> None:
        status.__exit__(None, None, None)
        if as_json:  # `url`, not the settings': the port the system chose for --port 0
            more = {"models": [{**describe(c, settings), "url": url} for c in configs]} if several else {}
            print(json.dumps({**describe(config, settings), "url": url, **more}), flush=True)
        else:
            with_draft = "" if draft is None else f", draft {draft}"
            where = "in this process" if settings.embedded else "on Ray Serve"
            backends = "/".join(dict.fromkeys(c.backend for c in configs))
            out.print(f"serving {', '.join(ids)} at {url}/v1 ({replicas} replica(s) {where}, {backends} on "
                      f"{provider.value}{with_draft}); Ctrl-C to stop", markup=False)
        err.print(f"try: curl {url}/v1/completions -H 'Content-Type: application/json' "
                  f"-d '{{\"prompt\": \"ROMEO:\", \"max_tokens\": 32}}'", markup=False, soft_wrap=True)
        err.print(f"or chat in a browser: {url}/playground", markup=False, soft_wrap=True)

    if several and settings.embedded:
        def run(config, settings, ready, progress):
            serve_in_process(config, settings, ready, progress, others=configs[1:], max_loaded=models_max,
                             idle_unload_s=idle_unload_s)
    elif settings.embedded:
        run = serve_in_process
    else:  # deferred further: importing Ray takes seconds the embedded path does not spend
        from ..serve.ray.deploy import serve_until_stopped

        def run(config, settings, ready, progress):
            serve_until_stopped(config, settings, ready, progress, others=configs[1:])
    status = Status("starting" if settings.embedded else "starting Ray Serve")
    status.__enter__()
    try:
        run(config, settings, ready, progress_to(status))
    finally:
        status.__exit__(None, None, None)
    err.print("stopped", markup=False)
