"""The HuggingFace hub: pushing a folder that loads (checked against the loading contract first)."""
