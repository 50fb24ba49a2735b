"""Glue for the entry points: configs, checkpoints, logging back-ends."""
