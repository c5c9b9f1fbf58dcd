"""The generation engine: continuous batching over a static KV cache (see engine.py)."""
