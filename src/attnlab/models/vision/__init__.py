"""Vision models: ViT, DeiT's distilled ViT, Swin, the Perceiver, and any timm model."""
