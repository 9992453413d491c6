"""Analysis of a model: held-out evaluation, depth-attention inspection, plots."""
