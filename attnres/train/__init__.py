"""Training: data, trainer, checkpoints and the command line."""
