"""Text: the GGUF vocabulary's tokenizer (BPE and SentencePiece) and chat
templates."""
