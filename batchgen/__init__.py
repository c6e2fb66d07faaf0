"""batchgen: offline batch generation for MLX language models."""

__version__ = "0.1.0"
