"""LightningModules: losses, metrics and optimizers around the models."""

from attnlab.tasks.captioning import CaptioningTask
from attnlab.tasks.classification import ImageClassificationTask
from attnlab.tasks.contrastive import ContrastiveTask
from attnlab.tasks.language_model import LanguageModelTask
from attnlab.tasks.masked_lm import MaskedLMTask
from attnlab.tasks.text_classification import TextClassificationTask
from attnlab.tasks.translation import TranslationTask

__all__ = [
    "CaptioningTask",
    "ContrastiveTask",
    "ImageClassificationTask",
    "LanguageModelTask",
    "MaskedLMTask",
    "TextClassificationTask",
    "TranslationTask",
]
