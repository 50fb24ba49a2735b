"""DataModules, datasets, tokenizers and downloads."""

from attnlab.data.text.language_modeling import TextDataModule
from attnlab.data.text.translation import TranslationDataModule

__all__ = ["TextDataModule", "TranslationDataModule"]
