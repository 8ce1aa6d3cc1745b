"""The stages of the real-model extension experiment, each resumable, in the order one machine runs them.

``Experiment.stages()`` lists them: convert the GGUF, build the corpus, start building the evaluation prompts in the
background, check that the base retrieves at its native length, then per seed train every arm and read every
trained model (dense; sparse arms also with their own sparse attention), the speed stage after the first seed, the
base read at every length, and this folder's report. A stage whose output exists is skipped, so the same command
continues a stopped run; ``--plan`` prints the list with each stage's expected time instead of running it.

Outputs: ``--work`` holds what only this machine needs (the converted model, the corpus, training runs);
``--out`` the small files that must survive (the base check, each training's summary, each read with the lengths
read so far, the speed figures, every stage's expected and measured seconds, the log, run.json and the folder's
report), written as soon as each stage or cell ends; a cell in ``--out`` is not read again. ``--tar FILE`` packs
``--out`` into one archive after every stage, so a call cut by its time limit still returns what it finished.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import provenance, written
from mtraining.ops import fa4_installed

from ..common.background import Background
from ..common.stages import Clock, OutOfTime, Refused, say, write_json
from ..common.training import ROOT, read_metrics, train
from . import evaluation, report, speed
from .costs import Estimate, Estimator, Shape, Timings
from .settings import Arm, Settings, rope_scaling

DENSE = Arm("dense", False)


class BaseDoesNotRetrieve(Exception):
    """The base clearly fails NIAH at its native length: extending it could show nothing (exit status 4)."""


class GGUFNotHere(OutOfTime):
    """The corpus is built (from --tokenizer) but the GGUF is not on this machine yet: call again with it (exit 3)."""


@dataclass(frozen=True)
class Sources:
    """Where the inputs come from: the GGUF file, the interpreters whose site-packages are code documents (or code
    folders), the prose archives, documents held out by name; the base's tokenizer folder, which lets the corpus
    be built before the GGUF is there."""

    gguf: Path | None = None
    code_python: tuple[str, ...] = ()
    code: tuple[Path, ...] = ()
    prose: tuple[Path, ...] = ()
    heldout: tuple[str, ...] = ()
    tokenizer: Path | None = None


@dataclass
class Stage:
    """One step of the run: ``done()`` says whether its output exists, ``expected()`` how long it should take,
    ``run()`` makes the output. ``stops``: a training, which the deadline stops and the next call resumes: it
    starts if ``start()`` (its fixed cost and steps to its first checkpoint) fits before the deadline; any other
    stage starts only if ``expected()`` (with its margin) fits. ``background``: it only queues work on the spare
    cores."""

    name: str
    done: Callable[[], bool]
    expected: Callable[[], Estimate]
    run: Callable[[], None]
    stops: bool = False
    background: bool = False
    kind: str | None = None  # the ``Timings`` entry its wall time measures (None: it records its own)
    start: Callable[[], Estimate] | None = None  # a stopping stage's least useful run (default: ``expected``)

    def budget(self) -> float:
        """Seconds that must be left before the deadline for this stage to start."""
        return (self.start or self.expected)().budget()


class Experiment:
    """One machine's part of the experiment: ``settings`` for the seeds it runs, in ``work`` and ``out``."""

    def __init__(
        self,
        settings: Settings,
        sources: Sources,
        work: Path,
        out: Path,
        base_read: bool = True,
        speed_stage: bool = True,
        base_check: bool = True,
        tar: Path | None = None,
    ) -> None:
        self.s, self.sources, self.work, self.out = settings, sources, work, out
        self.base_read, self.speed_stage, self.base_check_stage, self.tar = base_read, speed_stage, base_check, tar
        self.model_dir, self.corpus_dir = work / "model", work / "corpus"
        self.timings = Timings(work / "timings.json")
        self.estimate = Estimator(settings, Shape.of(self.model_dir), self.timings)
        self.background: Background | None = None
        self._prompts: dict[str, Callable[[], dict]] = {}  # waits for the background's prompt jobs
        self._inputs: evaluation.Inputs | None = None
        self._loaded: tuple[Path, object] | None = None

    # ------------------------------------------------------------------ the list
    def stages(self) -> list[Stage]:
        """Every stage of this machine's part, in order (the corpus first when it has its own --tokenizer)."""
        s = self.s
        stages = self.shared()
        stages.append(
            Stage("prompts", self.prompts_done, lambda: Estimate(0.0, "here"), self.start_prompts, background=True)
        )
        if self.base_check_stage:
            base = (self.out / "base_check.json").exists
            stages.append(Stage("base check", base, self._base_estimate, self.base_check, kind="base"))
        for i, seed in enumerate(s.seeds):
            for a in s.arms:
                stages += [self._training(seed, a, phase) for phase in range(len(s.schedule))]
            for read in self.reads(seed):
                stages += self._read_cells(read)
            if i == 0 and self.speed_stage:
                stages += [self._speed(n, doc) for n in s.speed_lengths for doc in range(s.speed_docs)]
            for read in self.earlier_reads(seed):
                stages += self._read_cells(read)
        if self.base_read:
            stages += self._read_cells(evaluation.Read("base", DENSE))
        return stages

    def shared(self) -> list[Stage]:
        """The stages every GPU's part needs once: the conversion and the corpus."""
        convert = Stage(
            "convert", (self.model_dir / "config.json").exists, self.estimate.convert, self.convert, kind="convert"
        )
        corpus = Stage(
            "corpus", (self.corpus_dir / "manifest.json").exists, self.estimate.corpus, self.corpus, kind="corpus"
        )
        return [corpus, convert] if self.sources.tokenizer is not None else [convert, corpus]

    def reads(self, seed: int) -> list[evaluation.Read]:
        """The reads of one seed's models: every model dense, sparse arms' also with their own attention
        (``sparse_reads``)."""
        found = []
        for a in self.s.arms:
            found.append(evaluation.Read(f"seed{seed}/{a.name}", DENSE))
            if a.sparse and self.s.sparse_reads:
                found.append(evaluation.Read(f"seed{seed}/{a.name}", a))
        return found

    def earlier_reads(self, seed: int) -> list[evaluation.Read]:
        """With ``read_earlier``: every earlier phase's model of the seed read dense up to its phase's length (what
        the later phases change in it); else none."""
        if not self.s.read_earlier:
            return []
        return [
            evaluation.Read(f"seed{seed}/{a.name}_at_{n}", DENSE, upto=n)
            for a in self.s.arms
            for n, _ in self.s.earlier
        ]

    def _training(self, seed: int, a: Arm, phase: int) -> Stage:
        """One phase of a training (``Settings.schedule``): the last one's run is the arm's model."""
        run, (n, steps) = self.run_dir(seed, a, phase), self.s.schedule[phase]
        return Stage(
            f"train seed {seed} {a.name}" + ("" if phase == len(self.s.earlier) else f" at {n}"),
            lambda: (run / "summary.json").exists(),
            lambda: self.estimate.train(a, n, steps - len(read_metrics(run))),
            lambda: self.train(seed, a, phase),
            stops=True,
            start=lambda: self.estimate.train_start(a, n, steps),
        )

    def _read_cells(self, read: evaluation.Read) -> list[Stage]:
        return [
            Stage(
                f"read {read.model} {read.attention} at {n}",
                lambda n=n: n in self.cells(read),
                lambda n=n: self.estimate.cell(read.arm, n),
                lambda n=n: self.read_cell(read, n),
            )
            for n in read.lengths(self.s)
        ]

    def _speed(self, n: int, doc: int) -> Stage:
        path = self._speed_doc(n, doc)
        timed = {a.name for a in self.s.timed_arms}
        done = lambda: path.exists() and timed <= set(json.loads(path.read_text())["arms"])  # noqa: E731 - arms added later
        name = f"speed at {n}" + (f", document {doc + 1} of {self.s.speed_docs}" if self.s.speed_docs > 1 else "")
        return Stage(name, done, lambda: self.estimate.speed(n), lambda: self.speed(n, doc), kind=f"speed:{n}")

    def _speed_doc(self, n: int, doc: int) -> Path:
        """The speed figures at ``n`` tokens of held-out document ``doc``."""
        return self.work / "speed" / str(n) / f"doc{doc}.json"

    def _base_estimate(self) -> Estimate:
        return self.estimate.base(self.native())

    # ------------------------------------------------------------------ paths
    def run_dir(self, seed: int, a: Arm, phase: int) -> Path:
        """A training phase's folder: the arm's model (the last phase, ``runs/seed<S>/<arm>``), or an earlier
        phase's (``runs/seed<S>/<arm>_at_<length>``)."""
        if phase == len(self.s.earlier):
            return self.work / "runs" / f"seed{seed}" / a.name
        return self.work / "runs" / f"seed{seed}" / f"{a.name}_at_{self.s.earlier[phase][0]}"

    def export(self, model: str) -> Path:
        """A model's folder: the converted base, or a training's export (``seed<S>/<arm>``, ``seed<S>/<arm>_at_<n>``)."""
        return self.model_dir if model == "base" else self.work / "runs" / model / "export"

    def read_path(self, read: evaluation.Read) -> Path:
        """The read's file in ``--out``: its cells read so far."""
        return self.out / "eval" / f"{read.label}.json"

    def cells(self, read: evaluation.Read) -> dict[int, dict]:
        """The cells of ``read`` finished so far, by length."""
        path = self.read_path(read)
        return {c["length"]: c for c in json.loads(path.read_text())["cells"]} if path.exists() else {}

    def native(self) -> int:
        """The base's pretraining length (its config's max_position_embeddings)."""
        path = self.model_dir / "config.json"
        return json.loads(path.read_text())["max_position_embeddings"] if path.exists() else 8192

    def heldout_files(self) -> list[Path]:
        return sorted((self.corpus_dir / "heldout").glob("*.jsonl"))

    # ------------------------------------------------------------------ stages
    def convert(self) -> None:
        """``mtraining convert`` of the GGUF file into ``<work>/model`` (float32: the dequantized values exactly)."""
        gguf = self.sources.gguf
        if (gguf is None or not gguf.is_file()) and self.sources.tokenizer is not None:
            raise GGUFNotHere(f"the GGUF {gguf} is not here yet (the corpus is built): call again with it")
        if gguf is None or not gguf.is_file():
            raise Refused(f"the base is not converted yet and --gguf {gguf} is not a file: pass the GGUF checkpoint")
        part = self.model_dir.with_name("model.part")
        shutil.rmtree(part, ignore_errors=True)
        self._mtraining("convert", str(gguf), str(part), "--dtype", "float32")
        os.replace(part, self.model_dir)
        self.estimate = Estimator(self.s, Shape.of(self.model_dir), self.timings)

    def corpus(self) -> None:
        """``mtraining corpus``: code documents (site-packages of --code-python, or --code folders) and prose books,
        tokenised with the base's tokenizer; documents of at least ``length`` tokens held out by a seeded hash of
        their names (and those named by --heldout), so every held-out document fills a window of every length."""
        src, s = self.sources, self.s
        if not (src.code_python or src.code or src.prose):
            raise Refused("no corpus yet: pass --code-python EXE, --code DIR or --prose FILE.tar.xz")
        part = self.corpus_dir.with_name("corpus.part")
        shutil.rmtree(part, ignore_errors=True)
        args = [str(part), "--tokenizer", str(self.sources.tokenizer or self.model_dir)]
        args += [a for exe in src.code_python for a in ("--python", exe)]
        args += [a for p in src.code for a in ("--code", str(p))]
        args += [a for p in src.prose for a in ("--prose", str(p))]
        args += [a for name in src.heldout for a in ("--heldout", name)]
        args += ["--heldout-fraction", str(s.heldout_fraction), "--heldout-min-tokens", str(s.length)]
        args += ["--workers", str(s.workers)] if s.workers else []
        self._mtraining("corpus", *args)
        manifest = json.loads((part / "manifest.json").read_text())
        held = [d for d in manifest["documents"] if d["split"] == "heldout" and d["tokens"] >= s.length]
        if not held:
            raise Refused(
                f"the corpus holds out no document of {s.length} tokens or more: raise --heldout-fraction or name "
                f"one with --heldout (delete {part})"
            )
        say(f"  held out {len(held)} documents of >= {s.length} tokens: {', '.join(d['name'] for d in held)}")
        if len(held) < s.ppl_windows:
            say(f"  perplexity reads {len(held)} windows per length, not --ppl-windows {s.ppl_windows}")
        if self.speed_stage and len(held) < s.speed_docs:
            raise Refused(
                f"the speed stage times --speed-docs {s.speed_docs} held-out documents of {s.length} tokens or more and "
                f"the corpus holds out {len(held)}: lower --speed-docs or raise --heldout-fraction (delete {part})"
            )
        os.replace(part, self.corpus_dir)

    def prompts_done(self) -> bool:
        path = self.work / "eval" / "prompts.pkl"
        return False if not path.exists() or not self.model_dir.exists() else self._prompts_complete(path)

    def _prompts_complete(self, path: Path) -> bool:
        import pickle

        have = pickle.loads(path.read_bytes())
        return all(key in have for key in evaluation.prompt_keys(self.s, self.native()))

    def start_prompts(self) -> None:
        """Queue the evaluation prompts on the spare cores: the base check's first, then every read's."""
        keys = evaluation.prompt_keys(self.s, self.native())
        path = self.work / "eval" / "prompts.pkl"
        job = (str(self.model_dir), tuple(map(str, self.heldout_files())), self.s.eval_seed)
        first = evaluation.per_depth(self.s.base_prompts, self.s) * len(self.s.depths)
        if self.background is None:  # built here when first waited for
            self._prompts["base"] = self._prompts["all"] = lambda: evaluation.build_prompts(path, keys, job)
            return
        pool = self.background.pool
        self._prompts["base"] = self.background.submit(
            "base prompts", evaluation.build_prompts, path, keys[:first], job, pool
        )
        self._prompts["all"] = self.background.submit("prompts", evaluation.build_prompts, path, keys, job, pool)
        say(f"prompts: {len(keys)} built on {pool.workers} spare cores while the GPU works")

    def inputs(self, base_only: bool = False) -> evaluation.Inputs:
        """The evaluation's shared inputs with the prompts they need: the base check's (``base_only``) or every
        read's, waiting for the background's job that builds them."""
        if self._inputs is None:
            self._inputs = evaluation.Inputs(self.model_dir, self.heldout_files(), self.s)
            self._inputs.load_prompts(self.work / "eval" / "prompts.pkl")
        wait = self._prompts.pop("base" if base_only else "all", None)
        if wait is not None:
            self._inputs.prompts.update(wait())
        return self._inputs

    def model(self, name: str):
        """The loaded model ``name`` (one at a time: the previous one is freed)."""
        path = self.export(name)
        if self._loaded is None or self._loaded[0] != path:
            self._loaded = None
            _free()
            self._loaded = (path, evaluation.load_model(path, self.s))
        return self._loaded[1]

    def base_check(self) -> None:
        """NIAH of the base at its native length with real filler, generated and teacher-forced."""
        native = self.native()
        cell = evaluation.read_length(self.model("base"), self.inputs(True), DENSE, native, self.s.base_prompts)
        niah = cell["niah"]
        result = {"length": native, "gate": self.s.base_gate, **{k: niah[k] for k in niah if k != "records"}}
        result["examples"] = [{k: r[k] for k in ("answers", "prediction")} for r in niah["records"][:4]]
        result["records"] = niah["records"]
        write_json(self.out / "base_check.json", result)

    def gate(self) -> None:
        """Exit status 4 (``BaseDoesNotRetrieve``) when the base check's interval lies below ``base_gate``."""
        path = self.out / "base_check.json"
        if not path.exists():
            return
        found = json.loads(path.read_text())
        low, high = found["interval"]
        forced = found.get("forced")
        say(
            f"base check: NIAH at {found['length']}: {found['score']:.0f}% [{low:.0f}, {high:.0f}] generated, "
            f"{forced if forced is None else round(forced)}% teacher-forced, of {found['prompts']} prompts "
            f"(needs {self.s.base_gate:g}%)"
        )
        for example in found["examples"][:2]:
            say(f"  answers {example['answers']}, generated {example['prediction']!r}")
        if high < self.s.base_gate:
            raise BaseDoesNotRetrieve(
                f"the base finds {found['score']:.0f}% [{low:.0f}, {high:.0f}] of the needles at its native length "
                f"{found['length']}, clearly below {self.s.base_gate:g}%: extending it could show nothing "
                "(--base-gate 0 extends it all the same)"
            )

    def train_config(self, seed: int, a: Arm, phase: int) -> dict:
        """The ``mtraining train`` config of arm ``a``, seed ``seed`` (its data order), phase ``phase`` of the
        schedule: every arm the same but for its attention; a phase after the first starts from the one before's
        export, its RoPE scaled to its own length (with ``rope_final``, to the last phase's; with ``rope_theta``,
        that base in every phase)."""
        s = self.s
        run, (length, steps) = self.run_dir(seed, a, phase), s.schedule[phase]
        rope = rope_scaling(s.rope_length(length), self.native(), s.rope_theta)
        start = self.model_dir if phase == 0 else self.run_dir(seed, a, phase - 1) / "export"
        sources = [
            {"path": str(self.corpus_dir / "train" / f"{kind}.npy"), "weight": weight}
            for kind, weight in (("code", s.code_weight), ("prose", 1 - s.code_weight))
            if weight > 0 and (self.corpus_dir / "train" / f"{kind}.npy").exists()
        ]
        attention = dict(
            sparse=a.sparse, layout="striped", block_size=s.block_size, backend=s.backend, max_density=None
        )
        return dict(
            model=dict(path=str(start), dtype=s.dtype, rope_parameters=rope),
            attention=attention | a.pattern(length, s),
            parallel=dict(data=1, context=s.gpus),
            data=dict(sources=sources, seq_len=length, batch_size=1, shuffle=True, document_masking=True),
            optim=dict(
                lr=s.lr,
                warmup_steps=min(s.warmup, steps),
                min_lr_ratio=1.0,
                weight_decay=0.0,
                betas=[0.9, 0.95],
                grad_clip=1.0,
            ),
            train=dict(steps=steps, device=s.device, seed=seed, activation_checkpointing=True),
            checkpoint=dict(
                dir=str(run / "checkpoints"), every=s.checkpoint_every, resume=True, export_dir=str(run / "export")
            ),
            log=dict(dir=str(run / "log"), every=5, tensorboard=False, progress=False),
        )

    def train(self, seed: int, a: Arm, phase: int) -> None:
        """One phase of a training; its summary in ``--out``: ``train/seed<S>_<arm>.json`` for the arm's model,
        ``train/earlier/seed<S>_<arm>_at_<length>.json`` for an earlier phase."""
        length = self.s.schedule[phase][0]
        if length <= self.native():
            raise Refused(
                f"--schedule: the phase at {length} tokens is not longer than the base's native {self.native()} "
                "(its config's max_position_embeddings): start the schedule above it"
            )
        run = self.run_dir(seed, a, phase)
        summary = train(run, self.train_config(seed, a, phase))
        if "step_s" in summary:
            self.timings.record(f"train:{a.name}:{length}:step", summary["step_s"])
            self.timings.record(
                f"train:{a.name}:fixed", max(0.0, summary["wall_s"] - summary["steps"] * summary["step_s"])
            )
        summary["arm"], summary["seed"], summary["length"] = asdict(a), seed, length
        final = phase == len(self.s.earlier)
        write_json(self.out / "train" / ("" if final else "earlier") / f"seed{seed}_{run.name}.json", summary)

    def read_cell(self, read: evaluation.Read, n: int) -> None:
        """One length of one read, added to the read's file in ``--out`` at once (its lengths in order, the ones
        not read yet listed as ``missing``); the seconds per item of each task into ``Timings``."""
        expected = self.estimate.cell(read.arm, n)
        with Clock() as clock:
            cell = evaluation.read_length(self.model(read.model), self.inputs(), read.arm, n)
        cell |= {"wall_s": clock.wall_s, "expected_s": round(expected.seconds, 1), "expected_from": expected.source}
        kind = "sparse" if read.arm.sparse else "dense"
        for task, found in cell["seconds"].items():
            if found["items"]:
                self.timings.record(f"read:{kind}:{n}:{task}", found["s"] / found["items"])
        cells = self.cells(read) | {n: cell}
        record = {"model": read.model, "attention": read.attention, "arm": asdict(read.arm)}
        record |= {
            "cells": [cells[m] for m in sorted(cells)],
            "missing": [m for m in read.lengths(self.s) if m not in cells],
        }
        write_json(self.read_path(read), record)
        ruler = cell["ruler"]["average"]
        say(
            f"  NIAH {cell['niah']['score']:.0f}% (forced {cell['niah']['forced']:.0f}%), RULER-style {ruler:.1f}%, "
            f"last-bucket perplexity {evaluation.last_bucket_ppl(cell):.3f}"
            + (f", density {cell['density']:.3f}" if cell["density"] is not None else "")
        )

    def speed(self, n: int, doc: int) -> None:
        """Q/K/V of the speed layers of the first seed's adaptive (else first sparse) model at ``n`` tokens of the
        held-out document ``doc``, then every sparse arm and every arm timed only (``speed_arms``) against dense
        attention on them; the figures at ``n`` are those of every document timed so far (``speed.combine``)."""
        trained = self.s.sparse_arms
        if not trained:
            return
        if "fa4" in self.s.timed_backends and not fa4_installed():
            raise Refused(
                "--speed-backends fa4 needs FlashAttention-4 here: carry its wheels in .fa4/ before the speed stage "
                "(tools/fa4_wheels.sh, DEVELOPERS.md), or leave fa4 out"
            )
        source = next((a for a in trained if a.name == "adaptive"), trained[0])
        model_name = f"seed{self.s.seeds[0]}/{source.name}"
        model = self.model(model_name)
        inputs = self.inputs()
        ids = speed.text_ids(inputs.tokenizer, inputs.ppl_docs[doc:] + inputs.ppl_docs[:doc], n)
        qkv = speed.dump_qkv(model, ids, self.s.timed_layers(model.config.num_hidden_layers))
        found = speed.time_arms(qkv, self.s.timed_arms, self.s, n)
        del qkv
        _free()
        write_json(self._speed_doc(n, doc), found)
        say(f"  document {doc + 1}: " + _speed_line(found))
        docs = sorted((self.work / "speed" / str(n)).glob("doc*.json"), key=lambda p: int(p.stem[3:]))
        stamp = {"model": model_name, **provenance(self.s.device == "cuda")}
        combined = [r | stamp for r in speed.combine_backends([json.loads(p.read_text()) for p in docs])]
        write_json(self.work / "speed" / f"{n}.json", combined)
        if len(docs) > 1:
            say(f"  {len(docs)} documents: " + _speed_line(combined))
        lengths = sorted(self.work.glob("speed/*.json"), key=lambda p: int(p.stem))
        write_json(self.out / "speed.json", [r for p in lengths for r in json.loads(p.read_text())])

    def _mtraining(self, command: str, *args: str) -> None:
        """``python -m mtraining.cli COMMAND ARGS`` with its output in the log folder; RuntimeError naming its end."""
        log = self.out / f"{command}.log"
        with open(log, "a") as f:
            done = subprocess.run([sys.executable, "-m", "mtraining.cli", command, *args], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip
        if done.returncode != 0:
            tail = "\n".join(log.read_text().splitlines()[-15:])
            raise RuntimeError(f"mtraining {command} failed (exit {done.returncode}); the end of {log}:\n{tail}")

    # ------------------------------------------------------------------ running
    def plan(self) -> list[dict]:
        """Every stage with whether it is done and, if not, how long it is expected to take."""
        return [
            {"stage": st.name, "done": st.done(), "background": st.background, "expected": st.expected()}
            for st in self.stages()
        ]

    def run(self) -> None:
        """Every stage not done yet, in order, the base's gate right after its check; ``OutOfTime`` when the next
        stage would end past the deadline (a training started is stopped there instead). Each stage's expected
        and measured seconds go to the log and ``stage_times.json``; ``--tar`` is packed after each stage."""
        for st in self.stages():
            if not st.done():
                self.run_stage(st)
            if st.name == "base check":
                self.gate()
        report.write_folder_report(self.out)
        self.pack()

    def run_stage(self, st: Stage) -> None:
        """One stage under the call's deadline (``OutOfTime`` if its budget does not fit)."""
        expected = st.expected()
        if st.background:
            st.run()
            return
        left = Clock.left()
        say(f"{st.name}: {expected}" + ("" if left is None else f", {left:.0f}s left in this call"))
        try:
            with Clock(expected=st.budget()) as clock:
                st.run()
            if st.kind is not None:
                self.timings.record(st.kind, clock.wall_s)
            say(f"  {st.name} done in {clock.wall_s:.0f}s (expected {expected.seconds:.0f}s, {expected.source})")
            self.log_time(st.name, expected, clock.wall_s)
        finally:
            self.pack()

    def log_time(self, name: str, expected: Estimate, wall_s: float) -> None:
        """``out/stage_times.json``: every finished stage's expected seconds, their source and its measured ones."""
        path = self.out / "stage_times.json"
        found = json.loads(path.read_text()) if path.exists() else []
        found.append(
            {"stage": name, "expected_s": round(expected.seconds, 1), "from": expected.source, "wall_s": wall_s}
        )
        write_json(path, found)

    def pack(self) -> None:
        """``--out`` into ``--tar`` (if given), written whole."""
        if self.tar is not None and self.out.exists():
            pack(self.out, self.tar)


def _free() -> None:
    """Give cached GPU memory back (the next training runs in another process)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _speed_line(found: list[dict]) -> str:
    """The speed figures at one length in a line (``time_arms``'s records): dense milliseconds, each backend's arms'
    speedup and density."""
    arms = " | ".join(
        f"{r['backend']}: "
        + "; ".join(f"{k} {v['attention_speedup']:.2f}x at density {v['density']:.3f}" for k, v in r["arms"].items())
        for r in found
    )
    return f"dense {found[0]['dense_ms']:.1f} ms; {arms}"


def pack(out: Path, tar: Path) -> None:
    """``out``'s files as one .tgz at ``tar`` (written whole)."""
    with written(tar) as tmp, tarfile.open(tmp, "w:gz") as archive:
        archive.add(out, arcname=out.name)


def record_call(out: Path, settings: Settings, sources: Sources, status: int | None) -> None:
    """``out/run.json``: the settings, the sources, and one entry per call (provenance and exit status)."""
    path = out / "run.json"
    found = json.loads(path.read_text()) if path.exists() else {"calls": []}
    found["settings"] = json.loads(json.dumps(asdict(settings)))
    found["sources"] = json.loads(json.dumps(asdict(sources), default=str))
    found["root"] = str(ROOT)
    if status is None:
        found["calls"].append(provenance(settings.device == "cuda"))
    else:
        found["calls"][-1]["exit"] = status
    write_json(path, found)
