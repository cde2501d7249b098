"""The serving core, framework-free: the scheduler plans each step (scheduler.py), the runner executes
it on the backend (runner.py), the engine's thread loops and tells each row its typed outputs
(engine.py, outputs.py); prompt prefixes' KV kept for reuse (prefix_cache.py). Imports no web
framework and no Ray."""
