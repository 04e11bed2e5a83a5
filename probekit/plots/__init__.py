"""Figures: one module per analysis (matplotlib, Agg backend)."""
