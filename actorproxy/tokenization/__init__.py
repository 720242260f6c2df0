"""Tokenizers, chat templates and incremental detokenization (sans-IO)."""

from .tokenizer import BUILTIN_NAME as BUILTIN_NAME
from .tokenizer import ChatTokenizer as ChatTokenizer
from .tokenizer import load_tokenizer as load_tokenizer
