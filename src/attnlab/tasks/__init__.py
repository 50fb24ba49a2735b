"""LightningModules: losses, metrics and optimizers around the models."""

from attnlab.tasks.language_model import LanguageModelTask

__all__ = ["LanguageModelTask"]
