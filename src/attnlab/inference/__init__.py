"""Turning a trained net into outputs: a run rebuilt from its checkpoint, decoding, generation,
prediction. Imports models and data, never tasks: the tasks call it."""
