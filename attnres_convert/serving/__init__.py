"""Serving converted models in inference engines (vLLM). Nothing here is shipped next to converted weights:
a converted folder keeps loading without this package, and this package imports an engine only when the engine
asks for it (see vllm_plugin.py)."""
