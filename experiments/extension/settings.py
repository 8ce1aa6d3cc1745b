"""Settings of the context-extension experiment (pipeline.py): model, curriculum, extension, budgets, evaluation.

``SCALES`` holds the scales: ``cpu`` (run and committed: 2 gloo ranks, the torch backend),
``gpu`` (one H200: L0 = 4K, 8 L0 = 32K, a ~105M model, NIAH and RULER), ``gpu-smoke`` (the GPU
path in miniature on a GPU, to catch GPU-only errors before the real run), and ``toy`` /
``toy-text`` (the CPU and the GPU pipelines in miniature on the CPU, for the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from mtraining.eval.tasks import TASKS
from mtraining.models import Init

from .recall_corpus import Shape, Vocab


@dataclass(frozen=True)
class Stage:
    """One training run's schedule: length, steps, sequences per step (all ranks), peak lr (cosine decay to
    ``min_lr_ratio`` of it), and its documents: recall documents with ``pairs`` needles (all queried; recall
    task), the mixture of ``kinds`` (text task; None: text_corpus.KINDS), or repeated segments (``repeat``).
    ``min_fill``: text documents are drawn between this fraction of a sample and a whole one (log-uniform);
    at 0 most are far shorter than the sample, so few needles sit as far back as its length."""

    seq_len: int
    steps: int
    batch: int
    lr: float
    pairs: int = 8
    warmup: int = 20
    repeat: bool = False
    kinds: tuple[str, ...] | None = None
    min_lr_ratio: float = 0.1
    min_fill: float = 0.0


@dataclass(frozen=True)
class Budget:
    """A sparse setting that keeps about the same share of the causal pairs at every length.

    ``v``: verticals per head as a fraction of the length (a vertical keeps ~1/N of the pairs);
    ``s``: slashes beyond the local window, as a fraction of the N / G block diagonals (a slash
    selects one or two whole diagonals of G-blocks, ~2G/N of the pairs each, wherever its offset
    lies: slashes scattered by retrieval heads are far more expensive than lines); the forced lines
    (sinks, local window) are the floor. In threshold mode the budgets are the caps.
    """

    name: str
    v: float
    s: float
    threshold: float | None = None
    columns: int = 0  # key columns chosen per query block of G rows (PatternConfig.block_columns)

    def pattern(self, length: int, scale: Scale) -> dict:
        """PatternConfig fields (budgets, window, estimation queries) for a sequence of ``length``."""
        fields = dict(
            v_size=min(length, max(scale.sink_tokens, round(self.v * length))),
            s_size=min(length, scale.local_window + round(self.s * length / scale.block_size)),
            last_q=min(scale.last_q, length),
            local_window=scale.local_window,
            sink_tokens=scale.sink_tokens,
        )
        if self.threshold is not None:
            fields["threshold"] = self.threshold
        if self.columns:
            fields["block_columns"] = self.columns
        return fields


@dataclass(frozen=True)
class Scale:
    """Everything one scale of the experiment needs.

    ``task`` "recall": the word-level associative-recall documents of recall_corpus.py, scored
    teacher-forced (``mtraining.eval.retrieval``); "text": the eval's own NIAH and RULER-style tasks
    (text_corpus.py corpus, ``run_niah`` / ``run_ruler``), perplexity on held-out recall logs.
    """

    name: str
    task: str
    model: dict
    l0: int
    curriculum: tuple[Stage, ...]  # base pretraining, dense; the last stage runs at l0
    extension: Stage  # at factor x l0
    base_theta: float
    theta_factor: float
    budgets: tuple[Budget, ...]
    default_budget: str
    vocab: Vocab | None = None  # recall task: the word-level vocabulary
    text_vocab: int = 0  # text task: BPE vocabulary size
    factor: int = 8
    block_size: int = 16
    last_q: int = 64
    local_window: int = 16
    sink_tokens: int = 4
    base_ranks: int = 2  # data-parallel ranks of the base (gloo ranks on the CPU, GPUs)
    ranks: int = 2  # context-parallel ranks of the extensions (striped ring) and of the evaluation
    device: str = "cpu"
    dtype: str = "float32"
    backend: str = "torch"
    eval_docs: int = 100  # recall: documents per length; text: held-out documents for perplexity
    eval_shape: Shape = Shape(pairs=8, queries=5)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    niah_samples: int = 10  # text: prompts per (length, depth) cell
    ruler_samples: int = 8  # text: prompts per (task, length)
    ruler_tasks: tuple[str, ...] = TASKS
    checkpoint_every: int = 50
    base_check: int = 0  # held-out prompts (recall: documents) checking the base at L0 before extending; 0: none
    eval_s: float = 0.0  # expected seconds of one evaluation, for --max-minutes before one has run in the call
    cross: str = "all"  # cross evaluations (dense extension sparse, sparse extensions dense): all, default, none
    activation_checkpointing: bool = False  # in the extensions (the base trains at L0 without)
    init: Init = "hf"  # the base's random weights (model.init)
    # the extensions' packed documents attend only within themselves (data.document_masking), dense and sparse
    # alike: the sparse pattern is then estimated from every document's last queries, not the sample's
    document_masking: bool = False

    def __post_init__(self) -> None:
        if self.cross not in ("all", "default", "none"):
            raise ValueError(f"cross must be 'all', 'default' or 'none', got {self.cross!r}")

    @property
    def lengths(self) -> list[int]:
        return [self.l0 * 2**i for i in range(int(math.log2(self.factor)) + 1)]

    @property
    def long(self) -> int:
        return self.l0 * self.factor

    @property
    def tasks(self) -> tuple[str, ...]:
        return ("recall",) if self.task == "recall" else ("niah", "ruler")

    @property
    def first_bucket(self) -> int:
        """Positions in the first perplexity bucket (then doubling): L0 / 2 at every length."""
        return self.l0 // 2

    def budget(self, name: str) -> Budget:
        """The scale's budget ``name``, else the named one of every scale's choices (``--budgets``)."""
        named = {b.name: b for b in (*SWEEP, *DENSER, *COLUMNS, *GPU_COLUMNS, *self.budgets)}
        if name not in named:
            raise ValueError(f"no budget {name!r} at the {self.name} scale; use one of {sorted(named)}")
        return named[name]


def qwen2(hidden: int, layers: int, heads: int, kv_heads: int, vocab_size: int, max_positions: int) -> dict:
    """A Qwen2 architecture config (tied embeddings, MLP 3x wide unless the model is the GPU's 4x)."""
    return dict(
        model_type="qwen2",
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=(4 if hidden >= 512 else 3) * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )


# Named by the density they aim at (the measured one is in the results). At 8 L0 = 2048 with G = 16:
# v3 = (v 8, s 16: the forced window only), v10 = (64, 18), v30 = (256, 24), v50 = (64, 64); t90: the
# fewest lines reaching 90% of the estimated mass, under the v30 caps. The window and sinks alone keep
# ~2.5% of the pairs at 2048 (two 16-wide block diagonals).
SWEEP = (
    Budget("v3", v=1 / 256, s=0),
    Budget("v10", v=1 / 32, s=1 / 64),
    Budget("v30", v=1 / 8, s=1 / 16),
    Budget("v50", v=1 / 32, s=3 / 8),
    Budget("t90", v=1 / 8, s=1 / 16, threshold=0.9),
)
# Denser budgets for the question which budget reaches parity (``--budgets``; not in any scale's default sweep):
# v30 with more verticals (v35: 0.336 on the CPU scale's 2048, bench/results/extension_cpu_density.json) or
# more slashes (v45: 0.481 there).
DENSER = (
    Budget("v35", v=1 / 4, s=1 / 16),
    Budget("v45", v=1 / 8, s=1 / 4),
)
# v30 with per-block columns for the questions the last rows' lines miss (``--budgets``): 16, 64 or
# 128 key columns per block of G rows (at the CPU scale's G = 16, as many columns per row as 64, 256 or 512 per
# 64-row block in local_verticals.py).
COLUMNS = (
    Budget("v30c16", v=1 / 8, s=1 / 16, columns=16),
    Budget("v30c64", v=1 / 8, s=1 / 16, columns=64),
    Budget("v30c128", v=1 / 8, s=1 / 16, columns=128),
)
# The same at the GPU scale's G = 128: 2048 columns per 128-row block are 1/16 of its longest sequence (32K), as
# v30c128's 128 are of the CPU scale's 2048, and add at most as large a share of every row's keys; 512 a quarter.
GPU_COLUMNS = (
    Budget("v30c512", v=1 / 8, s=1 / 16, columns=512),
    Budget("v30c2048", v=1 / 8, s=1 / 16, columns=2048),
)
_CPU_VOCAB = Vocab()
_TOY_VOCAB = Vocab(keys=32, values=32, words=32)
_GPU_VOCAB = 2048
RETRIEVAL_KINDS = ("niah", "niah", "niah", "vt", "recall")  # the mixture with NIAH documents weighted up
_TOY_TEXT = Scale(  # the GPU scale's path (text corpus, NIAH/RULER, one process) in miniature on the CPU
    name="toy-text",
    task="text",
    model=qwen2(128, 2, 2, 1, 384, 4096),  # head dim 64, as the Triton kernels take
    init="depth_scaled",
    text_vocab=384,
    l0=512,
    curriculum=(Stage(512, 3, 2, 1e-3, repeat=True),),
    extension=Stage(1024, 2, 1, 1e-3),
    base_theta=10_000.0,
    theta_factor=2.0,
    factor=2,
    budgets=(Budget("v10", v=1 / 16, s=1 / 16),),
    default_budget="v10",
    base_ranks=1,
    ranks=1,
    eval_docs=2,
    depths=(0.0, 1.0),
    niah_samples=1,
    ruler_samples=1,
    ruler_tasks=("niah_multikey", "vt"),
    checkpoint_every=2,
    activation_checkpointing=True,
    document_masking=True,
)
_GPU = Scale(
    name="gpu",
    task="text",
    # 105M parameters: 12 x (attention 1.57M + MLP 7.08M) + 1.6M tied embedding
    model=qwen2(768, 12, 12, 4, _GPU_VOCAB, 65536),
    # with Hugging Face's init this model copies from context only after ~3000 token-copy steps and then still
    # fails NIAH at 256; with depth_scaled output projections it copies by step ~850 in a plain loop
    # (bench/results/induction_init.json), but not when 128-token windows cut documents longer than a sample
    # (bench/results/induction_paths.json): the induction stages write one document per sample, and the base
    # retrieves (bench/results/extension_gpu.md)
    init="depth_scaled",
    text_vocab=_GPU_VOCAB,
    l0=4096,
    # induction from random token ids repeated, then copying words and seven-digit numbers (the step that
    # makes the needle's digits copyable), then NIAH at 256, the mixture at 1024 and L0
    # (bench/results/extension_gpu_base_search.json); the base check stops a base that does not retrieve
    curriculum=(
        # constant lr: copies sooner; at 1500 steps the loss fell from 5.1 to 2.0 over steps 1000-1500 only
        Stage(128, 2000, 64, 1e-3, kinds=("tokens",), min_lr_ratio=1.0),
        Stage(128, 400, 128, 1e-3, kinds=("copy",)),
        Stage(256, 500, 64, 1e-3, kinds=("niah",)),  # 100% of 10 at 256
        Stage(1024, 400, 32, 1e-3, kinds=RETRIEVAL_KINDS),  # 100% of 10 at 1024
        # documents of half a sample to a whole one, each whole in its sample: with most far shorter and cut by
        # the sample windows NIAH at L0 read 70% [48, 85] of 20 after 1200 steps (65% after 800), failing only
        # where the needle lies 3-4K tokens before the question (depth 0: 0%, 0.25: 60%, 0.5-1: 100%); so it
        # retrieves 100% of 50 at L0, RULER-style 64.7% (bench/results/extension_gpu_base.json)
        Stage(4096, 1000, 8, 6e-4, kinds=RETRIEVAL_KINDS, min_fill=0.5),
    ),
    extension=Stage(32768, 100, 2, 3e-4),
    # packed 32K samples hold many documents; estimated from the sample's last queries (the last document's),
    # the pattern can miss the others' needles: the likely reason the sparse-trained model lost 24 points at
    # 32K without masking (bench/results/extension_gpu.md), where sparse inference on the dense model did not;
    # with masking it lost 12 [-24, 0] (bench/results/extension_gpu_masked.md)
    document_masking=True,
    base_theta=10_000.0,
    theta_factor=16.0,
    # v30 plus 2048 columns per 128-row block, as the CPU scale's default: v30 alone kept retrieval but read its
    # last bucket +2.9% [+2.4, +3.4] over seven runs (bench/results/extension_gpu_replicates.md); with the
    # columns +0.28% [+0.12, +0.42] over two, retrieval at parity (bench/results/extension_gpu_columns_replicates.md)
    budgets=(GPU_COLUMNS[1],),
    default_budget="v30c2048",
    block_size=128,
    local_window=128,
    base_ranks=1,
    ranks=1,
    device="cuda",
    dtype="bfloat16",
    backend="auto",
    eval_docs=8,
    niah_samples=10,  # x 5 depths: 50 prompts per length
    ruler_samples=3,
    # the needle variants and variable tracking: the formats the corpus trains (not cwe, fwe)
    ruler_tasks=("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt"),
    cross="default",  # the default budget both ways: sparse inference on the dense model, dense on the sparse one
    checkpoint_every=200,  # a stop at --max-minutes saves its own checkpoint
    base_check=20,
    eval_s=150.0,  # the slowest evaluation measured on the H200 (a base that does not stop generating)
    activation_checkpointing=True,
)


SCALES = {
    "cpu": Scale(
        name="cpu",
        task="recall",
        model=qwen2(128, 2, 4, 2, _CPU_VOCAB.size, 4096),
        vocab=_CPU_VOCAB,
        l0=256,
        # induction first (repeated segments), then recall at 128, then at L0 (measured: bench/results/extension_cpu.md)
        curriculum=(
            Stage(64, 600, 32, 1e-3, repeat=True),
            Stage(128, 300, 16, 1e-3, pairs=8),
            Stage(256, 200, 16, 1e-3, pairs=8),
        ),
        extension=Stage(2048, 120, 2, 5e-4, pairs=16, warmup=15),
        base_theta=10_000.0,
        theta_factor=16.0,
        budgets=(*SWEEP, COLUMNS[-1]),
        # v30 with 128 columns per query block: the one setting within 3 points of dense retrieval at every length
        # and within 1% on perplexity (density 0.37 in training, bench/results/extension_cpu_columns.md); lines
        # alone reach 1% only above density 0.976 (bench/results/extension_cpu_density.json)
        default_budget="v30c128",
        base_check=100,
    ),
    "gpu": _GPU,
    "toy": Scale(
        name="toy",
        task="recall",
        model=qwen2(32, 2, 2, 1, _TOY_VOCAB.size, 1024),
        vocab=_TOY_VOCAB,
        l0=64,
        curriculum=(Stage(64, 3, 4, 1e-3, repeat=True), Stage(64, 3, 4, 1e-3, pairs=4)),
        extension=Stage(256, 3, 2, 1e-3, pairs=4),
        base_theta=10_000.0,
        theta_factor=4.0,
        factor=4,
        budgets=(Budget("v10", v=1 / 16, s=1 / 16),),
        default_budget="v10",
        base_ranks=1,
        eval_docs=3,
        eval_shape=Shape(pairs=4, queries=2),
        depths=(0.0, 1.0),
        checkpoint_every=2,
    ),
    "toy-text": _TOY_TEXT,
    # the same on a GPU, as the gpu scale runs it: bf16, Triton kernels (block 128), about two minutes
    "gpu-smoke": replace(
        _TOY_TEXT,
        name="gpu-smoke",
        l0=1024,
        extension=Stage(2048, 2, 1, 1e-3),
        curriculum=(Stage(1024, 3, 2, 1e-3, repeat=True),),
        block_size=128,
        local_window=128,
        device="cuda",
        dtype="bfloat16",
        backend="auto",
        cross="default",
    ),
}
