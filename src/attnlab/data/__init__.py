"""DataModules, datasets, tokenizers and downloads."""

from attnlab.data.multimodal.captioning import CaptionsFolderDataModule
from attnlab.data.multimodal.image_text import ImageTextDataModule
from attnlab.data.text.classification import SentenceClassificationDataModule, TokenClassificationDataModule
from attnlab.data.text.language_modeling import TextDataModule
from attnlab.data.text.masked_lm import MaskedLMDataModule
from attnlab.data.text.translation import TranslationDataModule
from attnlab.data.vision.classification import ImageClassificationDataModule
from attnlab.data.vision.files import ImageFilesDataModule
from attnlab.data.vision.scenes import ScenesDataModule

__all__ = [
    "CaptionsFolderDataModule",
    "ImageClassificationDataModule",
    "ImageFilesDataModule",
    "ImageTextDataModule",
    "MaskedLMDataModule",
    "ScenesDataModule",
    "SentenceClassificationDataModule",
    "TextDataModule",
    "TokenClassificationDataModule",
    "TranslationDataModule",
]
