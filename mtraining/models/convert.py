"""A GGUF checkpoint (llama.cpp's single-file format) as a Hugging Face model folder the trainer and eval load.

transformers reads GGUF itself (``from_pretrained(folder, gguf_file=...)``, with the ``gguf`` and
``accelerate`` packages). Asked with ``GgufConfig(dequantize=True)`` it unpacks every quantized weight
into a dense float tensor and drops the quantization config once the weights are in place, so
``save_pretrained`` writes an ordinary folder (without it the model keeps a GGUF quantizer, and
``save_pretrained`` refuses: "quantized with gguf and is not serializable"). The tokenizer is rebuilt
from the file's vocabulary and merges; its special tokens are set from the file's token ids, which
transformers 5.17 misreads (it names ``<|im_start|>`` as SmolLM2's EOS). The folder also gets
``gguf_source.json``: the file's name, size, sha256, architecture and quantization.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .loader import SUPPORTED_TYPES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INSTALL_HINT = 'pip install -e ".[gguf]"  (or: pip install "gguf>=0.10" "accelerate>=1.0")'
SOURCE_RECORD = "gguf_source.json"
_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


@dataclass(frozen=True)
class Converted:
    """What ``convert_gguf`` wrote."""

    out_dir: str
    model_type: str
    parameters: int
    layers: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float | None
    dtype: str
    eos_token: str | None
    seconds: float


def _check_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"reading GGUF files needs the {' and '.join(missing)} package: {INSTALL_HINT}")


def _check_paths(gguf_file: Path, out_dir: Path) -> None:
    if not gguf_file.is_file():
        raise ValueError(f"{gguf_file} does not exist or is not a file; give the path of a .gguf file")
    with open(gguf_file, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf_file} is not a GGUF file (it does not start with the bytes 'GGUF')")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir} exists and is not an empty folder; choose a new OUT_DIR or remove it")


def gguf_metadata(gguf_file: Path, keys: tuple[str, ...]) -> dict[str, object]:
    """The scalar or string-array metadata ``keys`` of a GGUF file (absent keys are left out)."""
    from gguf import GGUFReader, GGUFValueType

    fields = GGUFReader(str(gguf_file)).fields
    out: dict[str, object] = {}
    for key in keys:
        field = fields.get(key)
        if field is None:
            continue
        values = [field.parts[i] for i in field.data]
        if field.types[-1] == GGUFValueType.STRING:
            values = [bytes(v).decode("utf-8") for v in values]
        else:
            values = [v.tolist()[0] for v in values]
        out[key] = values if field.types[0] == GGUFValueType.ARRAY else values[0]
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _load_config(folder: Path, name: str):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except ValueError as err:  # transformers names an architecture it cannot read
        raise ValueError(f"transformers cannot read {folder / name}: {err}") from None
    if config.model_type not in SUPPORTED_TYPES:
        raise ValueError(
            f"{folder / name} holds a {config.model_type!r} model; mtraining trains {', '.join(SUPPORTED_TYPES)}"
        )
    return config


def _load_model(folder: Path, name: str, dtype: torch.dtype):
    """The dequantized model; RuntimeError if transformers kept any quantization on it."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers import GgufConfig
    except ImportError:  # transformers without a GGUF quantizer dequantizes on load
        options = {}
    else:
        options = {"quantization_config": GgufConfig(dequantize=True)}
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True, **options
    )
    if getattr(model, "hf_quantizer", None) is not None or getattr(model.config, "quantization_config", None):
        raise RuntimeError(
            f"transformers {_version()} kept {name} quantized; a dense model is needed to save it (upgrade transformers)"
        )
    return model.to(dtype)


def _save_tokenizer(folder: Path, name: str, out_dir: Path, special: dict[str, str]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    for attr, token in special.items():  # set after loading: transformers 5.17 ignores eos_token= when loading
        setattr(tokenizer, attr, token)
    tokenizer.save_pretrained(out_dir)
    saved = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    for attr, token in special.items():
        if getattr(saved, attr) != token:
            raise RuntimeError(f"the saved tokenizer's {attr} is {getattr(saved, attr)!r}, the GGUF says {token!r}")
    if not (out_dir / "tokenizer.json").is_file():
        raise RuntimeError(f"transformers {_version()} wrote no tokenizer.json for {name}")


def _version() -> str:
    import transformers

    return transformers.__version__


def convert_gguf(
    gguf_file: str | Path, out_dir: str | Path, dtype: str = "float32", report: Callable[[str], None] = print
) -> Converted:
    """Write ``gguf_file`` as a Hugging Face folder ``out_dir`` (config.json, model.safetensors in ``dtype``,
    tokenizer files, gguf_source.json). ValueError for a missing package, an unreadable or unsupported file,
    an unknown dtype or an ``out_dir`` that already holds files."""
    gguf_file, out_dir = Path(gguf_file).resolve(), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    _check_packages()
    _check_paths(gguf_file, out_dir)
    start = time.perf_counter()
    folder, name = gguf_file.parent, gguf_file.name
    config = _load_config(folder, name)
    meta = gguf_metadata(
        gguf_file,
        ("general.architecture", "general.name", "general.file_type", "tokenizer.ggml.tokens")
        + tuple(_SPECIAL_IDS.values()),
    )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{gguf_file} holds no tokenizer (no tokenizer.ggml.tokens); mtraining needs one")
    special = {attr: tokens[meta[key]] for attr, key in _SPECIAL_IDS.items() if 0 <= meta.get(key, -1) < len(tokens)}
    report(f"reading {gguf_file} ({config.model_type}, {config.num_hidden_layers} layers)")
    model = _load_model(folder, name, DTYPES[dtype])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _save_tokenizer(folder, name, out_dir, special)
    record = {
        "gguf": name,
        "bytes": gguf_file.stat().st_size,
        "sha256": _sha256(gguf_file),
        "architecture": meta.get("general.architecture"),
        "name": meta.get("general.name"),
        "file_type": meta.get("general.file_type"),
        "dtype": dtype,
        "transformers": _version(),
    }
    (out_dir / SOURCE_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    rope = getattr(model.config, "rope_parameters", None) or {}
    return Converted(
        out_dir=str(out_dir),
        model_type=model.config.model_type,
        parameters=sum(p.numel() for p in model.parameters()),
        layers=model.config.num_hidden_layers,
        vocab_size=model.config.vocab_size,
        max_position_embeddings=model.config.max_position_embeddings,
        rope_theta=rope.get("rope_theta", getattr(model.config, "rope_theta", None)),
        dtype=dtype,
        eos_token=special.get("eos_token"),
        seconds=round(time.perf_counter() - start, 1),
    )


def summary(result: Converted) -> str:
    """One line per field of a conversion, for the command's output."""
    return "\n".join(f"{k}: {v}" for k, v in asdict(result).items())
