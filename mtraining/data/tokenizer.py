"""One tokenizer for training documents and evaluation prompts, built on transformers.

Training and evaluation differ in two options, both explicit: whether ``encode`` adds the tokenizer's
special tokens (a BOS before prompts; never inside training documents, which are joined by a
separator instead), and where the EOS comes from (the one the tokenizer declares; documents fall back
to common EOS names because they need a separator, answers stop only at a declared EOS).

Text is always text: a special-token string written inside a document or a prompt (``<|endoftext|>`` in
a tokenizer's source, ``<|im_end|>`` in a chat log) is tokenised as the characters it is made of
(``TEXT_OPTIONS``), so special ids come only from ``add_special_tokens`` and a separator id only ever ends
a document. The token cache keys its entries by ``TEXT_OPTIONS``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import overload

import numpy as np

from .documents import DataError

TEXT_OPTIONS = {"split_special_tokens": True}
"""How ``Tokenizer.encode`` reads text: special-token strings as plain text (part of the token cache's key)."""
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
_BOUNDARY_CHARS = 1024  # characters before a continuation that decide how it is tokenised
FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Files that make a folder a tokenizer folder for ``Tokenizer.from_folder``."""


class Tokenizer:
    """Text <-> ids through a transformers tokenizer (``hf``).

    ``add_special_tokens``: ``encode`` adds the tokenizer's special tokens (BOS where it adds one).
    ``eos``: the EOS token the tokenizer declares, or None. ``fingerprint``: sha256 of the
    tokenizer.json bytes when built from exactly that file (token caches are keyed by it), else None.
    """

    def __init__(
        self, hf, path: Path, *, add_special_tokens: bool, eos: str | None, fingerprint: str | None = None
    ) -> None:
        self.hf = hf
        self.path = path
        self.add_special_tokens = add_special_tokens
        self.eos = eos
        self.fingerprint = fingerprint

    @classmethod
    def from_file(cls, path: str | Path, *, add_special_tokens: bool) -> Tokenizer:
        """Exactly the tokenizer.json at ``path``, or in folder ``path`` (with its tokenizer_config.json's EOS)."""
        from tokenizers import Tokenizer as Backend
        from transformers import PreTrainedTokenizerFast

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"no tokenizer at {path}: give a tokenizer.json file or a directory that holds one")
        raw = file.read_bytes()
        try:
            backend = Backend.from_str(raw.decode("utf-8"))
        except Exception as err:  # tokenizers raises a bare Exception for malformed files
            raise DataError(
                f"{file} is not a valid tokenizer.json ({str(err).splitlines()[0]}); "
                "copy it again from the model, or point data.tokenizer at another"
            ) from None
        hf = PreTrainedTokenizerFast(tokenizer_object=backend)
        eos = _declared_eos(file.parent) if path.is_dir() else None
        fingerprint = hashlib.sha256(raw).hexdigest()
        return cls(hf, file, add_special_tokens=add_special_tokens, eos=eos, fingerprint=fingerprint)

    @classmethod
    def from_folder(cls, folder: str | Path, *, add_special_tokens: bool) -> Tokenizer:
        """A Hugging Face tokenizer folder as AutoTokenizer loads it (its special tokens, sentencepiece-only ones too)."""
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        return cls(hf, Path(folder), add_special_tokens=add_special_tokens, eos=hf.eos_token)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size with the added tokens."""
        return len(self.hf)

    def _id(self, token: str) -> int | None:
        return self.hf.backend_tokenizer.token_to_id(token)

    def token_id(self, token: str) -> int:
        tid = self._id(token)
        if tid is None:
            raise DataError(
                f"token {token!r} is not in the vocabulary of {self.path}; set data.separator to one that is"
            )
        return tid

    def separator_id(self, separator: str | None) -> int:
        """Id of ``separator``, or when None of the declared EOS, else of a common EOS name."""
        if separator is not None:
            return self.token_id(separator)
        for token in ((self.eos,) if self.eos else ()) + _EOS_CANDIDATES:
            if self._id(token) is not None:
                return self._id(token)
        raise DataError(f"cannot tell the EOS token of {self.path}; set data.separator (e.g. '</s>')")

    @property
    def special_tokens(self) -> list[str]:
        """The strings of the special tokens (text that spells one is still tokenised as text)."""
        return [t.content for t in self.hf.added_tokens_decoder.values() if t.special]

    @property
    def stop_ids(self) -> list[int]:
        """Token ids that end an answer: the declared EOS, if any."""
        tid = self._id(self.eos) if self.eos else None
        return [] if tid is None else [tid]

    @property
    def eos_id(self) -> int | None:
        ids = self.stop_ids
        return ids[0] if ids else None

    @overload
    def encode(self, text: str) -> list[int]: ...
    @overload
    def encode(self, text: list[str]) -> list[list[int]]: ...
    def encode(self, text: str | list[str]) -> list[int] | list[list[int]]:
        """Ids of one text, or of each text of a list (one batch through the fast tokenizer); special-token
        strings in the text are text (``TEXT_OPTIONS``)."""
        return self.hf(text, add_special_tokens=self.add_special_tokens, return_attention_mask=False, **TEXT_OPTIONS)[
            "input_ids"
        ]

    def continuation(self, prompt: str, text: str) -> list[int]:
        """Ids of ``text`` where it follows ``prompt``: those ``encode(prompt + text)`` adds after ``encode(prompt)``
        (read on the prompt's last ``_BOUNDARY_CHARS`` characters: tokens never reach that far), or, where the
        two meet inside one token, ``text``'s own ids without special tokens."""
        tail = prompt[-_BOUNDARY_CHARS:]
        head, whole = self.encode([tail, tail + text])
        if whole[: len(head)] == head:
            return whole[len(head) :]
        return self.hf(text, add_special_tokens=False, return_attention_mask=False, **TEXT_OPTIONS)["input_ids"]

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)


def refuse_separator_inside(ids: np.ndarray, separator: int, tokenizer: Tokenizer, where: str) -> None:
    """DataError when a document's ids (``where`` names it) hold the separator: a separator the text can spell
    (not a special token) would make document boundaries where none was written."""
    if (ids == separator).any():
        token = tokenizer.hf.convert_ids_to_tokens(separator)
        raise DataError(
            f"{where} holds the separator {token!r} (id {separator}) inside its text, so its documents could not "
            "be told apart; name a special token of the tokenizer as the separator (its EOS, the default)"
        )


def TextTokenizer(path: str | Path) -> Tokenizer:  # noqa: N802 - the name training code and bench scripts use
    """The training tokenizer: exactly the tokenizer.json at (or in) ``path``, documents without special tokens."""
    return Tokenizer.from_file(path, add_special_tokens=False)


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
