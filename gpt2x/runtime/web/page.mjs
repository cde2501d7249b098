// gpt2x's web backend, the page side: one onnxruntime-web (WebAssembly) session over a gpt2x export,
// driven from Python (gpt2x/runtime/web.py) through `window.gpt2x`. The KV cache stays in the page, as
// ort.Tensors under numbered handles; only logits (and, where Python asks, a cache) cross to Python,
// as base64 strings, or for greedy decoding only each row's argmax.
// Every file comes from the loopback server that serves this page: nothing from a CDN.
import * as ort from "./ort/ort.wasm.min.mjs";

ort.env.wasm.wasmPaths = new URL("./ort/", location.href).href;
ort.env.logLevel = "error";

const caches = new Map(); // handle -> {tensors: ort.Tensor[], batch, length}
let nextHandle = 1;
let session = null;
let layout = null; // {pastNames, presentNames, keepInput, rowsForMultiTokenPast, heads, headDim}

function b64(typed) {
  const bytes = new Uint8Array(typed.buffer, typed.byteOffset, typed.byteLength);
  if (bytes.toBase64) return bytes.toBase64();
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

function unb64(text, Type) {
  const bytes = Uint8Array.fromBase64 ? Uint8Array.fromBase64(text) : Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
  return new Type(bytes.buffer, bytes.byteOffset, bytes.byteLength / Type.BYTES_PER_ELEMENT);
}

function int64(values, dims) {
  return new ort.Tensor("int64", BigInt64Array.from(values, (v) => BigInt(v)), dims);
}

function store(tensors, batch, length) {
  const handle = nextHandle++;
  caches.set(handle, { tensors, batch, length });
  return handle;
}

// A cache's rows [r0, r1) of every tensor (B, H, P, D): contiguous in row-major order, so a view.
function rowsOf(tensor, r0, r1) {
  const [B, H, P, D] = tensor.dims;
  const per = H * P * D;
  return new ort.Tensor(tensor.type, tensor.data.subarray(r0 * per, r1 * per), [r1 - r0, H, P, D]);
}

function concatRows(parts) {
  const [, H, P, D] = parts[0].dims;
  const B = parts.reduce((n, t) => n + t.dims[0], 0);
  const out = new Float32Array(B * H * P * D);
  let at = 0;
  for (const t of parts) { out.set(t.data, at); at += t.data.length; }
  return new ort.Tensor("float32", out, [B, H, P, D]);
}

// The logits (B, T, V) of each row's last `keep` positions only: onnxruntime-web does not take the
// graph's logits_to_keep input (an initializer), so the page cuts what would cross to Python.
function lastPositions(logits, keep) {
  const [B, T, V] = logits.dims;
  const out = new Float32Array(B * keep * V);
  for (let b = 0; b < B; b++) out.set(logits.data.subarray((b * T + T - keep) * V, (b + 1) * T * V), b * keep * V);
  return new ort.Tensor("float32", out, [B, keep, V]);
}

// Each row's most likely token at its last position: NumPy's argmax (the first of equal maxima).
function argmaxLast(logits) {
  const [B, T, V] = logits.dims;
  const tokens = [];
  for (let b = 0; b < B; b++) {
    const row = logits.data.subarray((b * T + T - 1) * V, (b * T + T) * V);
    let best = 0;
    for (let v = 1; v < V; v++) if (row[v] > row[best]) best = v;
    tokens.push(best);
  }
  return tokens;
}

function emptyPast(batch) {
  const t = new ort.Tensor("float32", new Float32Array(0), [batch, layout.heads, 0, layout.headDim]);
  return layout.pastNames.map(() => t);
}

async function forward(ids, mask, pos, past, keep) {
  const feeds = { input_ids: ids, attention_mask: mask, position_ids: pos };
  layout.pastNames.forEach((name, i) => { feeds[name] = past[i]; });
  if (layout.keepInput) feeds[layout.keepInput] = new ort.Tensor("int64", BigInt64Array.of(BigInt(keep)), []);
  const out = await session.run(feeds);
  return { logits: out.logits, presents: layout.presentNames.map((n) => out[n]) };
}

function sliceRow(flat, B, width, r) {
  return flat.slice(r * width, (r + 1) * width);
}

window.gpt2x = {
  // Load the export at `url` (with its external data file, if any) on `threads` WebAssembly threads.
  async load(url, dataFile, threads, meta) {
    ort.env.wasm.numThreads = threads;
    const options = { executionProviders: ["wasm"], graphOptimizationLevel: "all" };
    if (dataFile) options.externalData = [{ path: dataFile, data: new URL(dataFile, new URL(url, location.href)).href }];
    const t0 = performance.now();
    session = await ort.InferenceSession.create(url, options);
    const pastNames = session.inputNames.filter((n) => n.startsWith("past_key_values."));
    layout = {
      pastNames,
      presentNames: pastNames.map((n) => n.replace("past_key_values.", "present.")),
      keepInput: session.inputNames.includes("logits_to_keep") ? "logits_to_keep" : null,
      rowsForMultiTokenPast: !meta.batched_multi_token_past,
      heads: meta.n_head,
      headDim: meta.head_dim,
    };
    return {
      seconds: (performance.now() - t0) / 1000,
      crossOriginIsolated: self.crossOriginIsolated,
      threads: ort.env.wasm.numThreads,
      hardwareConcurrency: navigator.hardwareConcurrency,
      inputs: session.inputNames,
      outputs: session.outputNames,
      version: ort.env.versions.web,
      userAgent: navigator.userAgent,
    };
  },

  // One forward: ids/pos (B, T) and mask (B, P+T) as flat arrays; `handle` the past (0: none).
  // Returns the logits of the last `keep` positions (0: all) as base64 float32 (with `greedy`, only each
  // row's argmax at its last position), the new cache's handle, and the milliseconds the page spent.
  async run(ids, mask, pos, B, T, handle, keep, greedy) {
    const t0 = performance.now();
    const P = mask.length / B - T;
    if (handle && !caches.has(handle)) throw new Error(`no cache ${handle}`);
    const past = handle ? caches.get(handle).tensors : emptyPast(B);
    let logits, presents;
    if (B > 1 && T > 1 && P > 0 && layout.rowsForMultiTokenPast) {
      // GroupQueryAttention's CPU kernel refuses a multi-token step over a past for a batch: one row at a time.
      const parts = [];
      for (let r = 0; r < B; r++) {
        parts.push(await forward(
          int64(sliceRow(ids, B, T, r), [1, T]), int64(sliceRow(mask, B, P + T, r), [1, P + T]),
          int64(sliceRow(pos, B, T, r), [1, T]), past.map((t) => rowsOf(t, r, r + 1)), keep));
      }
      const L = parts[0].logits;
      const flat = new Float32Array(B * L.data.length);
      parts.forEach((p, r) => flat.set(p.logits.data, r * L.data.length));
      logits = new ort.Tensor("float32", flat, [B, L.dims[1], L.dims[2]]);
      presents = layout.presentNames.map((_, i) => concatRows(parts.map((p) => p.presents[i])));
    } else {
      ({ logits, presents } = await forward(int64(ids, [B, T]), int64(mask, [B, P + T]), int64(pos, [B, T]), past, keep));
    }
    if (keep > 0 && logits.dims[1] > keep) logits = lastPositions(logits, keep);
    const cache = store(presents, B, P + T);
    // ms: the forward as a page would see it (inputs to encoded logits or tokens), without the trip to Python.
    if (greedy) return { tokens: argmaxLast(logits), handle: cache, ms: performance.now() - t0 };
    const encoded = b64(logits.data);
    return { logits: encoded, dims: logits.dims, handle: cache, ms: performance.now() - t0 };
  },

  release(handles) { for (const h of handles) caches.delete(h); return caches.size; },

  // A cache from base64 float32 arrays (B, H, P, D), key then value per layer.
  put(arrays, dims) {
    return store(arrays.map((a) => new ort.Tensor("float32", unb64(a, Float32Array), dims)), dims[0], dims[2]);
  },

  get(handle) {
    const c = caches.get(handle);
    return { arrays: c.tensors.map((t) => b64(t.data)), dims: c.tensors[0].dims };
  },

  // Rows of a cache, gathered (beam search).
  gather(handle, rows) {
    const c = caches.get(handle);
    const tensors = c.tensors.map((t) => concatRows(rows.map((r) => rowsOf(t, r, r + 1))));
    return store(tensors, rows.length, c.length);
  },

  // A cache's first `length` positions (speculative decoding's rollback): copied, as the kept
  // positions of a (B, H, P, D) tensor are not contiguous.
  truncate(handle, length) {
    const c = caches.get(handle);
    const tensors = c.tensors.map((t) => {
      const [B, H, P, D] = t.dims;
      const out = new Float32Array(B * H * length * D);
      for (let bh = 0; bh < B * H; bh++) out.set(t.data.subarray(bh * P * D, bh * P * D + length * D), bh * length * D);
      return new ort.Tensor("float32", out, [B, H, length, D]);
    });
    return store(tensors, c.batch, length);
  },
};
window.gpt2xReady = true;
