"""Using trained runs: rebuild one from its checkpoint, generate text, translate sentences."""
