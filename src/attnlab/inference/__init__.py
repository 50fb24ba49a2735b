"""Turning a trained net into outputs: rebuild a run from its checkpoint, generate text, decode
(greedy, beam search) and translate sentences, classify images and sentences, fill masks, zero-shot
class embeddings from prompt templates. Imports models and data, never tasks: the tasks call it."""
