"""LightningModules: losses, metrics and optimizers around the models."""

from attnlab.tasks.classification import ImageClassificationTask
from attnlab.tasks.language_model import LanguageModelTask
from attnlab.tasks.translation import TranslationTask

__all__ = ["ImageClassificationTask", "LanguageModelTask", "TranslationTask"]
