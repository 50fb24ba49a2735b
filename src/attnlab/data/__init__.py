"""DataModules, datasets, tokenizers and downloads."""

from attnlab.data.text import TextDataModule

__all__ = ["TextDataModule"]
