"""The one place that turns user choices (model name, backend, provider, precision, export folder)
into a running backend or an export; the CLI, the bench and the benchmark scripts all come here. One
module per job: backends, models, exports, transformers_js (the transformers.js layout), drafts
(speculative decoding), training. Callers import a name from the module that defines it.

Nothing here imports torch at module level: running an existing export needs ONNX Runtime alone. The
functions that need PyTorch first check that the `export` extra is installed
(runtime.registry.require_export_extra), then import the torch-side modules of the lower layers.
"""
