"""Local data: finding and reading documents, tokenising them once into a cache, memory-mapped token streams."""

from .documents import DataError, file_kind, find_files, read_documents, read_records
from .tokenizer import TextTokenizer, Tokenizer
from .tokens import TokenStream, open_token_file

__all__ = [
    "DataError",
    "TextTokenizer",
    "Tokenizer",
    "TokenStream",
    "file_kind",
    "find_files",
    "open_token_file",
    "read_documents",
    "read_records",
]
