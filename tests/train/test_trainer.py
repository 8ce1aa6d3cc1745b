"""The trainer on gloo ranks: context/data parallel runs equal one process, loss falls, exact resume, export.

Each run is a tiny Qwen2 on the shipped corpus (the tokenizer's 512 ids), 128-token sequences,
float32, FSDP2 over all ranks with activation checkpointing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtraining.train.config import Config
from mtraining.train.launch import run_local
from tests.train.trainer_runs import FULL_BUDGET, SMALL_BUDGET, make_config, run_trainer


@pytest.mark.slow
def test_context_and_data_parallel_runs_equal_one_process():
    """Same losses (float32 reduction order aside) for 1 rank, CP=2 and DP=2 x CP=2; the loss falls."""
    single = run_local(run_trainer, 1, make_config("data.batch_size=2", *FULL_BUDGET))[0]
    cp = run_local(run_trainer, 2, make_config("parallel.context=2", "data.batch_size=2", *FULL_BUDGET))
    dp_cp = run_local(
        run_trainer, 4, make_config("parallel.data=2", "parallel.context=2", "data.batch_size=1", *FULL_BUDGET)
    )
    reference = torch.tensor([m["loss"] for m in single])
    for run in (cp[0], cp[1], dp_cp[0], dp_cp[3]):
        torch.testing.assert_close(torch.tensor([m["loss"] for m in run]), reference, rtol=2e-5, atol=0)
    assert reference[-1] < reference[0] - 0.3
    assert all(abs(m["density"] - 1.0) < 1e-12 and abs(m["recall"] - 1.0) < 1e-5 for m in single)


def _stop_and_resume(cfg: Config, export_dir: str) -> dict:
    from mtraining.train.checkpoint import full_model_state
    from mtraining.train.trainer import Trainer

    first = Trainer(cfg)
    losses = [first.train_step()["loss"] for _ in range(2)]
    first.save()
    losses.append(first.train_step()["loss"])  # what step 3 gives without a stop
    first.close()
    resumed = Trainer(cfg)
    start = resumed.step
    again = resumed.train_step()
    resumed.save()
    resumed.export(export_dir)
    state = full_model_state(resumed.model)
    resumed.close()
    return {"losses": losses, "start": start, "resumed": again, "state": state}


def test_checkpoint_resume_is_bit_identical_and_export_loads(tmp_path):
    cfg = make_config("parallel.context=2", *SMALL_BUDGET, f"checkpoint.dir={tmp_path / 'ck'}")
    out = run_local(_stop_and_resume, 2, cfg, str(tmp_path / "hf"))[0]
    assert out["start"] == 2
    assert out["resumed"]["loss"] == out["losses"][2]  # bit-identical
    assert out["losses"][2] < out["losses"][0]
    assert 0 < out["resumed"]["density"] < 1 and 0 < out["resumed"]["recall"] <= 1

    from mtraining.models import build_model
    from mtraining.train.export import export_checkpoint

    export_checkpoint(cfg, tmp_path / "ck", tmp_path / "offline")  # one process, the newest checkpoint
    trained = {k.removeprefix("model."): v for k, v in out["state"].items()}
    for directory in ("hf", "offline"):
        exported = build_model(path=tmp_path / directory)
        for name, tensor in exported.state_dict().items():
            assert torch.equal(tensor, trained[name]), (directory, name)
        assert (tmp_path / directory / "tokenizer.json").is_file()


def test_activation_checkpointing_replays_the_forward_patterns():
    """With checkpointing the backward recomputes each layer with the forward's pattern: same losses as without."""
    sparse = ("attention.v_size=8", "attention.s_size=16", "attention.max_density=null", "train.steps=3")
    with_ckpt = run_local(run_trainer, 1, make_config(*sparse, "train.activation_checkpointing=true"))[0]
    without = run_local(run_trainer, 1, make_config(*sparse, "train.activation_checkpointing=false"))[0]
    assert all(0 < m["density"] < 1 for m in with_ckpt)
    torch.testing.assert_close(
        torch.tensor([m["loss"] for m in with_ckpt]), torch.tensor([m["loss"] for m in without]), rtol=1e-6, atol=0
    )


@pytest.mark.slow
def test_compiled_layers_train_like_eager():
    """train.compile (each decoder layer compiled, attention a graph break) on a context-parallel ring with FSDP:
    the eager losses, to float32 rounding. The aot_eager backend traces what inductor compiles
    without generating code (inductor's C++ build takes minutes on this CPU; the GPU benchmark runs inductor)."""
    common = (*SMALL_BUDGET, "attention.max_density=null", "train.steps=2", "parallel.context=2")
    eager = run_local(run_trainer, 2, make_config(*common))[0]
    compile_options = ("train.compile=true", "train.compile_backend=aot_eager")
    compiled = run_local(run_trainer, 2, make_config(*common, *compile_options))[0]
    assert all(0 < m["density"] < 1 for m in compiled)
    torch.testing.assert_close(
        torch.tensor([m["loss"] for m in compiled]), torch.tensor([m["loss"] for m in eager]), rtol=1e-5, atol=0
    )


def test_saved_attention_outputs_replace_the_recomputed_attention():
    """train.save_attention_outputs: the recomputed forward reuses each layer's (out, lse); bit-identical
    steps, one rank and a context-parallel ring."""
    sparse = ("attention.v_size=8", "attention.s_size=16", "attention.max_density=null", "train.steps=3")
    for ranks, extra in ((1, ()), (2, ("parallel.context=2",))):
        saved = run_local(run_trainer, ranks, make_config(*sparse, *extra, "train.save_attention_outputs=true"))[0]
        plain = run_local(run_trainer, ranks, make_config(*sparse, *extra))[0]
        assert [(m["loss"], m["grad_norm"]) for m in saved] == [(m["loss"], m["grad_norm"]) for m in plain]
    with pytest.raises(ValueError, match="activation_checkpointing=true"):
        make_config("train.save_attention_outputs=true", "train.activation_checkpointing=false")


def _train_reporting_saved_outputs(cfg: Config) -> tuple[list[dict], bool]:
    from mtraining.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        return trainer.run(), trainer.save_outputs
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize("fits", [True, False])
def test_auto_saved_outputs_follow_the_first_steps_memory(monkeypatch, fits):
    """save_attention_outputs=auto (the default) asks the device's memory after step 1 (faked here; the
    forked ranks inherit the patch): on when peak + outputs fit, with steps bit-identical to a run
    without them; off on the CPU and without activation checkpointing."""
    sparse = (
        "attention.v_size=8",
        "attention.s_size=16",
        "attention.max_density=null",
        "train.steps=3",
        "parallel.context=2",
    )
    total = 10**12
    monkeypatch.setattr("mtraining.train.trainer.device_memory", lambda device: (total // 2 if fits else total, total))
    auto, kept = run_local(_train_reporting_saved_outputs, 2, make_config(*sparse))[0]
    assert kept == fits
    assert [m["saved_attention_outputs"] for m in auto] == [0.0, float(fits), float(fits)]  # decided after step 1
    no_recompute = make_config(*sparse, "train.activation_checkpointing=false")
    assert no_recompute.train.save_attention_outputs == "auto"
    assert not run_local(_train_reporting_saved_outputs, 2, no_recompute)[0][1]
    monkeypatch.undo()
    plain, kept = run_local(
        _train_reporting_saved_outputs, 2, make_config(*sparse, "train.save_attention_outputs=false")
    )[0]
    assert not kept
    assert [(m["loss"], m["grad_norm"]) for m in auto] == [(m["loss"], m["grad_norm"]) for m in plain]
    assert not run_local(_train_reporting_saved_outputs, 1, make_config("train.steps=1", *SMALL_BUDGET))[0][1]  # CPU


def test_recall_measured_only_when_asked():
    """log.recall=false: logged steps report density but skip the recall pass (and its cost)."""
    quiet = run_local(run_trainer, 1, make_config("train.steps=2", "log.recall=false", *SMALL_BUDGET))[0]
    measured = run_local(run_trainer, 1, make_config("train.steps=2", *SMALL_BUDGET))[0]
    assert all("density" in m and "recall" not in m for m in quiet)
    assert all(0 < m["recall"] <= 1 for m in measured)


def test_profile_step_writes_a_trace_and_a_table_per_rank(tmp_path):
    """log.profile_step: that step runs under torch.profiler; each rank writes its trace and op table."""
    cfg = make_config(
        "train.steps=2",
        "log.profile_step=2",
        f"log.dir={tmp_path}",
        "log.tensorboard=false",
        "parallel.context=2",
        *SMALL_BUDGET,
    )
    run_local(run_trainer, 2, cfg)
    files = sorted(p.name for p in tmp_path.glob("profile_*"))  # after every rank has finished
    assert files == [f"profile_step2_rank{r}.{ext}" for r in (0, 1) for ext in ("json", "txt")]
    table = (tmp_path / "profile_step2_rank0.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    json.loads((tmp_path / "profile_step2_rank1.json").read_text())


def test_profile_step_needs_a_log_dir():
    with pytest.raises(ValueError, match="set log.dir"):
        make_config("log.profile_step=1")


def _train_and_weights(cfg: Config) -> tuple[list[dict], dict]:
    from mtraining.train.checkpoint import full_model_state
    from mtraining.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        return trainer.run(), full_model_state(trainer.model)
    finally:
        trainer.close()


@pytest.mark.slow
def test_accumulated_micro_batches_equal_one_large_batch():
    """4 micro-batches of 1 sequence (train.grad_accum, or with gradients reduced once per step) give the losses,
    gradient norms and weights of one batch of 4, to float32 rounding, on 2 context ranks."""
    common = ("parallel.context=2", *SMALL_BUDGET, "train.steps=2")
    big, big_state = run_local(_train_and_weights, 2, make_config(*common, "data.batch_size=4"))[0]
    variants = (("train.grad_accum=4",), ("train.grad_accum=4", "train.defer_grad_sync=true"))
    for variant in variants:
        runs, state = run_local(_train_and_weights, 2, make_config(*common, *variant))[0]
        for key in ("loss", "grad_norm"):
            got, want = (torch.tensor([m[key] for m in r]) for r in (runs, big))
            torch.testing.assert_close(got, want, rtol=2e-5, atol=0, msg=f"{variant} {key}")
        for name, tensor in big_state.items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-4, atol=1e-5, msg=f"{variant} {name}")
    assert big[0]["tokens_per_s"] > 0 and make_config(*common, "data.global_batch_tokens=512").micro_batches == 4
    with pytest.raises(ValueError, match="contradicts data.global_batch_tokens"):
        make_config(*common, "data.global_batch_tokens=512", "train.grad_accum=2")
    with pytest.raises(ValueError, match="must be a multiple of the tokens of one micro-batch"):
        make_config(*common, "data.global_batch_tokens=300")


@pytest.mark.slow
def test_hierarchical_ring_trains_like_the_flat_ring():
    """parallel.ring=hierarchical in each of 2 data-parallel groups (inner rings of 1 rank, outer rings of 2:
    the ring groups of every context group are made up front): the flat ring's losses, to float32 rounding."""
    common = ("parallel.data=2", "parallel.context=2", *SMALL_BUDGET, "train.steps=3")
    flat = run_local(run_trainer, 4, make_config(*common))
    hierarchical = run_local(
        run_trainer, 4, make_config(*common, "parallel.ring=hierarchical", "parallel.inner_size=1")
    )
    for rank in (0, 3):
        torch.testing.assert_close(
            torch.tensor([m["loss"] for m in hierarchical[rank]]),
            torch.tensor([m["loss"] for m in flat[0]]),
            rtol=2e-5,
            atol=0,
        )


@pytest.mark.parametrize(
    "overrides, local_world_size, expected",
    [
        (["parallel.ring=hierarchical", "parallel.inner_size=3"], None, r"use one of \[1, 2, 4\]"),
        (["parallel.ring=flat", "parallel.inner_size=2"], None, "set both"),
        (["parallel.ring=hierarchical"], None, "launch with torchrun"),
        (["parallel.ring=hierarchical"], 3, r"set parallel.inner_size to one of \[1, 2, 4\]"),
        (["parallel.ring=hierarchical"], 2, 2),  # two nodes of 2 ranks
        (["parallel.ring=hierarchical"], 8, 4),  # the whole ring fits in one node: one inner ring
        (["parallel.ring=hierarchical", "parallel.inner_size=1"], 8, 1),
        (["parallel.ring=flat"], 2, 4),  # flat: one ring of all context ranks
        ([], 2, "resolved by train/ring_choice.py"),  # auto: chosen first
    ],
)
def test_ring_shape_is_validated_against_the_world(overrides, local_world_size, expected):
    def shape() -> int:
        return make_config("parallel.context=4", *SMALL_BUDGET, *overrides).inner_size(local_world_size)

    if isinstance(expected, int):
        assert shape() == expected
    else:
        with pytest.raises(ValueError, match=expected):
            shape()


@pytest.mark.slow
def test_document_masking_on_context_parallel_ranks_equals_one_process():
    """data.document_masking with reset position ids: CP=2 (striped) equals one process, sparse and dense;
    the documents change the losses (the tiny corpus' samples hold boundaries)."""
    masked = ["data.document_masking=true", "data.reset_position_ids=true", "train.steps=3"]
    for budget in (FULL_BUDGET, SMALL_BUDGET):
        single = run_local(run_trainer, 1, make_config("data.batch_size=2", *budget, *masked))[0]
        cp = run_local(run_trainer, 2, make_config("parallel.context=2", "data.batch_size=2", *budget, *masked))
        reference = torch.tensor([m["loss"] for m in single])
        for run in cp:
            torch.testing.assert_close(torch.tensor([m["loss"] for m in run]), reference, rtol=2e-5, atol=0)
    unmasked = run_local(run_trainer, 1, make_config("data.batch_size=2", *SMALL_BUDGET, "train.steps=3"))[0]
    assert any(abs(a["loss"] - b["loss"]) > 1e-4 for a, b in zip(unmasked, single))


FIXED_SEED_STEPS = Path(__file__).with_name("fixed_seed_steps.json")
FIXED_SEED_RUNS = {  # name: (ranks, overrides), on top of a sparse layer 1 behind a dense layer 0
    "one rank": (1, ("data.batch_size=2",)),
    "two context ranks, two micro-batches": (2, ("parallel.context=2", "train.grad_accum=2")),
    "two data ranks": (2, ("parallel.data=2",)),
}


def _environment() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def fixed_seed_steps() -> dict:
    """Loss, gradient norm, density and recall of every step of the ``FIXED_SEED_RUNS``."""
    common = ("attention.v_size=8", "attention.s_size=16", "attention.dense_layers=[0]", "attention.max_density=null")
    runs = {}
    for name, (ranks, overrides) in FIXED_SEED_RUNS.items():
        history = run_local(run_trainer, ranks, make_config(*common, "train.steps=3", *overrides))[0]
        runs[name] = [[m[k] for k in ("loss", "grad_norm", "density", "recall")] for m in history]
    return runs


def write_fixed_seed_steps() -> None:
    """Record ``fixed_seed_steps`` (after a change meant to change results, or for another torch or CPU)."""
    FIXED_SEED_STEPS.write_text(json.dumps({**_environment(), "runs": fixed_seed_steps()}, indent=1) + "\n")


def test_fixed_seed_steps_are_unchanged():
    """Every step of fixed-seed runs (one rank, a context-parallel ring with micro-batches, data parallel) is
    bit-identical to the recorded one: a change meant to make steps cheaper must not change a result. The
    record holds for its torch version and CPU kernels (other BLAS code paths round differently); rewrite it
    with ``python -c "from tests.train.test_trainer import write_fixed_seed_steps as w; w()"``."""
    recorded = json.loads(FIXED_SEED_STEPS.read_text())
    if {k: recorded[k] for k in _environment()} != _environment():
        pytest.skip(f"the record is of {recorded['torch']} on {recorded['cpu_capability']}: rewrite it here")
    assert fixed_seed_steps() == recorded["runs"]


def _steps_then_save(cfg: Config, steps: int) -> list[float]:
    from mtraining.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        losses = [trainer.train_step()["loss"] for _ in range(steps)]
        if cfg.checkpoint.dir is not None:
            trainer.save()
        return losses
    finally:
        trainer.close()


@pytest.mark.slow
def test_one_float32_rank_runs_without_fsdp_and_its_checkpoints_resume_on_a_ring(tmp_path):
    """FSDP is left out where it has nothing to do (one rank, float32 parameters) and kept elsewhere; a
    checkpoint of one rank (plain tensors) resumes on two context ranks (FSDP's DTensors) and back, each
    continuing as the run that never stopped (to float32 reduction order)."""
    from mtraining.train.trainer import fsdp_groups

    assert fsdp_groups(1, torch.float32) == "none"
    assert fsdp_groups(2, torch.float32) == fsdp_groups(2, torch.bfloat16) == "layers"
    common = (*SMALL_BUDGET, "train.steps=3")
    ring = ("parallel.context=2",)
    for first, then, folder in (((), ring, "one_to_two"), (ring, (), "two_to_one")):
        saved = (*common, f"checkpoint.dir={tmp_path / folder}")
        run_local(_steps_then_save, 2 if first else 1, make_config(*saved, *first), 2)
        resumed = run_local(_steps_then_save, 2 if then else 1, make_config(*saved, *then), 1)[0]
        whole = run_local(_steps_then_save, 2 if then else 1, make_config(*common, *then), 3)[0]
        torch.testing.assert_close(resumed[0], whole[2], rtol=2e-5, atol=0)


def _steps_and_fsdp_modules(cfg: Config) -> tuple[list[dict], list[str]]:
    from torch.distributed.fsdp import FSDPModule

    from mtraining.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        wrapped = [name for name, module in trainer.model.named_modules() if isinstance(module, FSDPModule)]
        return [trainer.train_step() for _ in range(cfg.train.steps)], wrapped
    finally:
        trainer.close()


@pytest.mark.parametrize("defer", [False, True])
def test_one_bfloat16_rank_casts_the_whole_model_at_once(monkeypatch, defer):
    """A bfloat16 world of one wraps only the root with FSDP (one cast and one reduce per step, not one per
    layer); with micro-batches and activation checkpointing every step's loss and gradient norm equal the
    per-layer wrapping's bit for bit."""
    import mtraining.train.trainer as trainer_module

    cfg = make_config(
        *SMALL_BUDGET,
        "model.dtype=bfloat16",
        "train.steps=3",
        "train.grad_accum=2",
        "train.activation_checkpointing=true",
        f"train.defer_grad_sync={str(defer).lower()}",
    )
    history, wrapped = run_local(_steps_and_fsdp_modules, 1, cfg)[0]
    assert wrapped == [""]  # the root only
    monkeypatch.setattr(trainer_module, "fsdp_groups", lambda world_size, dtype: "layers")  # the ranks fork
    per_layer, wrapped_layers = run_local(_steps_and_fsdp_modules, 1, cfg)[0]
    assert len(wrapped_layers) == 1 + cfg.model.config["num_hidden_layers"]
    steps = [[m[k] for k in ("loss", "grad_norm", "density")] for m in history]
    assert steps == [[m[k] for k in ("loss", "grad_norm", "density")] for m in per_layer]
    assert history[-1]["loss"] < history[0]["loss"]


def test_a_model_without_fsdp_moves_to_the_rank_device():
    """A float32 world of one skips FSDP (which moves parameters to the mesh's device); shard_model must move
    the model itself, or a GPU run computes with CUDA inputs against CPU weights (the meta device stands in)."""
    from types import SimpleNamespace

    from mtraining.train.trainer import shard_model

    module = torch.nn.Module()
    module.backbone = torch.nn.Module()
    module.backbone.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    par = SimpleNamespace(world_size=1, device=torch.device("meta"), fsdp_mesh=None)
    shard_model(module, par, torch.float32, activation_checkpointing=False)
    assert {p.device.type for p in module.parameters()} == {"meta"}
