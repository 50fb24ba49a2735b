"""DataModules, datasets, tokenizers and downloads."""

from attnlab.data.text.language_modeling import TextDataModule
from attnlab.data.text.translation import TranslationDataModule
from attnlab.data.vision.classification import ImageClassificationDataModule

__all__ = ["ImageClassificationDataModule", "TextDataModule", "TranslationDataModule"]
