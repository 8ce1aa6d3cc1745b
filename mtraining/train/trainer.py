"""The training loop: model, FSDP2 x context-parallel sharding, data, optimizer, checkpoints, metrics.

One ``Trainer`` per process (launched by torchrun, or alone as a world of one). Each step runs
``micro_batches`` micro-batches: every data-parallel group draws its samples, each context-parallel
rank takes its layout shard of them, the model runs with attention bound to the ring (flat or
hierarchical), and the summed token loss is normalised by the global token count of the whole step,
so gradients equal those of one process holding the whole batch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..models import Attention, StepStats, bind, build_model
from ..models.compiled import compile_layers
from ..models.fused import use_liger_kernels
from ..models.loader import head_dim
from ..ops.documents import Documents
from ..parallel.layout import make_layout
from ..parallel.topology import init_ring_groups
from .agree import agree, check_same, from_rank0
from .check import CHECKED_ENV, Launch, check_model
from .checkpoint import full_model_state, save_checkpoint
from .config import Config, shared_values
from .data import document_separator, open_sources
from .distributed import ParallelState, init_parallel, join_group
from .divergence import check_finite, check_finite_weights
from .errors import Preempted, RunStopped
from .export import DTYPES, export_model
from .loss import IGNORE_INDEX, CausalLMLoss
from .monitor import Monitor, flops_per_token, matmul_params, peak_memory_gb, peak_tflops
from .optim import build_optimizer, lr_at, set_lr
from .outputs import check_free_space, check_output_dirs, check_shared_dir
from .packing import PackedSamples, first_draw, shard_batch
from .preflight import check_before_ranks, check_sources, rope_warning
from .profile import step_profiler, write_profile
from .resume import describe_run, model_identity, resume
from .retention import prune_checkpoints
from .ring_choice import choose_ring
from .saved_outputs import device_memory, plan_saved_outputs, saved_outputs_bytes
from .signals import StopSignal
from .summary import startup_summary
from .watchdog import StepWatchdog, is_collective_failure

FsdpGroups = Literal["none", "root", "layers"]


def fsdp_groups(world_size: int, dtype: torch.dtype) -> FsdpGroups:
    """How FSDP2 wraps the model: ``layers`` (each decoder layer, then the root) over several ranks, so
    one layer's parameters are gathered at a time; on a world of one ``root`` (one group: the whole model
    cast to ``dtype`` once per step, its gradients cast back once) when parameters are cast for compute,
    ``none`` in float32.

    A world of one has nothing to shard or reduce: per-layer groups would only pay every layer's hooks
    (cast, reshard, re-cast for the backward, reduce) on every step, and a float32 one would also pay the
    DTensor dispatch of every optimizer and clipping op; the results are the same either way. One group
    keeps the whole compute copy (2 bytes per parameter in bfloat16) from the forward to the end of the
    backward, where per-layer groups hold one layer's.
    """
    if world_size > 1:
        return "layers"
    return "none" if dtype == torch.float32 else "root"


def shard_model(
    model: CausalLMLoss, par: ParallelState, dtype: torch.dtype, activation_checkpointing: bool
) -> nn.Module:
    """Activation checkpointing per decoder layer, then FSDP2 over all data x context ranks (``fsdp_groups``).

    Parameters stay float32 (the master copy); with bfloat16 they are cast for compute and gradients
    are reduced in float32. Without FSDP the model is moved to the rank's device here (FSDP moves it).
    """
    groups = fsdp_groups(par.world_size, dtype)
    if groups == "none":
        model.to(par.device)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layers = model.backbone.layers
    for i, layer in enumerate(layers):
        if activation_checkpointing:
            layer = checkpoint_wrapper(layer)
        if groups == "layers":
            fully_shard(layer, mesh=par.fsdp_mesh, mp_policy=policy)
        layers[i] = layer
    if groups != "none":
        fully_shard(model, mesh=par.fsdp_mesh, mp_policy=policy)
    return model


class Trainer:
    """Builds everything from a ``Config`` and runs steps; see the module docstring."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        timeout_s = cfg.parallel.timeout_minutes * 60
        join_group(cfg.train.device, timeout_s)
        # first: ranks of other configs (another parallel shape) would fail apart or build different groups and hang
        check_same(shared_values(cfg), "configs", "start every node with the same config and key=value overrides")
        cfg.check_world_size(dist.get_world_size())
        self.par = par = init_parallel(cfg.parallel.data, cfg.parallel.context, cfg.train.device, timeout_s)
        if not par.is_main:
            _quiet_transformers()
        per_node = _local_world_size() or par.world_size
        launch = Launch(per_node, par.world_size // per_node)
        checked = os.environ.get(CHECKED_ENV) == "1"  # the --nproc launcher ran them on every node
        warnings = [] if checked else agree(lambda: check_before_ranks(cfg, launch)[0])
        agree(lambda: check_output_dirs(cfg))
        check_shared_dir(cfg.checkpoint.dir, "checkpoint.dir")
        att, data = cfg.attention, cfg.data
        self.sources = open_sources(cfg, log=self._say)
        sizes = {
            f"data.sources[{i}] (tokens, largest id)": [len(s.stream), s.max_id] for i, s in enumerate(self.sources)
        }
        check_same(sizes, "data", "give every node the same data files")
        self.separator = agree(lambda: document_separator(cfg))
        self.data = agree(self._packed_samples)
        torch.manual_seed(cfg.train.seed)
        hf = agree(self._build_model)
        if cfg.train.fused_kernels == "liger":
            use_liger_kernels(hf)
        self.hf_config = hf.config
        self.ring = agree(lambda: choose_ring(cfg, _local_world_size(), hf.config))
        if self.ring.ring == "hierarchical" and par.dp_size > 1:
            cp = par.cp_size  # the mesh is (data, context), context innermost: ring d holds ranks d*cp .. d*cp+cp-1
            init_ring_groups(self.ring.inner_size, [list(range(d * cp, (d + 1) * cp)) for d in range(par.dp_size)])
        if cfg.train.compile:
            compile_layers(hf, cfg.train.compile_backend)
        self.layout = make_layout(att.layout, data.seq_len, par.cp_size, att.block_size)
        self.attention = bind(
            hf,
            Attention(
                group=par.cp_group,
                layout=self.layout if par.cp_size > 1 else None,
                pattern_config=att.pattern_config(),
                dense_layers=frozenset(att.dense_layers),
                min_sparse_len=att.min_sparse_len,
                max_density=att.max_density,
                backend=att.backend,
                ring=self.ring.ring,
                inner_size=self.ring.inner_size,
                context_mode=cfg.parallel.context_mode,
                checkpointed=cfg.train.activation_checkpointing,
            ),
        )
        # each layer's attention (out, lse) kept for the checkpoint recompute (train/saved_outputs.py)
        self.save_outputs = cfg.train.save_attention_outputs is True
        self._flops_matmul = self._flops_per_token(hf, 0.0)
        self._flops_attention = self._flops_per_token(hf, 1.0) - self._flops_matmul
        loss_model = CausalLMLoss(hf, cfg.train.loss_chunk_tokens, cfg.train.loss_impl)
        # what a checkpoint of this run belongs to (train/resume.py), before sharding renames nothing
        self.run_info = describe_run(cfg, model_identity(hf.config, loss_model.state_dict()), par.dp_size, par.cp_size)
        check_same(
            {
                "the model (config and parameter shapes)": self.run_info["model"],
                "the tokenizer": self.run_info["tokenizer"],
            },
            "models",
            "give every node the same model folder and tokenizer",
        )
        # float32 weights and AdamW's two moments
        params = sum(p.numel() for p in loss_model.parameters())
        agree(lambda: check_free_space(cfg.checkpoint.dir, 12 * params, "checkpoint.dir"))
        self.model = shard_model(loss_model, par, DTYPES[cfg.model.dtype], cfg.train.activation_checkpointing)
        o = cfg.optim
        self.optimizer = build_optimizer(self.model, o.lr, o.weight_decay, o.betas, o.eps)
        notes: list[str] = []
        self.step, self.last_checkpoint = agree(
            lambda: resume(cfg, self.run_info, self.model, self.optimizer, notes.append)
        )
        lg = cfg.log
        self.monitor = Monitor(
            par.is_main,
            lg.dir,
            cfg.train.steps,
            self.step,
            lg.every,
            lg.tensorboard,
            lg.progress,
            resumed_from=str(self.last_checkpoint) if self.last_checkpoint is not None else None,
            wandb=lg.wandb,
            run_config=cfg.model_dump(mode="json"),
        )
        summary = startup_summary(
            cfg, hf, par.world_size, self.ring, str(par.device), self.sources, self.data, self.step
        )
        self.monitor.write(f"run {self.monitor.run_id}")
        for line in summary + (warnings or [w for w in (rope_warning(cfg, hf.config),) if w]) + notes:
            self.monitor.write(line)
        self.watchdog = StepWatchdog.for_default_group(timeout_s)
        self._peak = peak_tflops(par.device, cfg.log.peak_tflops)
        self._plan_outputs = cfg.train.save_attention_outputs == "auto" and cfg.train.activation_checkpointing

    # ------------------------------------------------------------------ setup helpers
    def _say(self, line: str) -> None:
        """Print from rank 0 before the monitor exists."""
        if self.par.is_main:
            print(line, flush=True)

    def _packed_samples(self) -> PackedSamples:
        check_sources(self.cfg, self.sources)
        d = self.cfg.data
        return PackedSamples(
            [s.stream for s in self.sources],
            d.seq_len,
            seed=self.cfg.train.seed,
            shuffle=d.shuffle,
            weights=[s.weight for s in self.sources] if self.sources[0].weight is not None else None,
            names=[s.name for s in self.sources],
        )

    def _build_model(self) -> nn.Module:
        cfg = self.cfg
        if cfg.train.fused_kernels == "liger" and self.par.device.type != "cuda":
            raise ValueError("train.fused_kernels=liger runs on CUDA only: set train.fused_kernels=none on the CPU")
        if cfg.attention.backend == "fa4" and self.par.device.type != "cuda":
            raise ValueError("attention.backend=fa4 runs on CUDA only: set attention.backend=triton on the CPU")
        hf = build_model(**cfg.model.hf_kwargs(), init=cfg.model.init)
        check_model(cfg, hf.config, self.sources)
        cfg.check_layers(hf.config.num_hidden_layers)
        return hf

    def _flops_per_token(self, hf: nn.Module, density: float) -> float:
        c = hf.config
        return flops_per_token(
            matmul_params(hf), c.num_hidden_layers, c.num_attention_heads, head_dim(c), self.cfg.data.seq_len, density
        )

    # ------------------------------------------------------------------ steps
    @property
    def tokens_per_step(self) -> int:
        return self.cfg.tokens_per_step

    def _local_batch(self, step: int, micro: int) -> tuple[Tensor, Tensor, Tensor, Documents | None, int]:
        """This rank's shard of micro-batch ``micro`` of ``step``: input ids, labels, position ids, the packed
        documents (global boundaries; None without data.document_masking), and the labelled tokens of the
        whole micro-batch (every context rank's shard), counted on the host."""
        d, par = self.cfg.data, self.par
        first = first_draw(step, micro, self.cfg.micro_batches, par.dp_rank, par.dp_size, d.batch_size)
        samples = self.data.batch(first, d.batch_size)
        shard = shard_batch(samples, self.layout, par.cp_rank, self.separator, d.reset_position_ids)
        labelled = int((samples[:, 1:] != IGNORE_INDEX).sum())
        dev = par.device
        return shard.input_ids.to(dev), shard.labels.to(dev), shard.position_ids.to(dev), shard.documents, labelled

    def train_step(self) -> dict[str, float]:
        """One optimizer step over ``micro_batches`` micro-batches; returns its metrics (identical on every rank).

        The summed token loss of every micro-batch is divided by the global token count of the whole
        step before its backward, so the accumulated gradients equal those of one large batch.
        """
        cfg, par, step = self.cfg, self.par, self.step
        start = time.perf_counter()
        micro = [self._local_batch(step, m) for m in range(cfg.micro_batches)]
        tokens = float(sum(batch[-1] for batch in micro))  # this data-parallel rank's, whole sequences
        if par.dp_group is not None:  # global tokens of the step: every data-parallel rank's
            summed = torch.tensor(tokens, dtype=torch.float64, device=par.device)
            dist.all_reduce(summed, group=par.dp_group)
            tokens = summed.item()
        # FSDP averages gradients over all ranks: scale so they are d(global loss sum)/d(params) / tokens.
        scale = par.world_size / tokens
        logged = (step + 1) % cfg.log.every == 0 or step + 1 == cfg.train.steps
        total = torch.zeros((), dtype=torch.float64, device=par.device)
        for m, (input_ids, labels, position_ids, documents, _) in enumerate(micro):
            last = m == len(micro) - 1
            if cfg.train.defer_grad_sync and isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(last)
            recall = logged and last and cfg.log.recall  # the pattern metrics are the last micro-batch's
            record = "recall" if recall else "density"
            with self.attention.forward(
                record=record, save_outputs=self.save_outputs, documents=documents, seed=step
            ):  # seed: the rows recall measures, the same on every rank
                loss_sum = self.model(input_ids, labels, position_ids)
            total += loss_sum.detach()
            with self.attention.recompute():  # see Note [recompute replays the pattern] (models/attention.py)
                (loss_sum * scale).backward()
        pattern = self.attention.end_step()
        if par.world_size > 1:
            dist.all_reduce(total)
        loss = total.item() / tokens
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip is not None else float("inf")
        grad_norm = _to_float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))  # waits for the device
        # once per optimizer step, after every micro-batch: before a NaN reaches the weights
        check_finite(step + 1, loss, grad_norm, self.last_checkpoint)
        lr = lr_at(step, cfg.optim.lr, cfg.optim.warmup_steps, cfg.train.steps, cfg.optim.min_lr_ratio)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return self._metrics(loss, grad_norm, lr, time.perf_counter() - start, pattern)

    def _decide_saved_outputs(self) -> None:
        """train.save_attention_outputs=auto, after the first step: keep the outputs if they fit on every rank."""
        memory = device_memory(self.par.device)
        if memory is None:
            return
        peak = torch.tensor(float(memory[0]), device=self.par.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # one decision for all ranks
        c = self.hf_config
        local_tokens = self.cfg.data.batch_size * self.cfg.data.seq_len // self.par.cp_size  # one micro-batch
        act_bytes = DTYPES[self.cfg.model.dtype].itemsize
        saved = saved_outputs_bytes(c.num_hidden_layers, local_tokens, c.num_attention_heads, head_dim(c), act_bytes)
        keep, why = plan_saved_outputs(int(peak.item()), saved, memory[1])
        self.save_outputs = keep
        self.monitor.write(why)

    def _metrics(
        self, loss: float, grad_norm: float, lr: float, elapsed: float, pattern: StepStats
    ) -> dict[str, float]:
        stats = list(pattern.layers.values())
        tokens_per_s = self.tokens_per_step / elapsed
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tokens_per_s}
        if stats:
            metrics["dense_fallback"] = pattern.dense_fallback
        if self._peak is not None:
            # Attention FLOPs actually computed: sparse layers at their density, the others dense.
            layers = self.hf_config.num_hidden_layers
            computed = sum(1.0 if s.ran_dense else s.density for s in stats)
            attention = self._flops_attention * ((layers - len(stats)) + computed) / layers
            executed = self._flops_matmul + attention
            metrics["mfu"] = executed * tokens_per_s / (self.par.world_size * self._peak * 1e12)
        metrics["peak_mem_gb"] = peak_memory_gb(self.par.device)
        if self.cfg.train.activation_checkpointing:
            # whether this step kept the attention outputs (more memory, no recomputed attention): peaks compare
            # only between runs that agree on it
            metrics["saved_attention_outputs"] = float(self.save_outputs)
        metrics["step_s"] = elapsed
        if pattern.density is not None:
            metrics["density"] = pattern.density
        if pattern.recall is not None:
            metrics["recall"] = pattern.recall
        return metrics

    # ------------------------------------------------------------------ persistence
    def save(self) -> Path:
        """Collective: a distributed checkpoint of the current step."""
        if self.cfg.checkpoint.dir is None:
            raise ValueError("checkpoint.dir is not set; set it to save checkpoints")
        self._check_weights()
        path = save_checkpoint(
            self.cfg.checkpoint.dir, self.step, self.model, self.optimizer, self.run_info, self.monitor.write
        )
        self.last_checkpoint = path
        self.monitor.write(f"saved checkpoint {path}")
        if self.par.is_main and self.cfg.checkpoint.keep:
            for line in prune_checkpoints(self.cfg.checkpoint.dir, self.cfg.checkpoint.keep):
                self.monitor.write(line)
        return path

    def export(self, out_dir: str | Path) -> Path:
        """Collective: write the current weights as a HF directory (rank 0 writes)."""
        self._check_weights()
        state = full_model_state(self.model)
        failure = None
        if self.par.is_main:
            prefix = "model."
            weights = {k.removeprefix(prefix): v for k, v in state.items()}
            try:
                export_model(self.cfg, weights, self.hf_config, out_dir)
                self.monitor.write(f"exported HF model to {out_dir}")
            except Exception as err:  # SaveFailed for a full disk or a permission problem, else as raised
                failure = err
        failure = from_rank0(failure)  # every rank stops the same way
        if failure is not None:
            raise failure
        return Path(out_dir)

    def _check_weights(self) -> None:
        """Collective: Diverged unless the weights' norm is finite (divergence.check_finite_weights)."""
        norm = torch.nn.utils.get_total_norm([p.detach() for p in self.model.parameters()])
        check_finite_weights(self.step, _to_float(norm), self.last_checkpoint)

    def run(self) -> list[dict[str, float]]:
        """Train to ``train.steps``, checkpointing and exporting as configured; returns every step's metrics.

        Raises ``RunStopped`` (errors.py) when the run must end early: divergence, a stalled rank,
        SIGTERM (after saving a checkpoint), a failed save.
        """
        history: list[dict[str, float]] = []
        try:
            with StopSignal(self.par.device) as stop:
                self._train(history, stop)
        except RuntimeError as err:
            if isinstance(err, RunStopped) or not is_collective_failure(err):
                raise
            raise self.watchdog.stalled(self.step + 1, err) from err
        return history

    def _train(self, history: list[dict[str, float]], stop: StopSignal) -> None:
        ck = self.cfg.checkpoint
        while self.step < self.cfg.train.steps:
            self.watchdog.step_started(self.step + 1)
            if self.step + 1 == self.cfg.log.profile_step:
                with step_profiler(self.par.device) as prof:
                    metrics = self.train_step()
                table = write_profile(prof, self.cfg.log.dir, self.step, self.par.rank, self.par.device)
                self.monitor.write(f"profile of step {self.step}: {table} and its .json trace (one per rank)")
            else:
                metrics = self.train_step()
            self.watchdog.step_finished()
            if self._plan_outputs:
                self._plan_outputs = False
                self._decide_saved_outputs()
            history.append(metrics)
            self.monitor.log(self.step, metrics)
            last = self.step == self.cfg.train.steps
            saved = ck.dir is not None and (last or (ck.every is not None and self.step % ck.every == 0))
            if saved:
                self.save()
            if stop.agreed():  # see Note [stopping together] (signals.py)
                if ck.dir is not None and not saved:
                    self.save()
                where = (
                    f"saved {self.last_checkpoint}" if ck.dir is not None else "nothing saved (checkpoint.dir unset)"
                )
                raise Preempted(f"SIGTERM: stopped after step {self.step}, {where}; run the same command to resume")
        if ck.export_dir is not None:
            self.export(ck.export_dir)

    def close(self) -> None:
        self.watchdog.close()
        self.monitor.close()


def _local_world_size() -> int | None:
    """Ranks on this node, as torchrun says (None when not launched by torchrun)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value is not None else None


def _quiet_transformers() -> None:
    """No loading bars or warnings from Hugging Face on ranks other than 0 (rank 0 shows them once)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _to_float(value) -> float:
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)
