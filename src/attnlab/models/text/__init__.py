"""Text models: GPT, BERT, the Transformer encoder-decoder, RNN seq2seq with attention."""
