"""Vision models: ViT, DeiT's distilled ViT, Swin, and any timm model."""
