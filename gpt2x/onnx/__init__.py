"""The ONNX layer: names, the export folder's contract (artifact), tracing, optimisation, interop files and the
pipeline (build). names, artifact and interop need no torch; ops, trace and build do; optimize needs onnx and
ONNX Runtime's tools only."""
