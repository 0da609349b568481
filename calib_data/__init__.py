"""Bundled calibration and evaluation text (added with the AWQ/GPTQ issue)."""
