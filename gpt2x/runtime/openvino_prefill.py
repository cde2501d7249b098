"""OpenVINO running an fp32 or int8 export's prefill graph (openvino/prefill.xml) for the ONNX Runtime backend, reading
the past from that backend's KV cache and writing the new positions straight into it (runtime/prefill.py chooses
when), and a bf16 export's for the OpenVINO backend (runtime/openvino.py), into its KV buffers. No torch."""

from __future__ import annotations

import functools
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as opset
from openvino import passes
from openvino.preprocess import PrePostProcessor

from ..choices import Precision
from ..errors import ArtifactError, ProviderError
from ..onnx import kvcache
from ..onnx import names as io
from ..onnx.artifact import BF16, F32, ExportInfo
from ..onnx.graph_cache import graphs_root
from .base import BF16_BITS
from .providers import physical_cores


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether OpenVINO's CPU plugin computes in bf16 here (AVX-512 BF16 or AMX). Asked once per process (a Core each
    time): a bf16 command checks it before any work, then again where it exports and where the backend opens."""
    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def refuse_bf16_without_cpu(info: ExportInfo) -> None:
    """A bf16 export was gated at bf16 compute: run as gated, or refused in one line on a CPU without it (its fp32 twin
    is the export for this CPU)."""
    if info.precision is Precision.bf16 and not cpu_has_bf16():
        raise ProviderError(f"{info.folder} is a bf16 export, which needs a CPU that computes bf16 (AVX-512 BF16 or "
                            "AMX); this one does not: export fp32 for it")


def read_prefill_graph(info: ExportInfo) -> ov.Model:
    """The export's OpenVINO prefill graph as OpenVINO reads it; one line where it cannot."""
    try:
        return ov.Core().read_model(str(info.prefill_path))
    except Exception as e:  # OpenVINO raises RuntimeError (and its own types) for unreadable graphs
        raise ArtifactError(f"OpenVINO {ov.__version__} cannot load {info.prefill_path}: {e}".splitlines()[0]) from None


def compute_precision(info: ExportInfo) -> str:
    """The compute precision the export's record says, for every prefill whatever its size (an export asks for bf16,
    no timing chooses it), f32 where it says bf16 and this CPU has none: every record choosing bf16 passed the same
    gate at f32 first (evaluate/prefill.py), so f32 is the gated fallback. Records from before that rule may name a
    length from which bf16 ran (`bf16_from`): they run f32 for every size, as gated."""
    recorded = (info.prefill or {}).get("inference_precision", F32)
    return BF16 if recorded == BF16 and cpu_has_bf16() else F32


def openvino_cache_dir() -> Path | None:
    """Where OpenVINO keeps its compiled prefill graphs (beside onnx.graph_cache's graphs), where that folder can be
    written (a read-only home: none, and every process compiles)."""
    root = graphs_root()
    if root is None:
        return None
    folder = root / "openvino"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK) else None


class _Compiled:
    """The graph compiled at one compute precision, its ports and one infer request. At bf16 its presents come out
    in bf16 (`narrow`, presents_in_bf16), which __call__ widens into the float32 cache, or, with `bf16_cache`, its past
    and presents are the bf16 cache's own (bf16_io); with `kv_scales` the cache is
    int8 (cache_in_int8), written straight at f32 and, at bf16, given out as bf16 integers that __call__ stores into
    it (widen). With `apart`, its attention on a past is computed apart over the past and the new positions
    (attend_past_apart)."""

    def __init__(self, model: ov.Model, precision: str, threads: int, n_layer: int, past: bool,
                 kv_scales: np.ndarray | None = None, bf16_cache: bool = False, apart: bool = False):
        if apart:
            model = attend_past_apart(model)
        self.narrow = precision == BF16 and not bf16_cache
        self.kv_dtype = np.int8 if kv_scales is not None else BF16_BITS if bf16_cache else np.float32
        if kv_scales is not None:
            model = cache_in_int8(model, kv_scales, bf16=self.narrow)
        elif bf16_cache:  # read and written in place, in bf16, as the openvino backend's bf16 cache holds it
            model = bf16_io(model, n_layer)
        elif self.narrow:
            model = presents_in_bf16(model)
        config = {
            "INFERENCE_NUM_THREADS": threads,
            # The gated compute precision: OpenVINO's own default is bf16 wherever the CPU has it, gated or not.
            "INFERENCE_PRECISION_HINT": precision,
            "PERFORMANCE_HINT": "LATENCY",
            # Pinned threads wait for their core beside ONNX Runtime's (runtime/openvino.py measured it).
            "ENABLE_CPU_PINNING": False,
        }
        cache = openvino_cache_dir()
        if cache is not None:  # OpenVINO's own cache of compiled graphs: a later process imports, not compiles, it
            config["CACHE_DIR"] = str(cache)
        self.compiled = ov.Core().compile_model(model, "CPU", config)
        self.request = self.compiled.create_infer_request()
        self.inputs = [self.compiled.input(name) for name in (io.INPUT_IDS, io.ATTENTION_MASK, io.POSITION_IDS)]
        self.logits = self.compiled.output(io.LOGITS)
        self.presents = [self.compiled.output(name) for name in io.output_names(n_layer)[1:]]
        self.past = [self.compiled.input(name) for name in io.input_names(n_layer)[3:]] if past else []


def graph_takes_past(model: ov.Model) -> bool:
    """Whether a prefill graph takes a past (exports before it did run fresh prompts only)."""
    return any(io.past_key(0) in port.get_names() for port in model.inputs)


def fresh_graph(model: ov.Model, n_layer: int) -> ov.Model:
    """The prefill graph as it runs fresh prompts: one that takes a past with its past made 0 positions long (OpenVINO
    then drops the concatenations and slices a fresh prompt does not need: 5-9% of a prefill's time here, as fast as a
    graph without a past), one that does not as it is."""
    if not graph_takes_past(model):
        return model
    fresh = model.clone()
    shapes = {}
    for name in io.input_names(n_layer)[3:]:
        batch, heads, _, dim = fresh.input(name).get_partial_shape()  # (B, H, P, D)
        shapes[name] = ov.PartialShape([batch, heads, 0, dim])
    fresh.reshape(shapes)
    return fresh


def presents_in_bf16(model: ov.Model) -> ov.Model:
    """The graph with its presents given out in bf16, as its bf16 compute makes them. float32 outputs keep OpenVINO's
    key and value path in f32 (its splits, transposes, and reorders back to bf16 for the attention): a 512-token
    prefill of GPT-2 124M int8 at bf16 took 117 ms with them, 81 with bf16 ones (the Xeon with AMX, scratch); widening
    them into the float32 cache takes 2.6 more on two threads (widen)."""
    narrowed = model.clone()
    for port in narrowed.outputs:
        if io.LOGITS in port.get_names():
            continue
        result = port.get_node()
        source = result.input_value(0)
        names = source.get_names()
        narrow = opset.convert(source, ov.Type.bf16).output(0)
        source.get_tensor().set_names(set())  # the output's names move to what it now gives out
        narrow.get_tensor().set_names(names)
        result.input(0).replace_source_output(narrow)
    narrowed.validate_nodes_and_infer_types()
    return narrowed


def cache_in_int8(model: ov.Model, scales: np.ndarray, bf16: bool = False) -> ov.Model:
    """The graph on an int8 KV cache (onnx/kvcache.py): each past input int8, dequantized by its (H, D) scales in
    `scales` (2L, H, D), and each present quantized as the cache stores it, round half to even of value / scale,
    clipped to int8 (GroupQueryAttention's rule: both runtimes store the same bytes for the same value), the attention
    reading the new positions as stored too. Given out as int8, or for bf16 compute (`bf16`) as bf16 holding those
    integers (exactly): an int8 or a rescaled bf16 output kept OpenVINO's key and value path in f32 (a reorder of each
    fused QKV, an f32 split: a 512-token prefill of GPT-2 124M int8 124 against 107 ms, scratch), as float32 outputs
    do (presents_in_bf16)."""
    n_layer = len(scales) // 2
    past_names, present_names = io.input_names(n_layer)[3:], io.output_names(n_layer)[1:]
    low, high = kvcache.INT8_RANGE
    quantized = model.clone()

    def scale_of(i: int):
        return opset.constant(scales[i][None, :, None, :].astype(np.float32))  # (1, H, 1, D)

    for port in quantized.outputs:
        names = port.get_names()
        hit = [n for n in present_names if n in names]
        if not hit:
            continue
        i = present_names.index(hit[0])
        result = port.get_node()
        source = result.input_value(0)
        # present = Slice(Concat(past, new))[past:] (onnx/openvino_prefill.py): the new positions quantized, and the
        # attention given them dequantized, as GroupQueryAttention attends (so a prompt's tokens see the same values
        # however it is chunked, on either runtime).
        sliced = source.get_node()
        concat = sliced.input_value(0).get_node()
        if sliced.get_type_name() != "Slice" or concat.get_type_name() != "Concat" or concat.get_input_size() != 2:
            raise ValueError(f"{hit[0]} is not the new positions of a past and new concatenation")
        inverse = opset.constant((1 / scales[i])[None, :, None, :].astype(np.float32))
        q = opset.clamp(opset.round(opset.multiply(concat.input_value(1), inverse), "half_to_even"), low, high)
        concat.input(1).replace_source_output(opset.multiply(q, scale_of(i)).output(0))
        q = opset.convert(q, ov.Type.bf16 if bf16 else ov.Type.i8).output(0)
        source.get_tensor().set_names(set())  # the output's names move to what it now gives out
        q.get_tensor().set_names(names)
        result.input(0).replace_source_output(q)
    for param in list(quantized.get_parameters()):
        names = param.output(0).get_names()
        hit = [n for n in past_names if n in names]
        if not hit:
            continue
        narrow = opset.parameter(param.get_partial_shape(), ov.Type.i8)
        wide = opset.multiply(opset.convert(narrow, ov.Type.f32), scale_of(past_names.index(hit[0]))).output(0)
        for target in list(param.output(0).get_target_inputs()):
            target.replace_source_output(wide)
        param.output(0).get_tensor().set_names(set())
        narrow.output(0).get_tensor().set_names(names)
        narrow.set_friendly_name(param.get_friendly_name())
        quantized.replace_parameter(quantized.get_parameter_index(param), narrow)
    quantized.validate_nodes_and_infer_types()
    return quantized


def _past_and_new(value: ov.Output) -> tuple[ov.Output, ov.Output] | None:
    """A concatenation's two inputs, where `value` is the concatenation of a past and new positions (axis 2)."""
    concat = value.get_node()
    if concat.get_type_name() != "Concat" or concat.get_input_size() != 2 or concat.get_attributes().get("axis") not in (2, -2):
        return None
    past, new = concat.input_values()
    return past, new


def _scores(q: ov.Output, keys: tuple[ov.Output, ov.Output]) -> ov.Node:
    """q's products with the past's keys and the new ones, concatenated (the scores over past + new)."""
    return opset.concat([opset.matmul(q, k, False, True) for k in keys], -1)


def _weighted(weights: ov.Output, values: tuple[ov.Output, ov.Output]) -> ov.Node:
    """The weights over past + new applied to the past's values and the new ones apart, added."""
    past_len = opset.gather(opset.shape_of(values[0]), opset.constant(np.array([2], np.int64)), 0)
    lengths = opset.concat([past_len, opset.constant(np.array([-1], np.int64))], 0)
    on_past, on_new = opset.variadic_split(weights, opset.constant(np.int64(-1)), lengths).outputs()
    return opset.add(opset.matmul(on_past, values[0], False, False), opset.matmul(on_new, values[1], False, False))


def attend_past_apart(model: ov.Model) -> ov.Model:
    """The graph with each attention on a past (over Concat(past, new) keys and values: a ScaledDotProductAttention,
    or the two MatMuls the converter left unfused, in the last layer) computed apart over the past and the new
    positions: the scores of both concatenated, one softmax, the two weighted sums added, and each present the new
    positions themselves. The same attention, summed in another order; the past is read where it lies, where the
    concatenation copied the whole cache at every step (a decode step of 16 rows of GPT-2 124M, cache 96 positions: the
    copy 7.9 of 39.6 ms at f32, 2.6 of 19.5 at bf16, scratch)."""
    apart = model.clone()
    concats = []
    for node in apart.get_ordered_ops():
        kind = node.get_type_name()
        if kind == "ScaledDotProductAttention" and not node.get_attributes().get("causal"):
            q, keys, values, *rest = node.input_values()
            pairs = _past_and_new(keys), _past_and_new(values)
            if None in pairs:
                continue
            scores = _scores(q, pairs[0])
            # its scale: the fifth input, else 1/sqrt(D); its mask added (a boolean one selects)
            scale = rest[1] if len(rest) > 1 else \
                opset.constant(np.float32(1 / np.sqrt(q.get_partial_shape()[-1].get_length())))
            scores = opset.multiply(scores, opset.convert_like(scale, scores))
            if rest and rest[0].get_element_type() == ov.Type.boolean:
                scores = opset.select(rest[0], scores, opset.constant(np.float32(-np.inf)))
            elif rest:
                scores = opset.add(scores, opset.convert_like(rest[0], scores))
            node.output(0).replace(_weighted(opset.softmax(scores, -1).output(0), pairs[1]).output(0))
            concats += [keys.get_node(), values.get_node()]
        elif kind == "MatMul" and not node.get_attributes()["transpose_a"]:
            a, b = node.input_values()
            pair = _past_and_new(b)
            if pair is None:
                continue
            keys = node.get_attributes()["transpose_b"]  # scores: q times the keys transposed; else weights times values
            node.output(0).replace((_scores(a, pair) if keys else _weighted(a, pair)).output(0))
            concats.append(b.get_node())
    for concat in concats:  # the presents, the new positions sliced from the concatenation, taken as they come
        new = concat.input_value(1)
        for target in list(concat.output(0).get_target_inputs()):
            sliced = target.get_node()
            if sliced.get_type_name() == "Slice" and target.get_index() == 0:
                names = sliced.output(0).get_names()
                sliced.output(0).get_tensor().set_names(set())
                sliced.output(0).replace(new)
                new.get_tensor().set_names(new.get_names() | names)
    apart.validate_nodes_and_infer_types()
    return apart




def tensor_of(arr: np.ndarray) -> ov.Tensor:
    """A tensor sharing `arr`'s memory (C-contiguous), typed bf16 where the array holds bf16 bits."""
    if arr.dtype == BF16_BITS:
        return ov.Tensor(arr, arr.shape, ov.Type.bf16)
    return ov.Tensor(arr, shared_memory=True)


def bf16_io(model: ov.Model, n_layer: int) -> ov.Model:
    """The graph with its past inputs and presents in bf16, where it computes in bf16: a cache held in bf16 is read and
    written as it is, where a float32 one was converted whole to bf16 at every step (the presents, computed in bf16,
    lose nothing: the same values, the same logits, bit for bit; 16 rows of GPT-2 124M on a 512-position cache 91
    against 118 ms a step, scratch)."""
    ppp = PrePostProcessor(model)
    for name in io.input_names(n_layer)[3:]:
        if any(name in port.get_names() for port in model.inputs):
            ppp.input(name).tensor().set_element_type(ov.Type.bf16)
    for name in io.output_names(n_layer)[1:]:
        ppp.output(name).tensor().set_element_type(ov.Type.bf16)
    return ppp.build()


def widen(narrow: ov.Tensor, arr: np.ndarray, rows: int, start: int, stop: int) -> None:
    """A (rows, H, T, D) bf16 tensor into rows [0, rows) and positions [start, stop) of a float32 (B, H, T', D)
    buffer: a bf16 is the upper half of the float32 of the same value, so this is exact. Into an int8 buffer, the
    bf16 holding integers (cache_in_int8), the same float32 values stored as int8: exact too."""
    bits = narrow.data.view(np.uint16)  # OpenVINO shows bf16 as float16: the bits, not the values
    if arr.dtype == np.float32:
        np.left_shift(bits.astype(np.uint32), 16, out=arr[:rows, :, start:stop].view(np.uint32))
        return
    wide = bits.astype(np.uint32)
    np.left_shift(wide, 16, out=wide)
    arr[:rows, :, start:stop] = wide.view(np.float32)


def _folded(model: ov.Model) -> ov.Model:
    """The graph with its weights' decompression (int8 times a scale, nncf's) folded into f32 constants, for bf16
    compute: OpenVINO then converts them to bf16 once and multiplies them as such, where it would decompress the int8
    weights at every call (16 prompts of 32 tokens 98 against 112 ms, 512 tokens 124 against 141, at bf16 on the
    2-core Xeon: scratch). The same weights' values; 250 MB more memory for GPT-2 124M, and about 1 s to fold: a
    server's (OpenVinoPrefill.warm_up), not a one-shot process's first long prompt."""
    folded = model.clone()
    manager = passes.Manager()
    manager.register_pass(passes.ConstantFolding())
    manager.run_passes(folded)
    return folded


class OpenVinoPrefill:
    """The compiled prefill graph, at the compute precision its record chose (compute_precision) for every prefill,
    and one infer request. A graph that takes a past is compiled twice, for fresh prompts (fresh_graph) and on a past,
    each at its first use."""

    def __init__(self, info: ExportInfo, threads: int | None = None, kv_scales: np.ndarray | None = None,
                 bf16_cache: bool = False, decodes: bool = False):
        self.kv_scales = kv_scales  # the int8 KV cache's (onnx/kvcache.py), where the backend's cache is int8
        self.bf16_cache = bf16_cache  # the openvino backend's at bf16: read and written in bf16 (BF16_BITS arrays)
        # The openvino backend's decode steps run on the graph on a past: compiled with its attention apart.
        self.decodes = decodes
        self.inference_precision = compute_precision(info)
        self._threads, self._n_layer, self._path = threads or physical_cores(), info.config.n_layer, info.prefill_path
        self._info = info
        self._model: ov.Model | None = read_prefill_graph(info)
        self.takes_past = graph_takes_past(self._model)
        self._forms = (False, True) if self.takes_past else (False,)
        self._widening: ThreadPoolExecutor | None = None  # bf16 presents widened on the prefill's threads
        self._graphs: dict[tuple[str, bool], _Compiled] = {}
        self._compiling: dict[bool, Future] = {}  # prepare()'s compiles (fresh: False, on a past: True), on a thread
        # bf16 graphs compiled from _folded (warm_up's choice), where the export's gate passed that graph too
        self.fold_bf16 = False
        self._folds_gated = (info.prefill or {}).get("bf16_folded", {}).get("status") == "passed"

    def prepare(self, bf16: bool = False, wait: bool = False, past: bool = False) -> None:
        """Compile the graph for fresh prompts at inference_precision on a thread of its own, now, where f32 computes
        it, or with `bf16` bf16 (the openvino backend's bf16 exports: f32 weights, which nothing folds; an int8 graph's
        bf16 form is warm_up's choice), and with `past` the graph on a past after it (where the openvino backend
        decodes on it): their first use waits for them (_graph) rather than compiling them then. `wait`: on the
        caller's thread (one of its own already)."""
        precision = self.inference_precision
        if (precision != F32 and not bf16) or self._compiling or (precision, False) in self._graphs:
            return
        forms = [False, True] if past and self.takes_past else [False]
        if wait:
            self.compile_and_warm(precision, forms)
            return
        pool = ThreadPoolExecutor(1, thread_name_prefix="gpt2x-openvino-compile")
        # One after the other, each awaited alone: a fresh prompt does not wait for the graph on a past.
        self._compiling = {form: pool.submit(self.compile_and_warm, precision, [form]) for form in forms}
        pool.shutdown(wait=False)  # the thread ends with its compiles

    def _graph(self, precision: str, past: bool = False) -> _Compiled:
        """The graph compiled at `precision`, for a past or fresh prompts, at its first use: a process whose prompts
        all run on ONNX Runtime (short ones) never compiles it (0.2-0.25 s for GPT-2 124M int8 here)."""
        if past in self._compiling and precision == self.inference_precision:
            self._compiling.pop(past).result()  # prepare()'s compile: its error is raised here, as a compile's here would be
        if (precision, past) not in self._graphs:
            self._compile(precision, past)
        return self._graphs[precision, past]

    def compile_and_warm(self, precision: str | None = None, forms: list[bool] | tuple[bool, ...] = (False,)) -> None:
        """The graph for fresh prompts (and with True in `forms`, on a past) compiled at `precision`
        (inference_precision's by default) and run once, so that the first prompt pays neither (OpenVINO lays out its
        weights at a graph's first inference: 100-130 ms of a fresh process's first token, GPT-2 124M int8). prepare()
        runs it on a thread."""
        precision = precision or self.inference_precision
        for past in forms:
            self._compile(precision, past)
            self._warm(self._graphs[precision, past], 2 if past else 0)

    def _compile(self, precision: str, past: bool) -> None:
        whole = self._model if self._model is not None else read_prefill_graph(self._info)
        model = whole if past else fresh_graph(whole, self._n_layer)
        if precision == BF16 and self.fold_bf16:
            model = _folded(model)
        try:
            self._graphs[precision, past] = _Compiled(model, precision, self._threads, self._n_layer, self.takes_past,
                                                      self.kv_scales, self.bf16_cache and precision == BF16,
                                                      apart=past and self.decodes)
        except Exception as e:  # as read_model's
            raise ArtifactError(f"OpenVINO {ov.__version__} cannot compile {self._path}: {e}".splitlines()[0]) from None
        if precision == F32 == self.inference_precision and all((F32, form) in self._graphs for form in self._forms):
            # Every graph an f32 prefill runs is compiled, with weights of its own: the graph read from prefill.bin,
            # whose mapping held the weights again (474 MB for GPT-2 124M fp32), is let go (read again if ever needed).
            self._model = None

    @property
    def compiled(self):
        """The compiled graph for fresh prompts at inference_precision (compiled now if it was not)."""
        return self._graph(self.inference_precision).compiled

    @property
    def request(self):
        return self._graph(self.inference_precision).request

    @property
    def compiled_on_past(self) -> ov.CompiledModel:
        """The compiled graph on a past at inference_precision (compiled now if it was not)."""
        return self._graph(self.inference_precision, True).compiled

    def warm_up(self, past: bool, fold_bf16: bool = False) -> None:
        """Every graph compiled that a prefill may run, fresh and (`past`) on a past, and
        run once on two tokens: OpenVINO lays its weights out for its kernels at a graph's first inference, whatever its
        shape (a first 16-row prefill at bf16 200 ms, the next 65-85: scratch). `fold_bf16`: its bf16 graphs from
        _folded, where the export gated that (`bf16_folded`; or when asked, as the gate itself does)."""
        if fold_bf16 or self._folds_gated:
            self.fold_bf16 = True
            self._graphs = {key: graph for key, graph in self._graphs.items() if key[0] != BF16}
        for form in [False, True] if past and self.takes_past else [False]:
            self._warm(self._graph(self.inference_precision, form), 2 if form else 0)

    def _warm(self, graph: _Compiled, past: int) -> None:
        """One inference of the graph on a row of two tokens after `past` (zeros: only its time matters)."""
        feeds = (np.zeros((1, 2), np.int64), np.ones((1, past + 2), np.int64), np.arange(past, past + 2, dtype=np.int64)[None])
        for port, arr in zip(graph.inputs, feeds):
            graph.request.set_tensor(port, ov.Tensor(arr))
        _, heads, _, dim = graph.presents[0].get_partial_shape()  # (B, H, T, D)
        H, D = heads.get_length(), dim.get_length()
        # Held until the inference is done: the request reads and writes the arrays' memory, not copies of it.
        held = [np.zeros((1, H, past, D), graph.kv_dtype) for _ in graph.past]
        for port, arr in zip(graph.past, held):
            graph.request.set_tensor(port, tensor_of(arr))
        if not graph.narrow:
            written = [np.empty((1, H, 2, D), graph.kv_dtype) for _ in graph.presents]
            held += written
            for port, arr in zip(graph.presents, written):  # its own arrays: every call sets the cache's regions again
                graph.request.set_tensor(port, tensor_of(arr))
        graph.request.infer()

    def __call__(self, input_ids, attention_mask, position_ids, presents: list[np.ndarray], past: int = 0) -> np.ndarray:
        """The last position's logits (B, V). `presents` are C-contiguous float32 arrays (int8 with kv_scales, bf16 bits
        with bf16_cache) (B' >= B, H, >= past + T, D), in the outputs' order, whose first `past` positions hold the past
        (a graph that takes_past only): OpenVINO reads those and writes the T new positions straight after them (at f32
        compute, and into a bf16 cache; at bf16 into a float32 or int8 one it gives them out in bf16 and they are widened
        into place: presents_in_bf16, cache_in_int8), the past never copied. The
        request keeps pointers into them until the next call sets its own, and reads and writes only during a call."""
        B, T = input_ids.shape
        if past and not self.takes_past:
            raise ValueError("this export's OpenVINO prefill graph takes no past (exported before it did)")
        graph = self._graph(self.inference_precision, past > 0)
        for port, arr in zip(graph.inputs, (input_ids, attention_mask, position_ids)):
            graph.request.set_tensor(port, ov.Tensor(np.ascontiguousarray(arr, dtype=np.int64)))
        for port, arr in zip(graph.past, presents):
            # Regions of the longer buffers (the Python binding shares C-contiguous arrays only); an empty past too.
            graph.request.set_tensor(port, _region(arr, B, 0, past))
        if not graph.narrow:
            for port, arr in zip(graph.presents, presents):
                graph.request.set_tensor(port, _region(arr, B, past, past + T))
        graph.request.infer()
        if graph.narrow:
            self._widen_all([(graph.request.get_tensor(port), arr) for port, arr in zip(graph.presents, presents)],
                            B, past, past + T)
        return graph.request.get_tensor(graph.logits).data[:, -1].copy()

    def _widen_all(self, pairs: list[tuple[ov.Tensor, np.ndarray]], rows: int, start: int, stop: int) -> None:
        """widen each (bf16 present, cache buffer) pair, the pairs shared among the prefill's threads (NumPy lets go
        of the GIL: 2.6 against 5.8 ms for a 512-token prompt's 24 presents on two, scratch)."""
        def share(k: int) -> None:
            for narrow, arr in pairs[k :: self._threads]:
                widen(narrow, arr, rows, start, stop)

        if self._threads == 1:
            share(0)
            return
        if self._widening is None:
            self._widening = ThreadPoolExecutor(self._threads, thread_name_prefix="gpt2x-widen")
        list(self._widening.map(share, range(self._threads)))


def _region(arr: np.ndarray, rows: int, start: int, stop: int) -> ov.Tensor:
    """Rows [0, rows) and positions [start, stop) of a (B, H, T, D) buffer, sharing its memory."""
    B, H, T, D = arr.shape
    if start == stop:
        return tensor_of(np.empty((rows, H, 0, D), arr.dtype))
    whole = tensor_of(arr)
    return whole if (rows, start, stop) == (B, 0, T) else ov.Tensor(whole, [0, 0, start, 0], [rows, H, stop, D])
