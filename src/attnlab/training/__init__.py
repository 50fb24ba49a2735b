"""Training: the LightningModules (one task per kind of model), their optimizers and schedules,
callbacks, loggers and figures."""

from attnlab.training.captioning import CaptioningTask
from attnlab.training.classification import ImageClassificationTask
from attnlab.training.contrastive import ContrastiveTask
from attnlab.training.language_model import LanguageModelTask
from attnlab.training.masked_lm import MaskedLMTask
from attnlab.training.text_classification import TextClassificationTask
from attnlab.training.translation import TranslationTask

__all__ = [
    "CaptioningTask",
    "ContrastiveTask",
    "ImageClassificationTask",
    "LanguageModelTask",
    "MaskedLMTask",
    "TextClassificationTask",
    "TranslationTask",
]
