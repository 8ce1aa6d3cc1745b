"""Everything about a run that can be checked without GPUs, all at once: ``mtraining check``.

``check_run`` looks at the config as it will be launched (``Launch``: ranks per node and nodes) and
collects every problem instead of stopping at the first: the world and ring shape, the output folders,
optional packages, the model folder (config.json, the safetensors headers against the parameter shapes of
the config, read without loading a weight), the tokenizer, every data source (exists, readable, the first
record of its first text file, token files against the vocabulary), the resume (the newest checkpoint's
recorded run against this one: a changed schedule is refused here), free disk, and on several nodes where
the shared storage must be. The launcher (``mtraining train --nproc``) and every rank of a run started by
torchrun directly (train/trainer.py) run it before building the model, so all problems are one message.

Problems make a run impossible (exit 2); warnings are printed and the run goes on. ``mtraining check``
also prints the estimates of train/estimate.py (memory per GPU, time per step).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data.documents import DataError, file_kind, find_files, read_documents
from ..ops.sparse import fa4
from .config import Config
from .estimate import size_text
from .ring_choice import RingChoice, choose_ring

if TYPE_CHECKING:
    from .data import Source

CHECKED_ENV = "MTRAINING_CHECKED"
"""Set to 1 by the ``--nproc`` launcher once these checks passed on its node: its ranks need not repeat them."""
_HEADER_LIMIT = 100 << 20  # a safetensors header larger than this is not one
# filesystems that live on one machine: a folder there is not shared between nodes
_LOCAL_FILESYSTEMS = ("ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "ramfs")


@dataclass(frozen=True)
class Launch:
    """How the run will be started: ``nproc`` ranks on each of ``nnodes`` nodes."""

    nproc: int
    nnodes: int = 1

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


@dataclass
class Report:
    """What ``check_run`` found: problems (the run cannot start), warnings and notes (printed)."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def run(self, check: Callable[..., Any], *args: Any, where: str = "") -> Any:
        """``check(*args)``, or None with its ValueError recorded as a problem (prefixed ``where: ``)."""
        try:
            return check(*args)
        except ValueError as err:
            self.problems.append(f"{where}: {err}" if where else str(err))
            return None

    def raise_problems(self) -> None:
        """ValueError listing every problem (one message for the command line), if there is one."""
        if len(self.problems) == 1:
            raise ValueError(self.problems[0])
        if self.problems:
            raise ValueError(f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass
class Findings:
    """What the checks learnt along the way, for the later checks and the estimates."""

    hf_config: Any = None
    model: Any = None  # the model on the meta device
    ring: RingChoice | None = None
    tokenizer: Any = None
    token_parts: list = field(default_factory=list)
    """The token files (data.TokenPart: their largest id); text is tokenised later."""
    text_files: list[Path] = field(default_factory=list)


def check_run(cfg: Config, launch: Launch) -> tuple[Report, Findings]:
    """Every check of the module docstring; never raises for a problem it can name."""
    report, found = Report(), Findings()
    report.run(cfg.check_world_size, launch.world_size)
    _outputs(cfg, report)
    _packages(cfg, report)
    found.hf_config = report.run(_hf_config, cfg)
    if found.hf_config is not None:
        found.model = report.run(_meta_model, found.hf_config)
        found.ring = report.run(choose_ring, cfg, launch.nproc, found.hf_config)
        report.run(_model_fits_mtraining, cfg, found.hf_config)
        if cfg.model.path is not None and found.model is not None:
            _weights(Path(cfg.model.path), found.model, found.hf_config, report)
    _data(cfg, found, report)
    found.tokenizer = _tokenizer(cfg, report, needed=bool(found.text_files) or cfg.data.document_masking)
    _separator(cfg, found, report)
    if found.hf_config is not None:
        _vocabularies(cfg, found, report)
    if found.model is not None:
        _resume(cfg, found, report)
        _free_space(cfg, found.model, report)
    if launch.nnodes > 1:
        _shared_storage(cfg, report)
    return report, found


# ---------------------------------------------------------------------------------------------- outputs, packages
def _writable(path: str) -> str | None:
    """Why the run could not write into ``path`` (created if missing), or None. Creates nothing but a probe file,
    removed at once, in ``path`` or its nearest existing folder (permission bits do not tell root's writes)."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        return "is a file, not a folder"
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot be created: {existing} is a file"
    probe = existing / f".mtraining-check-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        return (
            f"is not writable ({err.strerror})"
            if existing == folder
            else f"cannot be created: {existing} is not writable"
        )
    return None


def _outputs(cfg: Config, report: Report) -> None:
    for key, path in (
        ("checkpoint.dir", cfg.checkpoint.dir),
        ("checkpoint.export_dir", cfg.checkpoint.export_dir),
        ("log.dir", cfg.log.dir),
        ("data.cache_dir", cfg.data.cache_dir),
    ):
        if path is not None and (why := _writable(path)):
            report.problems.append(f"{key}={path}{cfg.path_note(key)} {why}; set {key} to a writable folder")


def _packages(cfg: Config, report: Report) -> None:
    wanted = []
    if cfg.log.wandb is not None:
        wanted.append(("wandb", "log.wandb", "wandb"))
    if cfg.train.fused_kernels == "liger":
        wanted.append(("liger_kernel", "train.fused_kernels=liger", "liger"))
    if cfg.train.loss_impl == "liger":
        wanted.append(("liger_kernel", "train.loss_impl=liger", "liger"))
    for module, key, extra in wanted:
        if importlib.util.find_spec(module) is None:
            name = key.split("=")[0]
            report.problems.append(f'{key} needs the {module} package: pip install -e ".[{extra}]" (or change {name})')
    if cfg.attention.backend == "fa4" and not fa4.installed():
        report.problems.append(
            "attention.backend=fa4 needs FlashAttention-4 (flash_attn.cute): pip install flash-attn-4 "
            "(CUDA, Hopper or Blackwell), or set attention.backend=triton"
        )


# ---------------------------------------------------------------------------------------------- the model
def _hf_config(cfg: Config):
    from ..models.loader import build_config

    path = cfg.model.path
    if path is not None and not Path(path).exists():
        raise ValueError(f"model.path: {path} does not exist{cfg.path_note('model.path')}")
    try:
        return build_config(**cfg.model.hf_kwargs())
    except ValueError as err:
        raise ValueError(f"{'model.path' if path else 'model.config'}: {err}") from None


def _meta_model(hf_config):
    """The model on the meta device: parameter names and shapes without memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def check_model(cfg: Config, hf_config, sources: list[Source]) -> None:
    """ValueError naming the fix when the model cannot train on this data with mtraining attention (every rank
    repeats it on the model it loads)."""
    from ..models.loader import sliding_window_layers
    from .data import check_vocabulary

    where = cfg.model.path or "model.config"
    check_vocabulary(sources, hf_config.vocab_size, cfg.data.token_dtype)
    layers = sliding_window_layers(hf_config)
    if layers:
        raise ValueError(
            f"{where} uses sliding-window attention (window {hf_config.sliding_window}) in layers {layers}, which "
            "mtraining attention does not run (it attends causally over the whole sequence); train with full "
            "attention: model.overrides: {use_sliding_window: false} for Qwen2/Qwen3, {sliding_window: null} for Mistral"
        )
    if getattr(hf_config, "attention_dropout", 0.0):
        raise ValueError(
            f"{where} sets attention_dropout={hf_config.attention_dropout}, which mtraining attention does not "
            "support; set model.overrides: {attention_dropout: 0.0}"
        )


def _model_fits_mtraining(cfg: Config, hf_config) -> None:
    check_model(cfg, hf_config, [])  # the data's ids: _vocabularies
    cfg.check_layers(hf_config.num_hidden_layers)


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes), read without the tensors."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than a header")
            (size,) = struct.unpack("<Q", raw)
            if size > _HEADER_LIMIT:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise ValueError(f"{path} is not a readable safetensors file ({err}); copy it again") from None
    if path.stat().st_size < 8 + size + end:
        raise ValueError(f"{path} is truncated: its header describes {8 + size + end} bytes, the file has fewer")
    return header


def _weights(folder: Path, model, hf_config, report: Report) -> None:
    """The weights in ``folder`` against the model's parameters: every one present, of the right shape."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        report.problems.append(f"model.path: {folder} has no *.safetensors weights; export or convert the model")
        return
    shapes: dict[str, list[int]] = {}
    for file in files:
        header = report.run(safetensors_header, file, where="model.path")
        if header is None:
            return
        shapes.update({k: t["shape"] for k, t in header.items() if k != "__metadata__"})
    expected = {name: list(p.shape) for name, p in model.state_dict().items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        head = model.get_output_embeddings()
        expected = {n: s for n, s in expected.items() if not (head is not None and n.startswith("lm_head."))}
    missing = [n for n in expected if n not in shapes]
    reshaped = [n for n in expected if n in shapes and shapes[n] != expected[n]]
    unexpected = [n for n in shapes if n not in expected and not n.startswith("lm_head.")]
    if missing:
        report.problems.append(
            f"model.path: {folder} lacks {len(missing)} of the model's {len(expected)} weights (e.g. {missing[0]}); "
            "they would start random: check that config.json belongs to these weights"
        )
    if reshaped:
        n = reshaped[0]
        report.problems.append(
            f"model.path: {len(reshaped)} weights in {folder} do not have the shapes config.json (with model.overrides) "
            f"gives, e.g. {n}: {shapes[n]} in the files, {expected[n]} from the config; fix config.json or the overrides"
        )
    if unexpected:
        report.warnings.append(
            f"model.path: {len(unexpected)} tensors in {folder} are not weights of the model (e.g. {unexpected[0]}); "
            "they are ignored"
        )


# ---------------------------------------------------------------------------------------------- tokenizer and data
def _tokenizer_source(cfg: Config) -> tuple[str | None, str]:
    """(tokenizer path, the key it comes from) : data.tokenizer, else model.path."""
    if cfg.data.tokenizer is not None:
        return cfg.data.tokenizer, "data.tokenizer"
    return cfg.model.path, "model.path"


def _tokenizer(cfg: Config, report: Report, needed: bool):
    """The training tokenizer (data.tokenizer, else model.path's), loaded; problems where it cannot be. One that
    only model.path would give is looked for when ``needed`` (text to tokenise, document masking)."""
    from ..data.tokenizer import TextTokenizer

    path, key = _tokenizer_source(cfg)
    if path is None:
        return None
    if key == "model.path":
        if not needed or not Path(path).is_dir():
            return None  # without a need, nothing; a missing model.path is the model check's problem
        if not (Path(path) / "tokenizer.json").is_file():
            report.problems.append(
                f"data.tokenizer is not set, so the tokenizer comes from model.path, and {path} has no tokenizer.json; "
                "set data.tokenizer to a tokenizer.json or a folder holding one"
            )
            return None
    elif not Path(path).exists():
        report.problems.append(f"data.tokenizer: {path} does not exist{cfg.path_note('data.tokenizer')}")
        return None
    return report.run(TextTokenizer, path, where=key)


def _probe(path: Path, text_field: str) -> None:
    """DataError if the first document of a text file cannot be read (format, UTF-8, the text field)."""
    next(iter(read_documents(path, text_field)), None)


def _data(cfg: Config, found: Findings, report: Report) -> None:
    """Every source: its files exist and are readable; the first document of its first text file reads; token
    files open and their largest id is known (scanned once, remembered by the token cache), and a source of
    token files makes at least one sample. Text is not read further here: the launcher tokenises it (or
    ``mtraining tokenize``) and checks its sources' samples and largest id then."""
    from ..data.tokens import TokenPart, open_token_file, scan_max

    d = cfg.data
    for i, spec in enumerate(d.source_specs):
        key = f"data.sources[{i}]"
        if not glob.has_magic(spec.path) and not Path(spec.path).exists():
            report.problems.append(f"{key}: {spec.path} does not exist{cfg.path_note(key)}")
            continue
        try:
            files = find_files(spec.path)
        except DataError as err:
            report.problems.append(f"{key}: {err}{cfg.path_note(key)}")
            continue
        unreadable = [f for f in files if not os.access(f, os.R_OK)]
        if unreadable:
            report.problems.append(
                f"{key}: {len(unreadable)} files cannot be read, e.g. {unreadable[0]}; fix permissions"
            )
            continue
        text = [f for f in files if file_kind(f) != "tokens"]
        if text:
            report.run(_probe, text[0], spec.text_field or d.text_field, where=key)
            found.text_files += text
            if _tokenizer_source(cfg)[0] is None:
                report.problems.append(
                    f"{key}: {text[0]} is text: set data.tokenizer (a tokenizer.json or a model folder) so it can "
                    "be tokenised"
                )
        tokens = 0
        for f in (f for f in files if file_kind(f) == "tokens"):
            array = report.run(open_token_file, f, d.token_dtype, where=key)
            max_id = report.run(scan_max, f, d.token_dtype, where=key) if array is not None else None
            if array is None or max_id is None:
                text = [f]  # unknown: not counted below
                continue
            tokens += len(array)
            found.token_parts.append(TokenPart(str(f), array.dtype.name, len(array), max_id, str(f)))
        if not text and tokens < d.seq_len + 1:
            report.problems.append(
                f"{key} holds {tokens} tokens, fewer than one sample of data.seq_len + 1 = {d.seq_len + 1}; "
                "add data or lower data.seq_len"
            )
    if found.text_files:
        size = sum(f.stat().st_size for f in found.text_files)
        report.notes.append(
            f"data: {len(found.text_files)} text files ({size / 1e6:,.1f} MB); the launcher tokenises what the token "
            "cache lacks before the ranks start (or run `mtraining tokenize CONFIG` ahead), then checks each "
            "source's samples and largest token id"
        )


def _separator(cfg: Config, found: Findings, report: Report) -> None:
    """The token that ends documents, where text is tokenised or documents are masked."""
    from .data import document_separator

    d = cfg.data
    if found.tokenizer is not None and (found.text_files or d.document_masking):
        report.run(found.tokenizer.separator_id, d.separator, where="data.separator")
    elif d.document_masking and _tokenizer_source(cfg)[0] is None:
        report.run(document_separator, cfg)


def _vocabularies(cfg: Config, found: Findings, report: Report) -> None:
    """The token files' ids (data.check_vocabulary) and the tokenizer's size against the model's vocabulary."""
    from .data import Source, check_vocabulary

    vocab = found.hf_config.vocab_size
    files = Source("token files", found.token_parts, None, len(found.token_parts))
    report.run(check_vocabulary, [files], vocab, cfg.data.token_dtype)
    if found.tokenizer is not None and found.text_files and found.tokenizer.vocab_size > vocab:
        report.warnings.append(
            f"the tokenizer {found.tokenizer.path} has {found.tokenizer.vocab_size} tokens, more than the model's "
            f"vocab_size {vocab}: is it the model's own? Text holding the others would fail after tokenising"
        )


# ---------------------------------------------------------------------------------------------- resume and disks
def _resume(cfg: Config, found: Findings, report: Report) -> None:
    """The checkpoint the run would resume from, as ``newest_verified`` picks it with its files checked by size
    (the run hashes them too before it loads one), and its recorded run against this one (``check_resume``: a
    changed schedule, another model or tokenizer are refused). Skipped inside the ranks of a run (a process group
    is up): the trainer's own resume decides there, in step on every rank."""
    import torch.distributed as dist

    from .checkpoint import CheckpointError, checkpoints, newest_verified
    from .loss import CausalLMLoss
    from .resume import check_resume, describe_run, model_identity

    ck = cfg.checkpoint
    if not ck.resume or not checkpoints(ck.dir) or dist.is_initialized():
        return
    skipped: list[str] = []
    try:
        picked = newest_verified(ck.dir, skipped.append, hashes=False)
    except CheckpointError as err:
        report.problems.append(f"resume: {err}")
        return
    report.warnings += skipped
    if picked is None:
        report.warnings.append(f"resume: no checkpoint in {ck.dir} verifies: the run starts from step 0")
        return
    path, manifest = picked
    identity = model_identity(found.hf_config, CausalLMLoss(found.model).state_dict())
    current = describe_run(cfg, identity, cfg.parallel.data, cfg.parallel.context)
    notes = report.run(check_resume, manifest["run"], current, manifest["step"], cfg, path.name, where="resume")
    size = sum(f["bytes"] for f in manifest["files"].values())
    report.notes.append(
        f"resume: from {path} (step {manifest['step']}, {size_text(size)}; the run hashes its files before it "
        "loads them)"
    )
    report.notes += [f"resume: {n}" for n in notes or []]


def checkpoint_bytes(model) -> int:
    """Bytes of one checkpoint: float32 weights and AdamW's two moments."""
    return 12 * sum(p.numel() for p in model.parameters())


def _free_space(cfg: Config, model, report: Report) -> None:
    ck = cfg.checkpoint
    if ck.dir is None:
        return
    existing = Path(ck.dir)
    while not existing.exists():
        existing = existing.parent
    free, need = shutil.disk_usage(existing).free, checkpoint_bytes(model)
    if free < need:
        report.problems.append(
            f"checkpoint.dir={ck.dir} has {size_text(free)} free but one checkpoint takes about {size_text(need)}; "
            "free space there or set checkpoint.dir to a larger disk"
        )
        return
    keep = ck.keep
    held = keep + 1 if keep else cfg.train.steps // (ck.every or cfg.train.steps) + 1
    if free < held * need:
        report.warnings.append(
            f"checkpoint.dir={ck.dir} has {size_text(free)} free; this run keeps up to {held} checkpoints of about "
            f"{size_text(need)}" + ("" if keep else " (set checkpoint.keep to keep only the newest)")
        )


def _filesystem(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) of the nearest existing folder of ``path`` (from /proc/mounts)."""
    existing = Path(path).resolve()
    while not existing.exists():
        existing = existing.parent
    best = ("/", "unknown")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        if (str(existing) == mount or str(existing).startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0]):
            best = (mount, parts[2])
    return best


def _shared_storage(cfg: Config, report: Report) -> None:
    """On several nodes every rank writes its checkpoint shards into one checkpoint.dir, and every node reads
    the model, the tokenizer, the data and the token cache: those must be storage all nodes share."""
    must = [("checkpoint.dir", cfg.checkpoint.dir, "every rank writes its shards of each checkpoint there")]
    should = [
        ("data.cache_dir", cfg.data.cache_dir, "each node would otherwise tokenise the text again"),
        ("model.path", cfg.model.path, "every node loads the weights"),
        ("log.dir", cfg.log.dir, "rank 0 writes it; resume reads the run id back"),
        ("checkpoint.export_dir", cfg.checkpoint.export_dir, "rank 0 writes the export there"),
    ]
    should += [(f"data.sources[{i}]", s.path, "every node reads the data") for i, s in enumerate(cfg.data.source_specs)]
    lines = []
    for key, path, why in must + should:
        if path is None:
            continue
        mount, fs = _filesystem(path)
        local = fs in _LOCAL_FILESYSTEMS
        lines.append(f"{key}: {path} ({fs} at {mount}{', local to this machine' if local else ''}): {why}")
        if local and key == "checkpoint.dir":
            report.warnings.append(
                f"checkpoint.dir={path} is on a {fs} filesystem ({mount}), local to this machine, but on "
                "several nodes every rank writes its shards into it: put it on storage all nodes share "
                "(NFS, Lustre, GPFS, ...), or the checkpoints of other nodes' ranks are lost"
            )
    report.notes.append("shared storage (several nodes):\n" + "\n".join(f"  {line}" for line in lines))
