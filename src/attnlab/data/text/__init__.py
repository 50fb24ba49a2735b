"""Text data: corpora, tokenizers, language-modelling windows and parallel corpora."""
