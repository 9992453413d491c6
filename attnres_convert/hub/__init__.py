"""The HuggingFace hub: model cards and pushing a folder that loads."""
