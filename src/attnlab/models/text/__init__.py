"""Text models: GPT (decoder-only), BERT (encoder-only), the Transformer encoder-decoder, RNN
seq2seq with attention."""
