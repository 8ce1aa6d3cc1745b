"""experiments/extension/pipeline.py: the generated corpora, the budgets, the statistics, and the whole pipeline at toy size.

The pipeline tests run ``python -m experiments.extension --scale toy`` (word-level recall, 2 gloo ranks, the
striped ring) and ``--scale toy-text`` (the GPU path: BPE text corpus, NIAH/RULER, one process) on
the CPU, then check that every stage wrote what the next one reads, that the report's figures are
recomputed from the records the stages wrote, and that a second run resumes without training again.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from experiments.common.background import Background, PreparationFailed
from experiments.extension import pipeline, report, text_corpus
from experiments.extension.recall_corpus import Shape, Vocab, eval_set, make_document, train_stream, write_tokenizer
from experiments.extension.settings import SCALES, Budget, Stage
from mtraining.data.tokenizer import TextTokenizer
from mtraining.eval.engine import Response
from mtraining.eval.ppl import position_buckets
from mtraining.ops import PatternConfig

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]

V = Vocab(keys=64, values=64, words=64)


# ---------------------------------------------------------------------------------------------- corpus
def test_documents_are_exact_and_their_answers_are_right():
    doc = make_document("t-1", 200, V, pairs=8, queries=8)
    assert len(doc.ids) == 200 and doc.ids[0] == V.eos_id
    assert len(doc.answers) == len(doc.depths) == 8
    for pos in doc.answers:
        key, value = doc.ids[pos - 1], doc.ids[pos]
        assert doc.ids[pos - 2] == V.query_id and V.key(0) <= key < V.value(0) <= value < V.word(0)
        stated = [i for i in range(1, pos - 2) if doc.ids[i] == key]
        assert len(stated) == 1 and doc.ids[stated[0] + 1] == value  # the needle, once, in the context
    assert make_document("t-1", 200, V, 8, 8) == doc != make_document("t-2", 200, V, 8, 8)


def test_evaluation_documents_place_needles_at_their_depths():
    docs = eval_set(V, 256, 3, Shape(pairs=6, queries=5), [0.0, 0.25, 0.5, 0.75, 1.0], seed=0)
    for doc in docs:
        assert sorted(doc.depths) == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0], abs=0.06)
        needle = [doc.ids.index(doc.ids[p - 1]) for p in doc.answers]
        assert min(needle) == 1  # depth 0: right after the leading </s>
    assert eval_set(V, 256, 3, Shape(6, 5), [0.0], 0)[0].ids != make_document("train-0-0-0", 256, V, 6, 1).ids


def test_documents_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="too short"):
        make_document("x", 20, V, pairs=8, queries=4)
    with pytest.raises(ValueError, match="queries"):
        make_document("x", 200, V, pairs=2, queries=3)


def test_train_stream_aligns_one_document_per_sample(tmp_path):
    info = train_stream(tmp_path / "s.npy", V, 64, 5, Shape(4, 4), seed=0)
    stream = np.load(tmp_path / "s.npy")
    assert info["tokens"] == stream.size == 6 * 64
    assert all(stream[i * 64] == V.eos_id for i in range(6))  # sample i = tokens [64 i, 64 (i + 1) + 1)
    assert stream.max() < V.size


def test_word_tokenizer_round_trips(tmp_path):
    tok = TextTokenizer(write_tokenizer(V, tmp_path / "tokenizer.json"))
    doc = make_document("t", 100, V, 4, 4)
    text = " ".join(V.tokens()[i] for i in doc.ids)
    assert tok.encode([text])[0] == doc.ids and tok.vocab_size == V.size and tok.separator_id(None) == V.eos_id


def test_text_corpus_is_deterministic_and_in_the_eval_format(tmp_path):
    doc = text_corpus.make_document("niah", 1_000_003, 40)
    assert doc.startswith("Some facts are hidden in the text below.") and "\n\nQuestion: What" in doc
    assert text_corpus.documents(5, 4, 30) == text_corpus.documents(5, 4, 30)
    tokenizer = text_corpus.write_tokenizer(tmp_path / "tok.json", 384)
    info = text_corpus.train_stream(tmp_path / "t.npy", tokenizer, 5000, 512, seed=0, stage=0)
    assert info["tokens"] >= 5000 and np.load(tmp_path / "t.npy").max() < 384
    gpu = TextTokenizer(text_corpus.write_tokenizer(tmp_path / "gpu.json", SCALES["gpu"].text_vocab))
    ids = gpu.encode(["The secret number of amber-heron is 1234567."])[0]
    assert len(ids) <= 18 and [gpu.decode([i]) for i in ids[-8:-1]] == list("1234567")  # digits one per token
    held = text_corpus.heldout(tmp_path / "h.jsonl", tokenizer, 600, 2, seed=0)
    texts = [json.loads(line)["text"] for line in (tmp_path / "h.jsonl").read_text().splitlines()]
    assert held["documents"] == 2 and all(len(TextTokenizer(tokenizer).encode([t])[0]) > 600 for t in texts)


def test_text_stages_pack_whole_documents_into_samples(tmp_path):
    """No mixture document crosses a sample boundary (a cut between a needle and its question teaches answers
    without evidence): every sample ends with EOS, documents too long for one are written shorter, and a
    sample's unused end is filler text."""
    tokenizer = text_corpus.write_tokenizer(tmp_path / "tok.json", 384)
    tok = TextTokenizer(tokenizer)
    for seq_len, repeat in ((512, False), (256, True)):
        info = text_corpus.train_stream(tmp_path / f"s{seq_len}.npy", tokenizer, 4000, seq_len, 0, 3, repeat)
        samples = np.load(info["path"]).reshape(-1, seq_len)  # whole samples only
        assert (samples[:, -1] == 0).all() and len(samples) >= 4000 // seq_len
        texts = [tok.decode(d.tolist()) for s in samples for d in np.split(s, np.flatnonzero(s == 0) + 1) if len(d)]
        if not repeat:  # every retrieval document is whole: the text ends with its answer's period
            asked = [t for t in texts if "\n\nQuestion:" in t]
            assert asked and all(t.removesuffix("<|endoftext|>").endswith(".") for t in asked)
    again = text_corpus.train_stream(tmp_path / "again.npy", tokenizer, 4000, 512, 0, 3)
    assert np.array_equal(np.load(again["path"]), np.load(tmp_path / "s512.npy"))
    with pytest.raises(ValueError, match="longer seq_len"):  # a needle document cannot be whole in 64 tokens
        text_corpus.train_stream(tmp_path / "short.npy", tokenizer, 1000, 64, 0, 3, kinds=("niah",))


def _corpus_files(work: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((work / "corpus").iterdir()) if p.name != "manifest.json"}


def _without_paths(manifest: dict) -> dict:
    return {k: {f: x for f, x in v.items() if f != "path"} for k, v in manifest.items() if isinstance(v, dict)}


def test_the_corpus_written_in_the_background_is_the_sequential_one_and_resumes(tmp_path):
    """Written in the background (stage0 on a pool of two workers, the small files on its thread) the text corpus
    is byte for byte the sequential one; a call stopped midway leaves only complete files in its manifest, and the
    next call writes the rest."""
    toy = SCALES["toy-text"]
    pooled = Stage(64, 64, 16, 1e-3, kinds=("tokens",))  # 65K tokens: chunks on the pool
    scale = replace(toy, curriculum=(pooled, *toy.curriculum), eval_docs=1)
    sequential = pipeline.corpus(scale, tmp_path / "seq", seed=0)
    with Background(workers=2) as background:
        data = pipeline.open_corpus(scale, tmp_path / "bg", 0, background=background)
        assert data["stage0"]["tokens"] == sequential["stage0"]["tokens"]  # waits for its own file only
        finished = data.complete()
    assert _corpus_files(tmp_path / "bg") == _corpus_files(tmp_path / "seq")
    assert _without_paths(finished) == _without_paths(sequential) and set(finished) == set(sequential)
    # stopped right after stage0: whatever the manifest records is complete; the next call completes the rest
    with Background(workers=2) as background:
        pipeline.open_corpus(scale, tmp_path / "stopped", 0, background=background)["stage0"]
    manifest = json.loads((tmp_path / "stopped" / "corpus" / "manifest.json").read_text())
    recorded = [name for name in manifest if name != "made_for"]
    assert {"tokenizer", "stage0"} <= set(recorded)
    for name in recorded:
        path = Path(manifest[name] if name == "tokenizer" else manifest[name]["path"])
        assert path.read_bytes() == (tmp_path / "seq" / "corpus" / path.name).read_bytes()
    (tmp_path / "stopped" / "corpus" / "heldout.jsonl.part").write_text("cut short")  # a killed write
    manifest.pop("heldout", None)
    (tmp_path / "stopped" / "corpus" / "manifest.json").write_text(json.dumps(manifest))
    resumed = pipeline.corpus(scale, tmp_path / "stopped", seed=0)
    assert set(resumed) == set(sequential) and (tmp_path / "stopped" / "corpus" / "heldout.jsonl").exists()
    written = _corpus_files(tmp_path / "stopped")
    assert {k: v for k, v in written.items() if not k.endswith(".part")} == _corpus_files(tmp_path / "seq")


def test_a_failing_background_file_raises_where_it_is_needed(tmp_path):
    """A stage whose file cannot be written fails with its name and the cause when its training asks for it."""
    toy = SCALES["toy-text"]
    scale = replace(toy, curriculum=(*toy.curriculum, Stage(64, 1, 1, 1e-3, kinds=("niah",))))
    with Background(workers=1) as background:
        data = pipeline.open_corpus(scale, tmp_path, 0, background=background)
        assert data["stage0"]["tokens"] > 0
        with pytest.raises(PreparationFailed, match="corpus stage1.*longer seq_len"):
            data["stage1"]
    assert "stage1" not in json.loads((tmp_path / "corpus" / "manifest.json").read_text())


class _Silent:
    """An engine that answers nothing: the evaluations' own prompt building, without a model."""

    def respond(self, ids, max_new_tokens, stop_ids=(), reference=None):
        return Response([])


def test_prompts_built_in_the_background_are_those_the_evaluation_builds(tmp_path):
    """``build_prompts`` (on a pool) makes the very samples, under the very keys, that ``_niah`` and ``run_ruler``
    put in the prompt cache, at every length: the evaluation finds every prompt it asks for."""
    from experiments.extension import evaluation
    from mtraining.eval.answers import Prompting
    from mtraining.eval.loading import load_tokenizer
    from mtraining.eval.ruler import run_ruler

    scale = replace(SCALES["toy-text"], niah_samples=2, ruler_samples=2)
    tokenizer = text_corpus.write_tokenizer(tmp_path / "tokenizer.json", scale.text_vocab)
    seed = 3
    with Background(workers=1) as background:
        built = evaluation.build_prompts(tmp_path / "prompts.pkl", scale, seed, background.pool, tokenizer)
    (cached,) = built.values()
    tok, cache = load_tokenizer(tokenizer), {}
    for n in scale.lengths:
        evaluation._niah(_Silent(), tok, scale, n, scale.niah_samples, seed, cache)
        prompting = Prompting(samples=scale.ruler_samples, seed=seed, show_progress=False, cache=cache)
        run_ruler(_Silent(), tok, scale.ruler_tasks, [n], prompting)
    assert cached == cache and len(cache) == len(evaluation.evaluation_prompts(scale, seed))
    again = evaluation.build_prompts(tmp_path / "prompts.pkl", scale, seed, None, tokenizer)  # all saved
    assert again == {next(iter(built)): {}}


# ---------------------------------------------------------------------------------------------- budgets, statistics
@pytest.mark.parametrize("scale", ["cpu", "gpu"])
def test_budgets_scale_with_the_length_and_make_valid_patterns(scale):
    s = SCALES[scale]
    for budget in s.budgets:
        for n in s.lengths:
            fields = budget.pattern(n, s)
            PatternConfig(block_size=s.block_size, **fields)  # valid
            assert fields["v_size"] >= s.sink_tokens and fields["s_size"] >= s.local_window
        long = budget.pattern(s.long, s)
        assert long["v_size"] == max(s.sink_tokens, round(budget.v * s.long))
        assert long["s_size"] == s.local_window + round(budget.s * s.long / s.block_size)  # extra block diagonals
    assert s.budget(s.default_budget).threshold is None
    assert Budget("t", 0.1, 0.1, threshold=0.9).pattern(s.long, s)["threshold"] == 0.9


def test_named_budgets_reach_every_scale_and_columns_reach_the_pattern():
    cpu = SCALES["cpu"]
    columns = cpu.budget("v30c16")  # not in the CPU scale's sweep: one of the named choices (--budgets)
    fields = columns.pattern(cpu.long, cpu)
    assert fields["block_columns"] == 16 and "block_columns" not in cpu.budget("v30").pattern(cpu.long, cpu)
    assert PatternConfig(block_size=cpu.block_size, **fields).block_columns == 16
    with pytest.raises(ValueError, match="no budget 'v99' at the cpu scale; use one of .*'v30c16'"):
        cpu.budget("v99")
    gpu = SCALES["gpu"]  # the GPU scale's default has columns sized to its G = 128; v30 alone stays a named choice
    assert gpu.budget(gpu.default_budget).pattern(gpu.long, gpu)["block_columns"] == 2048
    assert "block_columns" not in gpu.budget("v30").pattern(gpu.long, gpu)


def test_gpu_scales():
    """The GPU scale meets the issue's sizes; its smoke test is the CPU-tested toy-text path on the GPU."""
    gpu = SCALES["gpu"]
    m = gpu.model
    head = m["hidden_size"] // m["num_attention_heads"]
    attention = m["hidden_size"] * head * (2 * m["num_attention_heads"] + 2 * m["num_key_value_heads"])
    mlp = 3 * m["hidden_size"] * m["intermediate_size"]
    assert m["num_hidden_layers"] * (attention + mlp) + m["vocab_size"] * m["hidden_size"] >= 100e6
    assert (gpu.l0, gpu.long, gpu.device, gpu.backend) == (4096, 32768, "cuda", "auto")
    assert gpu.niah_samples * len(gpu.depths) >= 50  # NIAH prompts per length
    smoke, toy = SCALES["gpu-smoke"], SCALES["toy-text"]
    assert (smoke.device, smoke.dtype, smoke.backend, smoke.block_size) == ("cuda", "bfloat16", "auto", 128)
    same = {"task", "model", "budgets", "ranks", "niah_samples", "ruler_tasks", "activation_checkpointing"}
    same |= {"document_masking"}
    assert all(getattr(smoke, f) == getattr(toy, f) for f in same) and toy.activation_checkpointing
    assert gpu.document_masking and toy.document_masking
    assert toy.model["hidden_size"] // toy.model["num_attention_heads"] == head  # the kernels' head dim
    with pytest.raises(ValueError, match="cross"):
        replace(toy, cross="some")


def test_a_corpus_made_for_another_curriculum_is_not_reused(tmp_path):
    """The manifest names what the files were made for: the same scale reuses them, a changed stage raises."""
    scale = SCALES["toy"]
    first = pipeline.corpus(scale, tmp_path, seed=0)
    assert pipeline.corpus(scale, tmp_path, seed=0) == first
    longer = replace(scale, curriculum=(replace(scale.curriculum[0], steps=4), *scale.curriculum[1:]))
    for other, seed in ((longer, 0), (scale, 1)):
        with pytest.raises(ValueError, match="another curriculum.*delete"):
            pipeline.corpus(other, tmp_path, seed=seed)


@pytest.mark.parametrize("name", ["toy", "toy-text"])
def test_the_extension_seed_changes_the_extension_file_alone(tmp_path, name):
    """--extension-seed: another extension file, the same tokenizer, curriculum files and held-out set; its manifest
    says so (a work folder of another extension seed is refused), and equal to --seed it is the default's."""
    scale = SCALES[name]
    first = pipeline.corpus(scale, tmp_path / "r0", seed=0)
    replicate = pipeline.corpus(scale, tmp_path / "r1", seed=0, extension_seed=1)
    files, other = _corpus_files(tmp_path / "r0"), _corpus_files(tmp_path / "r1")
    assert set(files) == set(other) and "extension.npy" in files and len(files) > 2
    assert [f for f in files if files[f] != other[f]] == ["extension.npy"]
    shared = [
        {k: v for k, v in _without_paths(m).items() if k not in ("extension", "made_for")} for m in (first, replicate)
    ]
    assert shared[0] == shared[1] and "stage0" in shared[0]
    assert replicate["made_for"]["stages"]["extension"].pop("extension_seed") == 1  # recorded: never reused for 0
    assert replicate["made_for"] == first["made_for"]
    assert pipeline.corpus(scale, tmp_path / "r0", seed=0, extension_seed=0) == first  # manifests made before it
    with pytest.raises(pipeline.Refused, match="extension seed.*another --work"):
        pipeline.corpus(scale, tmp_path / "r0", seed=0, extension_seed=1)


def test_a_run_folder_trained_with_another_seed_is_refused(tmp_path):
    """A finished (or interrupted) run folder of another seed is not taken for this one's: the message names the fix."""
    scale = SCALES["toy"]
    data = pipeline.corpus(scale, tmp_path, seed=0)
    run = tmp_path / "extend" / "dense"
    source = {"path": str(tmp_path / "base"), "rope_theta": scale.base_theta}
    configs = [pipeline.train_config(scale, scale.extension, run, data, "extension", source, None, s) for s in (0, 1)]
    run.mkdir(parents=True)
    (run / "train.yaml").write_text(yaml.safe_dump(configs[0]))
    (run / "summary.json").write_text('{"run": "extend/dense"}')
    assert pipeline.train(run, configs[0]) == {"run": "extend/dense"}
    with pytest.raises(pipeline.Refused, match="seed 0, this run asks for 1.*own --work"):
        pipeline.train(run, configs[1])


def test_a_cached_evaluation_of_other_prompt_counts_is_refused(tmp_path):
    """An evaluation cached with other --niah-samples/--ruler-samples is not paired with this run's records."""
    scale = SCALES["toy-text"]
    first = str(scale.lengths[0])

    def made(niah: int, ruler: int) -> dict:
        docs = lambda n: [{"hits": 1.0, "answers": 1}] * n  # noqa: E731
        return {"tasks": {"niah": {first: {"documents": docs(niah * len(scale.depths))}},
                          "ruler": {first: {"documents": docs(ruler * len(scale.ruler_tasks))}}}}  # fmt: skip

    path = tmp_path / "dense__dense.json"
    cached = made(scale.niah_samples, scale.ruler_samples)
    assert pipeline.checked_evaluation(path, cached, scale) is cached
    with pytest.raises(pipeline.Refused, match="1 NIAH prompts per depth and 4 RULER.*asks for 1 and 2"):
        pipeline.checked_evaluation(path, made(scale.niah_samples, 4), replace(scale, ruler_samples=2))
    with pytest.raises(pipeline.Refused, match="delete it"):
        pipeline.checked_evaluation(path, cached, replace(scale, niah_samples=scale.niah_samples + 1))


def test_a_training_past_the_deadline_stops_and_resumes(tmp_path):
    """SIGTERM at the deadline, OutOfTime, then the same call again finishes and counts both calls' time."""
    scale = SCALES["toy"]
    data = pipeline.corpus(scale, tmp_path, seed=0)
    run = tmp_path / "stage0"
    source = {"config": scale.model, "rope_theta": scale.base_theta}
    config = pipeline.train_config(scale, scale.curriculum[0], run, data, "stage0", source, None, 0)
    pipeline.Clock.deadline = time.time() + 1.0  # the trainer is still starting
    try:
        with pytest.raises(pipeline.OutOfTime):
            pipeline.train(run, config)
    finally:
        pipeline.Clock.deadline = None
    assert not (run / "summary.json").exists()
    summary = pipeline.train(run, config)
    assert summary["calls"] == 2 and summary["steps"] == scale.curriculum[0].steps
    segments = [json.loads(line) for line in (run / "segments.jsonl").read_text().splitlines()]
    assert [seg["stopped"] for seg in segments] == [True, False]
    assert summary["wall_s"] == pytest.approx(sum(seg["wall_s"] for seg in segments), abs=0.2)


def test_accuracy_difference_and_perplexity_statistics():
    a = [{"hits": 5, "answers": 5}] * 40 + [{"hits": 0, "answers": 5}] * 10
    b = [{"hits": 5, "answers": 5}] * 50
    acc = report.accuracy(a)
    assert acc["percent"] == 80.0 and acc["interval"][0] < 80.0 < acc["interval"][1]
    d = report.difference(a, b)
    assert d["difference"] == -20.0 and d["interval"][0] < -20.0 < d["interval"][1] < 0
    partial = report.accuracy([{"hits": 0.5, "answers": 1}, {"hits": 1.0, "answers": 1}])
    assert partial["percent"] == 75.0  # partial credit: bootstrap interval
    with pytest.raises(ValueError, match="same documents"):
        report.difference(a, b[:3])
    buckets = [[a + 1, b] for a, b in position_buckets(64, 16)]
    x = [{"buckets": buckets, "nll": [1.0 * (b - a + 1) for a, b in buckets]}] * 4
    y = [{"buckets": buckets, "nll": [1.1 * (b - a + 1) for a, b in buckets]}] * 4
    assert report.ppl_curve(x)[-1]["ppl"] == pytest.approx(math.e)
    assert report.ppl_change(x, y)["change_percent"] == pytest.approx(100 * (math.exp(-0.1) - 1))


# ---------------------------------------------------------------------------------------------- the pipeline
def _run(scale: str, work: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "experiments.extension", "--scale", scale, "--work", str(work)]
    cmd += ["--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _steps(run: Path) -> list[dict]:
    """The step rows of a run's metrics.jsonl (not its start / resume markers)."""
    rows = [json.loads(line) for line in (run / "log" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" not in r]


def _check_outputs(scale_name: str, work: Path, out: Path) -> dict:
    scale = SCALES[scale_name]
    prefix = f"extension_{scale_name}"
    names = {p.name for p in out.iterdir()}
    assert names == {f"{prefix}.json", f"{prefix}.md", f"{prefix}.log"} | {
        f"{prefix}_{k}.png" for k in ("heatmaps", "ppl", "budget")
    }
    result = json.loads((out / f"{prefix}.json").read_text())
    assert {"device", "commit", "command"} <= set(result) and result["command"].endswith(f"--out {out}")

    # every stage read what the previous one wrote
    base = work / "base" / f"stage{len(scale.curriculum) - 1}" / "export"
    for name in ["dense"] + [f"sparse-{b.name}" for b in scale.budgets]:
        cfg = yaml.safe_load((work / "extend" / name / "train.yaml").read_text())
        assert cfg["model"]["path"] == str(base) and cfg["model"]["rope_theta"] == scale.base_theta * scale.theta_factor
        assert (work / "extend" / name / "export" / "model.safetensors").is_file()
    dense = yaml.safe_load((work / "extend" / "dense" / "train.yaml").read_text())
    sparse = yaml.safe_load((work / "extend" / f"sparse-{scale.default_budget}" / "train.yaml").read_text())
    for cfg in (dense, sparse):
        cfg.pop("attention"), cfg.pop("checkpoint"), cfg.pop("log")
    assert dense == sparse  # same model, data, seed, steps, optimiser and ranks: only attention differs
    for label, _, _ in pipeline.eval_plan(scale):
        assert (work / "eval" / (label.replace("/", "__") + ".json")).is_file()

    # the report's figures come from the records
    for label, row in result["summary"]["table"].items():
        for task, by_length in row["tasks"].items():
            for n, cell in by_length.items():
                docs = result["evaluations"][label]["tasks"][task][n]["documents"]
                assert cell["percent"] == pytest.approx(
                    100 * sum(d["hits"] for d in docs) / sum(d["answers"] for d in docs)
                )
    losses = [m["loss"] for m in _steps(work / "extend" / "dense")][-10:]
    assert result["training"]["extend/dense"]["final_loss"] == pytest.approx(sum(losses) / len(losses))
    entry = result["summary"]["sweep"][0]
    densities = [m["density"] for m in _steps(work / "extend" / f"sparse-{entry['budget']['name']}")]
    assert entry["train_density"] == pytest.approx(sum(densities) / len(densities))
    assert 0 < entry["train_density"] < 1
    md = (out / f"{prefix}.md").read_text()
    # the sparse extension read dense (cross evaluations) is checked against dense on its own
    name, long, ev = f"sparse-{entry['budget']['name']}", str(scale.long), result["evaluations"]
    if f"{name}/dense" in ev:
        change = report.ppl_change(ev[f"{name}/dense"]["ppl"][long], ev["dense/dense"]["ppl"][long])
        assert entry["read_dense"]["ppl_last_bucket_vs_dense"] == change
        assert "the sparse extension read dense" in md
    else:
        assert entry["read_dense"] is None and "read dense" not in md
    table = result["summary"]["table"]
    task = scale.tasks[0]
    assert f"{table['dense/dense']['ppl_last_bucket'][str(scale.long)]:.3f}" in md
    assert report._pct(table["base/dense"]["tasks"][task][str(scale.l0)]) in md
    return result


def test_pipeline_at_toy_size_recall_task_resumes(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    _run("toy", work, out)
    first = _check_outputs("toy", work, out)
    (work / "eval" / "dense__dense.json").unlink()  # a lost stage output is redone, the rest is kept
    again = _run("toy", work, out).stdout
    assert "train " not in again and again.count("eval ") == 1
    second = json.loads((out / "extension_toy.json").read_text())
    assert second["summary"] == first["summary"]
    goal = second["summary"]["goal"]  # 3 steps of training retrieve nothing: no parity can be claimed
    assert not goal["informative"] and not goal["budgets_at_parity"]
    assert "Not informative on retrieval" in (out / "extension_toy.md").read_text()

    # a result JSON re-renders the same report elsewhere (a GPU run's, on the CPU)
    pipeline.report_from(out / "extension_toy.json", tmp_path / "again")
    assert (tmp_path / "again" / "extension_toy.md").read_text() == (out / "extension_toy.md").read_text()
    # ... with the settings the run recorded, not the scale's current ones
    recorded = json.loads((out / "extension_toy.json").read_text())
    recorded["scale"]["curriculum"][0]["steps"], recorded["scale"]["extension"]["steps"] = 12345, 678
    (tmp_path / "changed.json").write_text(json.dumps(recorded))
    pipeline.report_from(tmp_path / "changed.json", tmp_path / "changed")
    md = (tmp_path / "changed" / "extension_toy.md").read_text()
    assert f"curriculum 12345 x {recorded['scale']['curriculum'][0]['batch']} x" in md and "678 steps of" in md

    # the training loss split by token kind, from the same exports
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "experiments.extension.losses", "--scale", "toy", "--work", str(work)]
    proc = subprocess.run(cmd + ["--docs", "2", "--out", str(out / "losses.json")], capture_output=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads((out / "losses.json").read_text())["losses"]
    assert set(losses) == {"dense/dense", "sparse-v10/dense", "sparse-v10/sparse-v10"}
    scale = SCALES["toy"]
    for parts in losses.values():
        assert parts["answer"]["tokens"] == parts["queried key"]["tokens"] == 2 * scale.extension.pairs
        assert parts["all"]["tokens"] == 2 * (scale.long - 1)
        mean = sum(parts[k]["nll"] * parts[k]["tokens"] for k in ("answer", "queried key", "rest"))
        assert parts["all"]["nll"] == pytest.approx(mean / parts["all"]["tokens"])
    assert losses["sparse-v10/dense"] != losses["sparse-v10/sparse-v10"]

    # inference-only density sweep on the dense extension: the same documents as its evaluation
    cmd = [sys.executable, "-m", "experiments.extension.density", "--scale", "toy", "--work", str(work)]
    args = ["--docs", "2", "--settings", "v30,v30-qall,full,top-0.25,top-1", "--out", str(out / "density.json")]
    proc = subprocess.run(cmd + args, capture_output=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["setting"]: r for r in json.loads((out / "density.json").read_text())["rows"]}
    assert list(rows) == ["dense", "v30", "v30-qall", "full", "top-0.25", "top-1"]
    evaluated = json.loads((work / "eval" / "dense__dense.json").read_text())["ppl"][str(scale.long)][:2]
    assert rows["dense"]["ppl_last_bucket"] == pytest.approx(report.ppl_curve(evaluated)[-1]["ppl"], rel=1e-5)
    for every in ("full", "top-1"):  # every line, every key: dense attention, through either path
        assert rows[every]["density"] == pytest.approx(1.0)
        assert rows[every]["ppl_vs_dense"]["change_percent"] == pytest.approx(0.0, abs=1e-3)
        assert rows[every]["retrieval"] == rows["dense"]["retrieval"]
    assert 0.25 <= rows["top-0.25"]["density"] < 0.26  # ceil(0.25 (i + 1)) keys of row i
    assert rows["top-0.25"]["ppl_vs_dense"]["change_percent"] != pytest.approx(0.0, abs=1e-3)
    assert rows["v30"]["density"] < 1 and rows["v30"]["pattern"]["last_q"] == scale.last_q
    assert rows["v30-qall"]["pattern"]["last_q"] == scale.long


def test_pipeline_at_toy_size_text_task(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    # a call that ends while the corpus is still being written in the background: exit 3, the next call completes it
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "experiments.extension", "--scale", "toy-text", "--work", str(work)]
    stopped = subprocess.run(
        cmd + ["--out", str(out), "--max-minutes", "0.01"], capture_output=True, text=True, env=env
    )
    assert stopped.returncode == 3 and "run the same command again" in stopped.stdout, stopped.stderr[-3000:]
    assert not (work / "base" / "stage0" / "summary.json").exists() and "Traceback" not in stopped.stderr
    (out / "extension_toy-text.log").unlink()
    _run("toy-text", work, out)
    result = _check_outputs("toy-text", work, out)
    evaluation = result["evaluations"]["dense/sparse-v10"]
    assert set(evaluation["tasks"]) == {"niah", "ruler"} and evaluation["density"]["1024"] < 1
    # every prompt keeps its cell, expected answers and prediction (NIAH's hits: match_all of that prediction)
    from mtraining.eval.scoring import match_all

    niah = evaluation["tasks"]["niah"]["1024"]["documents"]
    assert [d["depth"] for d in niah] == [100 * d for d in SCALES["toy-text"].depths]  # one prompt per depth
    assert all(d["hits"] == match_all(d["prediction"], d["expected"]) for d in niah)
    ruler = evaluation["tasks"]["ruler"]["1024"]["documents"]
    assert {d["task"] for d in ruler} == set(SCALES["toy-text"].ruler_tasks)
    assert all(d["expected"] and isinstance(d["prediction"], str) for d in ruler)
    checkpointing = {
        run: yaml.safe_load((work / run / "train.yaml").read_text())["train"]["activation_checkpointing"]
        for run in ("base/stage0", "extend/dense", "extend/sparse-v10")
    }
    assert checkpointing == {"base/stage0": False, "extend/dense": True, "extend/sparse-v10": True}
    assert "packed documents masked" in (out / "extension_toy-text.md").read_text()
    assert "with the needle before depth 1 (long range" in (out / "extension_toy-text.md").read_text()
    (v10,) = result["summary"]["sweep"]
    assert set(v10["niah_depths_below_1_minus_dense"]) == {str(n) for n in SCALES["toy-text"].lengths}
    masking = {run: yaml.safe_load((work / run / "train.yaml").read_text())["data"] for run in checkpointing}
    assert {run: d["document_masking"] for run, d in masking.items()} == {
        "base/stage0": False, "extend/dense": True, "extend/sparse-v10": True
    }  # fmt: skip
    models = {run: yaml.safe_load((work / run / "train.yaml").read_text())["model"] for run in checkpointing}
    assert models["base/stage0"]["init"] == "depth_scaled" == SCALES["toy-text"].init  # random weights only
    assert "init" not in models["extend/dense"] and "path" in models["extend/dense"]
    # the prompts the run built come back in another process (a resumed run's next call), in the cache's shape
    from experiments.extension import evaluation
    from mtraining.eval.tasks import Sample

    evaluation._PROMPTS.clear()
    evaluation.load_prompts(work / "eval" / "prompts.pkl")
    (built,) = evaluation._PROMPTS.values()  # one tokenizer
    assert {key[0] for key in built} == {"needle in a haystack", "ruler"} and all(
        isinstance(v, Sample) and v.prompt for v in built.values()
    )
    assert set(built) == set(evaluation.evaluation_prompts(SCALES["toy-text"], 0))  # all from the background
    log = (out / "extension_toy-text.log").read_text()
    assert log.index(f"prompts: {len(built)} built") < log.index("eval base/dense")  # before the first evaluation
    evaluation._PROMPTS.clear()

    # another extension from the same base: nothing of the base is trained, checked or evaluated again
    other = tmp_path / "other"
    stamps = {p: p.stat().st_mtime_ns for p in (work / "base").rglob("*") if p.is_file()}
    _run(
        "toy-text",
        other,
        tmp_path / "out2",
        "--base-from",
        str(work),
        "--extension-kinds",
        "niah,vt",
        "--cross",
        "none",
    )
    assert (other / "base").resolve() == (work / "base").resolve()
    assert stamps == {p: p.stat().st_mtime_ns for p in (work / "base").rglob("*") if p.is_file()}
    first, second = (json.loads((w / "corpus" / "manifest.json").read_text()) for w in (work, other))
    assert second["stage0"] == first["stage0"] and second["tokenizer"] == first["tokenizer"]
    assert second["extension"]["path"].startswith(str(other)) and "recall" not in second["extension"]["kind"]
    assert (other / "eval" / "base__dense.json").read_bytes() == (work / "eval" / "base__dense.json").read_bytes()
    assert "on niah, vt documents" in (tmp_path / "out2" / "extension_toy-text.md").read_text()
    assert {p.name for p in (other / "eval").glob("*__*.json")} == {  # --cross none: each model at its own attention
        "base__dense.json", "dense__dense.json", "sparse-v10__sparse-v10.json"
    }  # fmt: skip
    changed = replace(SCALES["toy-text"], curriculum=(replace(SCALES["toy-text"].curriculum[0], steps=4),))
    with pytest.raises(ValueError, match="another curriculum"):
        pipeline.corpus(changed, tmp_path / "third", 0, base_from=work)

    # a replicate: the same base and evaluation prompts, another extension seed (its data and data order)
    _check_replicate(work, tmp_path / "r1", tmp_path / "out_r1")


def _check_replicate(work: Path, replicate: Path, out: Path) -> None:
    """``--base-from work --extension-seed 1``: no base training, another extension file and data order, the same
    held-out documents and prompts (the results pair across replicates); another --seed is refused."""
    from experiments.extension import evaluation

    stamps = {p: p.stat().st_mtime_ns for p in (work / "base").rglob("*") if p.is_file()}
    proc = _run("toy-text", replicate, out, "--base-from", str(work), "--extension-seed", "1", "--cross", "none")
    assert "train base" not in proc.stdout and proc.stdout.count("train extend/") == 2
    assert stamps == {p: p.stat().st_mtime_ns for p in (work / "base").rglob("*") if p.is_file()}
    seeds = {
        w: yaml.safe_load((w / "extend" / name / "train.yaml").read_text())["train"]["seed"]
        for w in (work, replicate)
        for name in ("dense", "sparse-v10")
    }
    assert seeds == {work: 0, replicate: 1}
    corpus = [work / "corpus", replicate / "corpus"]
    assert (corpus[0] / "heldout.jsonl").read_bytes() == (corpus[1] / "heldout.jsonl").read_bytes()
    assert (corpus[0] / "extension.npy").read_bytes() != (corpus[1] / "extension.npy").read_bytes()
    prompts = []
    for w in (work, replicate):
        evaluation._PROMPTS.clear()
        evaluation.load_prompts(w / "eval" / "prompts.pkl")
        prompts.append(dict(evaluation._PROMPTS))
    evaluation._PROMPTS.clear()
    assert prompts[0] == prompts[1] and prompts[0]
    evaluated = [json.loads((w / "eval" / "dense__dense.json").read_text())["tasks"]["niah"] for w in (work, replicate)]
    answers = [{n: [e["answers"] for e in cell.get("examples", [])] for n, cell in ev.items()} for ev in evaluated]
    assert answers[0] == answers[1]
    result = json.loads((out / "extension_toy-text.json").read_text())
    assert (result["seed"], result["extension_seed"]) == (0, 1)
    assert "extension seed 1 (seed 0)" in (out / "extension_toy-text.md").read_text().splitlines()[0]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "experiments.extension", "--scale", "toy-text", "--base-from", str(work)]
    cmd += ["--seed", "1", "--work", str(replicate.parent / "r2"), "--out", str(out.parent / "out_r2")]
    refused = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert refused.returncode == 2 and "refused: --base-from" in refused.stdout and "seed" in refused.stdout
    assert "Traceback" not in refused.stderr and not (replicate.parent / "r2" / "extend").exists()


def test_base_only_judges_the_base_at_l0_and_stops(tmp_path):
    """--base-only: the curriculum, the check and one evaluation at L0 against the gates; nothing is extended."""
    work, out = tmp_path / "work", tmp_path / "out"
    proc = _run("toy-text", work, out, "--base-only")
    result = json.loads((out / "extension_toy-text_base.json").read_text())
    assert set(result["gates"]) == {"niah", "ruler"} and not (work / "extend").exists()
    assert list(result["evaluation"]["tasks"]["niah"]) == [str(SCALES["toy-text"].l0)]  # L0 only
    niah = result["gates"]["niah"]
    assert niah["passed"] == (niah["accuracy"]["percent"] >= 90.0) and "base at L0: niah" in proc.stdout
    assert {"device", "commit", "command"} <= set(result) and "base/stage0" in result["training"]


def test_committed_cpu_results_are_informative_and_their_parity_follows_the_thresholds():
    result = json.loads((ROOT / "bench" / "results" / "extension_cpu.json").read_text())
    assert result["summary"]["goal"]["informative"]
    for entry in result["summary"]["sweep"]:
        assert entry["parity"] == (entry["within_points"] and entry["within_ppl"])


@pytest.mark.parametrize("name", ["toy", "toy-text"])
def test_a_base_that_does_not_retrieve_stops_the_run_before_its_extension(tmp_path, name):
    """Three steps of training retrieve nothing: the check at L0 stops the run with the fix in its message."""
    scale = replace(SCALES[name], base_check=2)
    data = pipeline.corpus(scale, tmp_path, seed=0)
    base, runs = pipeline.base_model(scale, tmp_path, data, seed=0)
    if name == "toy-text":  # every text stage is checked at its length, and the check is kept with its run
        assert [r["niah"]["length"] for r in runs] == [st.seq_len for st in scale.curriculum]
        assert all(r["niah"]["accuracy"]["answers"] == 10 for r in runs)
        assert (tmp_path / "base" / "stage0" / "niah.json").exists()
    else:
        assert all("niah" not in r for r in runs)
    with pytest.raises(pipeline.BaseDoesNotRetrieve, match="train the base longer.*--extend-anyway"):
        pipeline.check_base(scale, tmp_path, base, seed=0)
    checked = json.loads((tmp_path / "eval" / "base_check.json").read_text())
    assert checked["accuracy"]["answers"] == sum(d["answers"] for d in checked["documents"]) >= 2
    assert checked["accuracy"]["percent"] == 0.0
    assert pipeline.check_base(replace(scale, base_check=0), tmp_path, base, seed=0) is None
    assert pipeline.check_base(scale, tmp_path, base, seed=0, gate=False) == checked  # recorded, not stopping


def test_base_search_trains_recipes_side_by_side_and_checks_each(tmp_path):
    """experiments/extension/base_search.py in miniature: two recipes (one with its own model), each trained and checked."""
    out = tmp_path / "search.json"
    cmd = [sys.executable, "-m", "experiments.extension.base_search", "--scale", "toy-text"]
    cmd += ["--recipes", "mix1024,small", "--lengths", "512", "--samples", "2", "--work", "w"]  # relative: cwd's
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd + ["--out", str(out)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"device", "commit", "command"} <= set(result) and set(result["recipes"]) == {"mix1024", "small"}
    for recipe in result["recipes"].values():
        assert [r["steps"] for r in recipe["runs"]] == [2, 2]
        check = recipe["checks"]["512"]
        assert check["accuracy"]["answers"] == 2 and len(check["examples"]) == 2
        assert recipe["induction"]["first"] > 0 and recipe["induction"]["copied"] > 0


@pytest.mark.parametrize("kind", ["facts", "facts_word"])
def test_fact_documents_answer_what_they_stated(kind):
    """Every question of a facts document is answered with the number stated earlier for its key; facts_word keys are
    single words, facts keys the eval's adjective-noun pairs; a stage restricted to a kind draws only it."""
    stated, answered, sentences = {}, [], 0
    for seed in range(5):
        doc = text_corpus.make_document(kind, seed, 200)
        facts = dict(re.findall(r"(?<!Answer: )The secret number of ([\w-]+) is (\d+)\.", doc))
        pairs = re.findall(r"Answer: The secret number of ([\w-]+) is (\d+)\.", doc)
        assert all(facts[key] == value for key, value in pairs)
        stated |= facts
        answered += pairs
        sentences += len(doc.split(". "))
    assert all(("-" in key) == (kind == "facts") for key in stated)
    assert len(answered) > 0.15 * sentences  # a dense retrieval signal
    with pytest.raises(ValueError, match="unknown document kind"):
        text_corpus.make_document("fact", 7, 20)
    assert text_corpus.documents(5, 3, 30, (kind,)) == [text_corpus.make_document(kind, 5 + i, 30) for i in range(3)]


def test_copy_documents_repeat_one_span_of_random_words():
    """A copy document is one span of words and numbers repeated: everything after its first occurrence is a copy."""
    for seed in range(5):
        words = text_corpus.make_document("copy", seed, 40).split()
        period = next(p for p in range(1, len(words)) if words[p:] == words[:-p])
        assert 4 <= period <= 24 and len(words) >= 3 * period
    assert text_corpus.make_document("copy", 1, 40) != text_corpus.make_document("copy", 2, 40)


def test_token_span_stages_write_repeated_random_ids(tmp_path):
    """A ("tokens",) stage's file holds spans of 8-24 random ids (never EOS) repeated, from the tokenizer's
    vocabulary, the same file for the same seed; its documents, and a ("copy",) stage's, are one sample long."""
    tokenizer = text_corpus.write_tokenizer(tmp_path / "tok.json", 384)
    first = text_corpus.train_stream(tmp_path / "a.npy", tokenizer, 3000, 128, seed=0, stage=0, kinds=("tokens",))
    again = text_corpus.train_stream(tmp_path / "b.npy", tokenizer, 3000, 128, seed=0, stage=0, kinds=("tokens",))
    stream, eos = np.load(first["path"]), 0
    assert np.array_equal(stream, np.load(again["path"])) and stream.max() < 384
    documents = [d for d in np.split(stream, np.flatnonzero(stream == eos) + 1) if len(d)]
    assert len(documents) >= 10 and stream.size == 128 * len(documents)
    for doc in documents:  # one per sample: 127 ids then EOS
        ids = doc[:-1].tolist()
        assert len(doc) == 128 and doc[-1] == eos and eos not in ids
        period = next(p for p in range(1, len(ids)) if ids[p:] == ids[:-p])
        assert 8 <= period <= 24 and len(ids) >= 3 * period
    copy = np.load(text_corpus.train_stream(tmp_path / "c.npy", tokenizer, 3000, 96, 0, 1, kinds=("copy",))["path"])
    assert copy.size % 96 == 0 and (copy[95::96] == eos).all() and (copy.reshape(-1, 96)[:, :-1] != eos).all()
    short = [len(d) for d in text_corpus.documents(0, 20, 60, ("recall",))]
    long = [len(d) for d in text_corpus.documents(0, 20, 60, ("recall",), min_sentences=45)]
    assert min(long) > sorted(short)[10]  # min_fill: documents from that share of a sample up
    with pytest.raises(ValueError, match="a stage of their own"):  # ids cannot join a text mixture
        text_corpus.documents(0, 4, 30, ("tokens", "niah"))
