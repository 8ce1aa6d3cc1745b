"""A fast tokenizer (``tokenizers``) from a tokenizer.json file or a local Hugging Face model folder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .documents import DataError

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


class TextTokenizer:
    """Text -> ids without special tokens, the separator between documents, and a content fingerprint."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"no tokenizer at {path}: give a tokenizer.json file or a directory that holds one")
        self.path = file
        raw = file.read_bytes()
        try:
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as err:  # tokenizers raises a bare Exception for malformed files
            raise DataError(
                f"{file} is not a valid tokenizer.json ({str(err).splitlines()[0]}); "
                "copy it again from the model, or point data.tokenizer at another"
            ) from None
        self.fingerprint = hashlib.sha256(raw).hexdigest()
        """sha256 of the tokenizer.json bytes (token caches are keyed by it)."""
        self._eos = _declared_eos(file.parent) if path.is_dir() else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise DataError(
                f"token {token!r} is not in the vocabulary of {self.path}; set data.separator to one that is"
            )
        return tid

    def separator_id(self, separator: str | None) -> int:
        """Id of ``separator``, or of the tokenizer's EOS when None."""
        if separator is not None:
            return self.token_id(separator)
        for token in ((self._eos,) if self._eos else ()) + _EOS_CANDIDATES:
            if self._tok.token_to_id(token) is not None:
                return self._tok.token_to_id(token)
        raise DataError(f"cannot tell the EOS token of {self.path}; set data.separator (e.g. '</s>')")

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def _declared_eos(model_dir: Path) -> str | None:
    """eos_token from a HF tokenizer_config.json, if present and readable."""
    cfg = model_dir / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        eos = json.loads(cfg.read_text()).get("eos_token")
    except ValueError as err:
        raise DataError(f"{cfg} is not valid JSON ({err}); fix or remove it") from None
    return eos.get("content") if isinstance(eos, dict) else eos
