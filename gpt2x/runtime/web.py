"""onnxruntime-web (WebAssembly) in headless Chromium, driven by Playwright from a thread of its own (no torch).
The page holds the KV cache; only logits (or greedy's tokens) cross to Python, whose sampler chooses
(docs/backends.md, the web backend).
"""

from __future__ import annotations

import base64
import json
import mimetypes
import os
import queue
import re
import shutil
import threading
import time
import weakref
from concurrent.futures import Future
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from ..choices import ProviderKind
from ..errors import ArtifactError, MissingDependencyError, ProviderError
from ..onnx.artifact import DATA_FILE, MODEL_FILE, ExportInfo
from .base import WEB_CAPABILITIES, Closable, merge_on_host
from .providers import physical_cores

WEB_DIR = Path(__file__).parent / "web"  # the page, and package.json for onnxruntime-web
ORT_WEB_PACKAGE = "onnxruntime-web"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_INSTALL = "apt-get install chromium (Debian/Ubuntu), or set GPT2X_CHROMIUM to a Chromium or Chrome executable"
PLAYWRIGHT_INSTALL = "pip install 'gpt2x[web]'"
# The flags a headless Chromium needs on a closed machine (no sandbox as root, no background traffic).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
PAGE_MS_LIMIT = 100_000
READY_TIMEOUT_MS = 30_000  # the page's script, from loopback
LOAD_TIMEOUT_MS = 600_000  # a large graph's download and session creation
ISOLATION_HEADERS = {
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Embedder-Policy": "require-corp",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-store",
}
# Operators only the quantized exports use: where the WebAssembly build lacks one, fp32 runs (1.30 has them all).
FALLBACKS = {
    "GroupQueryAttention": "the fp32 export of the model runs MultiHeadAttention instead",
    "MatMulNBits": "the fp32 export of the model has no quantized weights",
    "DynamicQuantizeMatMul": "the fp32 export of the model has no quantized weights",
}


def node_modules_dir() -> Path:
    """Where onnxruntime-web is looked for: GPT2X_WEB_MODULES, else web/node_modules beside this file."""
    env = os.environ.get("GPT2X_WEB_MODULES")
    return Path(env) if env else WEB_DIR / "node_modules"


def ort_web_dist() -> Path:
    """onnxruntime-web's dist folder; MissingDependencyError naming the npm command when absent."""
    dist = node_modules_dir() / ORT_WEB_PACKAGE / "dist"
    if not (dist / "ort.wasm.min.mjs").is_file():
        raise MissingDependencyError(f"the web backend needs {ORT_WEB_PACKAGE} from npm, which is not installed: "
                                     f"npm ci --prefix {WEB_DIR}")
    return dist


def chromium_path() -> str:
    """The Chromium executable: GPT2X_CHROMIUM, else the first of CHROMIUM_NAMES on PATH."""
    env = os.environ.get("GPT2X_CHROMIUM")
    if env:
        if not (Path(env).is_file() and os.access(env, os.X_OK)):
            raise MissingDependencyError(f"GPT2X_CHROMIUM={env} is not an executable file")
        return env
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise MissingDependencyError(f"the web backend needs Chromium, which this machine lacks: {CHROMIUM_INSTALL}")


def require_web() -> None:
    """Everything the web backend needs, checked before any work: Playwright, Chromium, onnxruntime-web."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        raise MissingDependencyError(f"the web backend needs playwright, which this install lacks: {PLAYWRIGHT_INSTALL}") from None
    chromium_path()
    ort_web_dist()


def ort_web_version() -> str | None:
    """The installed onnxruntime-web's version, or None."""
    try:
        return json.loads((node_modules_dir() / ORT_WEB_PACKAGE / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


# ---------------------------------------------------------------- the loopback server


class _Handler(SimpleHTTPRequestHandler):
    """Serves the page, /ort/ (onnxruntime-web's dist) and /model/ (the export), files only, with the
    isolation headers (SharedArrayBuffer, hence WebAssembly threads)."""

    roots: dict[str, Path] = {}

    def translate_path(self, path: str) -> str:
        path = path.split("?", 1)[0].split("#", 1)[0]
        for prefix, root in self.roots.items():
            if path.startswith(prefix):
                name = path[len(prefix):]
                if not name or "/" in name or name.startswith("."):
                    return ""
                return str(root / name)
        return ""

    def send_head(self):
        target = self.translate_path(self.path)
        if not target or not os.path.isfile(target):
            self.send_error(HTTPStatus.NOT_FOUND)
            return None
        return super().send_head()

    def end_headers(self) -> None:
        for key, value in ISOLATION_HEADERS.items():
            self.send_header(key, value)
        super().end_headers()

    def guess_type(self, path) -> str:
        if str(path).endswith((".mjs", ".js")):
            return "text/javascript"
        if str(path).endswith(".wasm"):
            return "application/wasm"
        return mimetypes.guess_type(str(path))[0] or "application/octet-stream"

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        pass


class LoopbackServer:
    """A threaded HTTP server on 127.0.0.1 (a free port) in a daemon thread."""

    def __init__(self, model_folder: Path):
        handler = type("Handler", (_Handler,), {"roots": {"/ort/": ort_web_dist(), "/model/": Path(model_folder), "/": WEB_DIR}})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="gpt2x-web-server", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# ---------------------------------------------------------------- the backend


def _b64_floats(text: str, dims: list[int]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=np.float32).reshape(dims)


def unsupported_operator(message: str) -> str | None:
    """The operator ONNX Runtime's WebAssembly build reported it cannot run, if the message says so."""
    m = re.search(r"Could not find an implementation for (\w+)", message) or \
        re.search(r"[Nn]o (?:kernel|implementation|schema) (?:registered )?for (?:op(?:erator)? )?(\w+)", message)
    return m.group(1) if m else None


def renderer_pids() -> list[int]:
    """The Chromium renderer processes descended from this process (Linux /proc; none elsewhere)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    ours, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - ours
        ours |= frontier
    found = []
    for pid in ours:
        try:
            if b"--type=renderer" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def renderer_peak_rss_mb() -> float | None:
    """The largest peak RSS (VmHWM, MiB) among this process's Chromium renderers."""
    peaks = []
    for pid in renderer_pids():
        try:
            peaks += [int(line.split()[1]) / 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if line.startswith("VmHWM:")]
        except OSError:
            continue
    return max(peaks) if peaks else None


def reset_renderer_peak_rss() -> None:
    """Start the renderers' peak RSS again from their current RSS (Linux: 5 written to clear_refs)."""
    for pid in renderer_pids():
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            continue


class _DriverThread:
    """The one thread that talks to Playwright, whose sync API binds to its thread and refuses one with a
    running asyncio loop (Ray Serve, notebooks). A daemon, so the shutdown at exit can still use it."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="gpt2x-web-driver", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, done = job
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 (handed to the caller's thread, raised there)
                done.set_exception(e)

    def call(self, fn, *args):
        done: Future = Future()
        self._jobs.put((fn, args, done))
        return done.result()

    def stop(self) -> None:
        self._jobs.put(None)


class _Browser:
    """Playwright, Chromium and the page, owned by the driver thread (each method runs there)."""

    def __init__(self):
        self.playwright = self.browser = self.page = None

    def start(self, url: str) -> None:
        from playwright.sync_api import TimeoutError as PlaywrightTimeout
        from playwright.sync_api import sync_playwright

        self.playwright = sync_playwright().start()
        self.browser = self.playwright.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS)
        self.page = self.browser.new_page()
        errors: list[str] = []
        self.page.on("pageerror", lambda e: errors.append(str(e)))
        self.page.goto(url)
        # Waited for in short slices, so that a page error is reported as soon as the page reports it.
        deadline = time.monotonic() + READY_TIMEOUT_MS / 1e3
        while not errors:
            try:
                self.page.wait_for_function("window.gpt2xReady === true", timeout=250)
                break
            except PlaywrightTimeout:
                if time.monotonic() > deadline:
                    errors.append(f"window.gpt2x was not defined within {READY_TIMEOUT_MS / 1e3:g} s")
        if errors:
            raise ProviderError(f"the web backend's page did not start: {errors[0].splitlines()[0]}")
        self.page.set_default_timeout(LOAD_TIMEOUT_MS)

    def evaluate(self, expression: str, arg: Any) -> Any:
        return self.page.evaluate(expression, arg)

    def stop(self) -> None:
        for step in (self.browser and self.browser.close, self.playwright and self.playwright.stop):
            if step:
                try:
                    step()
                except Exception:  # noqa: BLE001 (a browser or driver that already went away)
                    pass
        self.playwright = self.browser = self.page = None


def _shut_down(driver: _DriverThread, browser: _Browser, server: LoopbackServer) -> None:
    """Close the browser and Playwright's driver (on the driver thread), the thread and the server."""
    driver.call(browser.stop)
    driver.stop()
    server.close()


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)[:300]


class WebCache:
    """A KV cache held by the page under `handle`, dropped there once no WebCache refers to it."""

    __slots__ = ("owner", "handle", "rows", "length")

    def __init__(self, owner: WebBackend, handle: int, rows: int, length: int):
        self.owner, self.handle, self.rows, self.length = owner, handle, rows, length

    def __del__(self) -> None:
        self.owner._released.append(self.handle)  # released in the page with the next call

    def to_numpy(self) -> list[np.ndarray]:
        reply = self.owner._call("(h) => window.gpt2x.get(h)", self.handle)
        return [_b64_floats(a, reply["dims"]).copy() for a in reply["arrays"]]

    stored = to_numpy

    def reorder(self, rows: np.ndarray) -> WebCache:
        rows = [int(r) for r in np.asarray(rows)]
        return self.owner._cache(self.owner._call("([h, r]) => window.gpt2x.gather(h, r)", [self.handle, rows]),
                                 len(rows), self.length)

    def merge(self, rows: np.ndarray, joiner: WebCache | None, width: int) -> WebCache:
        return merge_on_host(self, rows, joiner, width, self.owner.past_from_numpy)

    def truncate(self, length: int) -> WebCache:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot keep {length} positions of a cache holding {self.length}")
        if length == self.length:
            return self
        return self.owner._cache(self.owner._call("([h, n]) => window.gpt2x.truncate(h, n)", [self.handle, length]),
                                 self.rows, length)


class WebBackend(Closable):
    """One export run by onnxruntime-web (WebAssembly) in headless Chromium."""

    name = "web"
    capabilities = WEB_CAPABILITIES
    cache_forms = (WebCache,)

    def __init__(self, info: ExportInfo, provider: ProviderKind = ProviderKind.cpu, threads: int | None = None):
        refused = self.capabilities.refuse_provider(self.name, provider) or \
            self.capabilities.refuse_export(self.name, info.folder, info.precision, provider)
        if refused is not None:
            raise refused
        require_web()
        from playwright.sync_api import Error as PlaywrightError

        self._error_type = PlaywrightError
        self.info = info
        self.provider = provider
        self.cfg = info.config
        self.model_name = info.meta["model"]["name"]
        self.n_positions = self.cfg.n_positions
        self.vocab_size = self.cfg.vocab_size
        self._released: list[int] = []
        # Each forward's milliseconds in the page: the bench reports them beside the speed seen from Python.
        self.page_ms: list[float] = []
        server = LoopbackServer(info.folder)
        self._driver, self._browser = _DriverThread(), _Browser()
        # Browser, driver and server go with the backend (close, garbage collection or exit), whatever happens below.
        self._finalizer = weakref.finalize(self, _shut_down, self._driver, self._browser, server)
        try:
            self._driver.call(self._browser.start, server.url + "index.html")
        except PlaywrightError as e:
            self.close()
            raise ProviderError(f"headless Chromium failed: {_first_line(e)}") from None
        except BaseException:
            self.close()
            raise
        data = DATA_FILE if (info.folder / DATA_FILE).is_file() else None
        layout = {"n_head": self.cfg.n_head, "head_dim": self.cfg.head_dim,
                  "batched_multi_token_past": info.attention["batched_multi_token_past"]}
        try:
            self.page_info = self._driver.call(self._browser.evaluate, "([u, d, t, m]) => window.gpt2x.load(u, d, t, m)",
                                               [f"model/{MODEL_FILE}", data, threads or physical_cores(), layout])
        except PlaywrightError as e:
            self.close()
            raise self._load_error(e) from None
        except BaseException:
            self.close()
            raise

    def _load_error(self, e: Exception) -> Exception:
        text = str(e)
        op = unsupported_operator(text)
        if op:
            return ArtifactError(f"{self.info.folder}: onnxruntime-web {ort_web_version()}'s WebAssembly build cannot run "
                                 f"the operator {op}; {FALLBACKS.get(op, 'the export needs a variant without it')}")
        return ArtifactError(f"{self.info.folder}: onnxruntime-web could not load it: {_first_line(e)}")

    def close(self) -> None:
        """Close the browser, its driver and the server (also on garbage collection or exit)."""
        self._finalizer()

    def page_memory_mb(self) -> float | None:
        """Peak resident memory (VmHWM, MiB) of the renderer holding the page, since load or reset_page_memory."""
        return renderer_peak_rss_mb()

    def reset_page_memory(self) -> None:
        reset_renderer_peak_rss()

    # -- talking to the page

    def _call(self, expression: str, arg: Any = None) -> Any:
        if not self._finalizer.alive:
            raise ProviderError("this web backend is closed: its browser is gone")
        if self._released:
            handles, self._released = self._released, []
            arg = {"released": handles, "arg": arg}
            expression = f"(a) => {{ window.gpt2x.release(a.released); return ({expression})(a.arg); }}"
        try:
            return self._driver.call(self._browser.evaluate, expression, arg)
        except self._error_type as e:
            raise ProviderError(f"the web page failed: {_first_line(e)}") from None

    def _cache(self, reply: dict, batch: int, length: int) -> WebCache:
        return WebCache(self, reply if isinstance(reply, int) else reply["handle"], batch, length)

    # -- the Backend protocol

    def run(self, input_ids, attention_mask, position_ids, past):
        return self._forward(input_ids, attention_mask, position_ids, past, keep=0)

    def step(self, input_ids, attention_mask, position_ids, past):
        logits, present = self._forward(input_ids, attention_mask, position_ids, past, keep=1)
        return logits[:, -1], present

    def step_greedy(self, input_ids, attention_mask, position_ids, past):
        """The argmax (first of equal maxima) taken in the page: tokens cross, not 200 KB of logits a row."""
        reply, present = self._forward(input_ids, attention_mask, position_ids, past, keep=1, greedy=True)
        return np.asarray(reply["tokens"], dtype=np.int64), present

    def _forward(self, input_ids, attention_mask, position_ids, past: WebCache | None, keep: int, greedy: bool = False):
        B, T = input_ids.shape
        length = 0 if past is None else past.length
        if attention_mask.shape[1] != length + T:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions; the cache holds {length} + {T} new")
        reply = self._call("([i, m, p, B, T, h, k, g]) => window.gpt2x.run(i, m, p, B, T, h, k, g)",
                           [np.asarray(input_ids).ravel().tolist(), np.asarray(attention_mask).ravel().tolist(),
                            np.asarray(position_ids).ravel().tolist(), B, T, 0 if past is None else past.handle, keep, greedy])
        if len(self.page_ms) >= PAGE_MS_LIMIT:
            del self.page_ms[: PAGE_MS_LIMIT // 2]
        self.page_ms.append(float(reply["ms"]))  # JSON gives a whole number of ms as an int
        present = self._cache(reply, B, length + T)
        return (reply if greedy else _b64_floats(reply["logits"], reply["dims"])), present

    def past_from_numpy(self, arrays: list[np.ndarray]) -> WebCache:
        dims = list(arrays[0].shape)
        encoded = [base64.b64encode(np.ascontiguousarray(a, dtype=np.float32).tobytes()).decode() for a in arrays]
        handle = self._call("([a, d]) => window.gpt2x.put(a, d)", [encoded, dims])
        return self._cache(handle, dims[0], dims[2])

    def peak_device_memory_mb(self) -> float | None:
        return None
