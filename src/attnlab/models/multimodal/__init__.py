"""Models of more than one modality: CLIP, Flamingo."""
