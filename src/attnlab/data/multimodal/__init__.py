"""Data of more than one modality: image-caption pairs for CLIP."""
