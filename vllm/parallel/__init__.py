"""Parallelism applied to a built model (models themselves contain none)."""
