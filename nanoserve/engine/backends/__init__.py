"""The backends that compute a step for the engine (base.py says what one does)."""
