"""DataModules, datasets, tokenizers and downloads."""

from attnlab.data.text import TextDataModule
from attnlab.data.translation import TranslationDataModule

__all__ = ["TextDataModule", "TranslationDataModule"]
