"""Reading and writing what conversion, fine-tuning, the hub and analysis share: model sources (hub ids,
folders, GGUF files, the embedded model), converted folders and their shards, model cards, sample text."""
