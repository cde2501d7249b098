"""The mixed step's graph: a GroupQueryAttention export's graph rewritten to take two token streams in one forward,
the decode rows `[B, 1]` on the batch cache and one joiner's chunk `[1, C]` on its own cache. The weight matmuls,
layer norms and residuals run once on both streams' tokens (`[1, B + C, hidden]`: the weights are read once); per
layer the attention splits into one GroupQueryAttention per stream. Measured: docs/results/serving.md, the mixed step."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from . import names as io
from .names import MSFT
from .optimize import GQA, logits_producer

# GroupQueryAttention's inputs that carry the stream's mask: seqlens_k, total_sequence_length, attention_bias.
_MASK_INPUTS = (5, 6, 10)
_PAST_INPUTS = (3, 4)


def chunk_name(name: str) -> str:
    """The chunk stream's input or output for the decode stream's `name` (chunk.input_ids, chunk.present.0.key)."""
    return io.CHUNK_PREFIX + name


def _ancestors(graph: onnx.GraphProto, tensors: set[str]) -> list[onnx.NodeProto]:
    """The nodes `tensors` are computed from, in graph order."""
    producer = {o: n for n in graph.node for o in n.output if o}
    seen: set[int] = set()
    todo = [t for t in tensors if t in producer]
    while todo:
        node = producer[todo.pop()]
        if id(node) in seen:
            continue
        seen.add(id(node))
        todo.extend(i for i in node.input if i in producer)
    return [n for n in graph.node if id(n) in seen]


def _without_dead_nodes(graph: onnx.GraphProto) -> None:
    """Drop nodes no output depends on, then inputs and initializers no node reads."""
    outputs = {o.name for o in graph.output}
    live = _ancestors(graph, outputs)
    del graph.node[:]
    graph.node.extend(live)
    used = {i for n in graph.node for i in n.input} | outputs
    inputs = [i for i in graph.input if i.name in used]
    del graph.input[:]
    graph.input.extend(inputs)
    inits = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(inits)


def _renamed_io(value: onnx.ValueInfoProto, dims: dict[str, str | int]) -> onnx.ValueInfoProto:
    """`value` under its chunk name, its symbolic dims renamed (or fixed) by `dims`."""
    out = onnx.ValueInfoProto()
    out.CopyFrom(value)
    out.name = chunk_name(value.name)
    for d in out.type.tensor_type.shape.dim:
        if d.dim_param in dims:
            new = dims[d.dim_param]
            if isinstance(new, int):
                d.dim_value = new
            else:
                d.dim_param = new
    return out


def mixed_graph(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `proto` (a decode graph with GroupQueryAttention) that also takes a chunk stream. Inputs: the
    decode stream's (input_ids `[B, 1]`, attention_mask, position_ids, past) and the chunk's, named chunk.* (batch 1,
    C new tokens on a past of any length). Outputs: `logits` `[1, B + 1, vocab]` (the decode rows, then the chunk's
    last position), the decode presents and the chunk's (chunk.present.*)."""
    src = proto.graph
    gqa = [n for n in src.node if n.op_type == GQA and n.domain == MSFT]
    if not gqa:
        raise ValueError("the mixed step needs a GroupQueryAttention graph (int8, int4)")
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    graph = model.graph
    del graph.value_info[:]  # intermediate shapes change (the token axis holds both streams)
    unembed = logits_producer(model)
    hidden_out = unembed.input[0]
    kept_by = {o: n for n in graph.node for o in n.output}.get(hidden_out)
    if kept_by is not None and kept_by.op_type == "Slice":  # keep_last_logits's Slice: its source is the hidden state
        hidden_out = kept_by.input[0]

    # The mask's subgraph (from attention_mask and the ids' shape) runs once per stream; the chunk's copy is renamed.
    mask_tensors = {n.input[i] for n in gqa for i in _MASK_INPUTS if len(n.input) > i and n.input[i]}
    mask_nodes = _ancestors(graph, mask_tensors)
    mask_ids = {id(n) for n in mask_nodes}
    renamed = {io.INPUT_IDS: chunk_name(io.INPUT_IDS), io.ATTENTION_MASK: chunk_name(io.ATTENTION_MASK)}
    renamed |= {o: chunk_name(o) for n in mask_nodes for o in n.output if o}
    chunk_mask = []
    for n in mask_nodes:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.name = chunk_name(n.name) if n.name else ""
        c.input[:] = [renamed.get(i, i) for i in n.input]
        c.output[:] = [renamed.get(o, o) for o in n.output]
        chunk_mask.append(c)

    # Both streams' tokens on one axis: [1, B + C].
    def const(name: str, values: list[int]) -> str:
        graph.initializer.append(helper.make_tensor(name, TensorProto.INT64, [len(values)], values))
        return name

    row = const("mixed_row_shape", [1, -1])
    rows3 = const("mixed_rows_shape", [-1, 1, 0])  # [1, B, X] -> [B, 1, X]
    tokens3 = const("mixed_tokens_shape", [1, -1, 0])  # [B, 1, X] -> [1, B, X]
    one = const("mixed_one", [1])
    mixed_ids, mixed_positions = "mixed_input_ids", "mixed_position_ids"
    prelude = [
        helper.make_node("Reshape", [io.INPUT_IDS, row], ["mixed_decode_ids"]),
        helper.make_node("Concat", ["mixed_decode_ids", chunk_name(io.INPUT_IDS)], [mixed_ids], axis=1),
        helper.make_node("Reshape", [io.POSITION_IDS, row], ["mixed_decode_positions"]),
        helper.make_node("Concat", ["mixed_decode_positions", chunk_name(io.POSITION_IDS)], [mixed_positions], axis=1),
        helper.make_node("Shape", [io.INPUT_IDS], ["mixed_b"], start=0, end=1),
        helper.make_node("Shape", [chunk_name(io.INPUT_IDS)], ["mixed_c"], start=1, end=2),
        helper.make_node("Concat", ["mixed_b", "mixed_c"], ["mixed_split"], axis=0),
        # The rows unembedded: every decode row, then the chunk's last token (B + C - 1).
        helper.make_node("Squeeze", ["mixed_b"], ["mixed_b_scalar"]),
        helper.make_node("Range", ["mixed_zero_s", "mixed_b_scalar", "mixed_one_s"], ["mixed_decode_rows"]),
        helper.make_node("Add", ["mixed_b", "mixed_c"], ["mixed_total"]),
        helper.make_node("Sub", ["mixed_total", one], ["mixed_chunk_last"]),
        helper.make_node("Concat", ["mixed_decode_rows", "mixed_chunk_last"], ["mixed_rows"], axis=0),
    ]
    graph.initializer.extend([helper.make_tensor("mixed_zero_s", TensorProto.INT64, [], [0]),
                              helper.make_tensor("mixed_one_s", TensorProto.INT64, [], [1])])

    nodes = []
    for n in graph.node:
        if id(n) in mask_ids:
            nodes.append(n)
            continue
        if n is unembed:
            nodes.append(helper.make_node("Gather", [hidden_out, "mixed_rows"], ["mixed_hidden"], axis=1))
            n.input[0] = "mixed_hidden"
            nodes.append(n)
            continue
        if n.op_type != GQA or n.domain != MSFT:
            n.input[:] = [{io.INPUT_IDS: mixed_ids, io.POSITION_IDS: mixed_positions}.get(i, i) for i in n.input]
            nodes.append(n)
            continue
        tag = n.name or n.output[0]
        qkv, out = n.input[0], n.output[0]
        d_in, c_in, d_in3, d_out, c_out, d_out1 = (f"{tag}/{s}" for s in ("qkv_decode", "qkv_chunk", "qkv_rows",
                                                                            "out_rows", "out_chunk", "out_decode"))
        decode = onnx.NodeProto()
        decode.CopyFrom(n)
        decode.name = f"{tag}/decode"
        decode.input[0] = d_in3
        decode.output[0] = d_out
        chunk = onnx.NodeProto()
        chunk.CopyFrom(n)
        chunk.name = f"{tag}/chunk"
        chunk.input[:] = [c_in] + [chunk_name(i) if j in _PAST_INPUTS else renamed.get(i, i)
                                   for j, i in enumerate(n.input)][1:]
        chunk.output[:] = [c_out] + [chunk_name(o) for o in n.output[1:]]
        nodes += [
            helper.make_node("Split", [qkv, "mixed_split"], [d_in, c_in], axis=1),
            helper.make_node("Reshape", [d_in, rows3], [d_in3]),
            decode,
            chunk,
            helper.make_node("Reshape", [d_out, tokens3], [d_out1]),
            helper.make_node("Concat", [d_out1, c_out], [out], axis=1),
        ]
    del graph.node[:]
    graph.node.extend(chunk_mask + prelude + nodes)

    # The chunk's inputs and outputs: batch 1, its own sequence, past and total lengths.
    dims = {io.BATCH: 1, io.SEQUENCE: io.CHUNK_SEQUENCE, io.PAST: io.CHUNK_PAST, io.TOTAL: io.CHUNK_TOTAL}
    extra_in = [_renamed_io(i, dims) for i in src.input
                if i.name in (io.INPUT_IDS, io.ATTENTION_MASK, io.POSITION_IDS) or i.name.startswith("past_key_values.")]
    graph.input.extend(extra_in)
    logits = next(o for o in graph.output if o.name == io.LOGITS)
    shape = logits.type.tensor_type.shape
    shape.dim[0].dim_value = 1
    shape.dim[1].dim_param = io.MIXED_ROWS
    graph.output.extend(_renamed_io(o, dims) for o in src.output if o.name != io.LOGITS)
    _without_dead_nodes(graph)
    onnx.checker.check_model(model)
    return model
