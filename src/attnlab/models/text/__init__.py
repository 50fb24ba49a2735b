"""Text models: GPT (decoder-only), the Transformer encoder-decoder, RNN seq2seq with attention."""
