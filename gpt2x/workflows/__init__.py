"""The one place that turns user choices (model, backend, provider, precision, export folder) into a running
backend or an export, one module per job. No torch at module level: what needs it checks the `export` extra
first (runtime.registry.require_export_extra).
"""
