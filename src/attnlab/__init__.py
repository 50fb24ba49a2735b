"""attnlab: train, sweep and compare attention architectures."""

__version__ = "0.1.0"
