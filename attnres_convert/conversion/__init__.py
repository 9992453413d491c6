"""Conversion: load a source model, rewrite its residuals (surgery), verify against the original, save with its model card."""
