"""Weights in and out: run checkpoints, the Hugging Face hub, converters from and to transformers,
timm and open_clip, and ``load_init`` for ``model.init_from``."""
