"""Fine-tuning: YAML recipes, data, optimiser, checkpoints and the training loop."""
