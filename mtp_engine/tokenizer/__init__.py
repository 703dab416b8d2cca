"""Text to token ids and back: the byte-level BPE (`bpe`), the vocabulary read from a GGUF file
(`from_gguf`) or a Hugging Face folder (`from_hf`), prompts tokenized in bounded pieces
(`bounded`), streaming detokenization (`detokenizer`), and the `Tokenizer` that joins them."""
from .tokenizer import Tokenizer

__all__ = ["Tokenizer"]
