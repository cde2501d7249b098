"""The ONNX layer: I/O names, the export folder's contract (artifact), tracing, graph optimisation,
files for other loaders (interop), and the export pipeline (build).

`names`, `artifact` and `interop` need no torch; `ops`, `trace` and `build` do (the `export` extra);
`optimize` needs onnx and ONNX Runtime's tools only."""
