"""Models of more than one modality: CLIP, Show, Attend and Tell, Flamingo."""
