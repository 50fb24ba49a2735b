"""Architectures as plain ``nn.Module``s (no Lightning)."""

from attnlab.models.multimodal.clip import CLIP, TextTransformer
from attnlab.models.multimodal.flamingo import Flamingo
from attnlab.models.multimodal.show_attend_tell import ShowAttendTell
from attnlab.models.text.bert import Bert, BertPreTraining, BertSequenceClassifier, BertTokenClassifier
from attnlab.models.text.gpt import GPT
from attnlab.models.text.seq2seq import Seq2Seq
from attnlab.models.text.transformer import Transformer
from attnlab.models.vision.convnet import ConvNet
from attnlab.models.vision.perceiver import Perceiver
from attnlab.models.vision.swin import SwinTransformer
from attnlab.models.vision.timm_model import TimmModel
from attnlab.models.vision.vit import DistilledVisionTransformer, VisionTransformer

__all__ = [
    "Bert",
    "BertPreTraining",
    "BertSequenceClassifier",
    "BertTokenClassifier",
    "CLIP",
    "ConvNet",
    "Flamingo",
    "GPT",
    "Perceiver",
    "DistilledVisionTransformer",
    "Seq2Seq",
    "ShowAttendTell",
    "SwinTransformer",
    "TextTransformer",
    "TimmModel",
    "Transformer",
    "VisionTransformer",
]
