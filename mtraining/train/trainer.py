"""The training loop: model, FSDP2 x context-parallel sharding, data, optimizer, checkpoints, metrics.

One ``Trainer`` per process (launched by torchrun, or alone as a world of one). Each step every
data-parallel group draws its samples, each context-parallel rank takes its layout shard of them,
the model runs with attention bound to the ring, and the summed token loss is normalised by the
global token count, so gradients equal those of one process holding the whole batch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..models import AttentionContext, bind, build_model, export_hf
from ..models.fused import use_liger_kernels
from ..ops.pattern.budgets import load_budgets
from ..ops.pattern.estimate import PatternConfig
from ..parallel.layout import make_layout
from .checkpoint import full_model_state, save_checkpoint, write_error
from .config import AttentionSection, Config
from .data import TOKEN_SUFFIXES, TextTokenizer, expand_sources, token_stream
from .distributed import ParallelState, init_parallel
from .divergence import check_finite
from .errors import Preempted, RunStopped
from .loss import IGNORE_INDEX, CausalLMLoss
from .monitor import Monitor, flops_per_token, matmul_params, peak_memory_gb, peak_tflops
from .optim import build_optimizer, lr_at, set_lr
from .outputs import check_free_space, check_output_dirs
from .packing import PackedSamples, shard_batch
from .profile import step_profiler, write_profile
from .resume import describe_run, model_identity, resume
from .saved_outputs import device_memory, plan_saved_outputs, saved_outputs_bytes
from .signals import StopSignal
from .watchdog import StepWatchdog, is_collective_failure

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pattern_config(att: AttentionSection) -> PatternConfig | None:
    """The estimation config of the attention section (None when attention is dense)."""
    if not att.sparse:
        return None
    common = dict(
        last_q=att.last_q,
        block_size=att.block_size,
        sink_tokens=att.sink_tokens,
        local_window=att.local_window,
        threshold=att.threshold,
    )
    if att.budgets is not None:
        return PatternConfig(budgets=load_budgets(att.budgets), **common)
    return PatternConfig(v_size=att.v_size, s_size=att.s_size, **common)


def _head_dim(config) -> int:
    """Attention head size of a HF config (explicit head_dim, else hidden_size / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def shard_model(
    model: CausalLMLoss, par: ParallelState, dtype: torch.dtype, activation_checkpointing: bool
) -> nn.Module:
    """Activation checkpointing per decoder layer, then FSDP2 over all data x context ranks.

    Parameters stay float32 (the master copy); with bfloat16 they are cast for compute and gradients
    are reduced in float32.
    """
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layers = model.backbone.layers
    for i, layer in enumerate(layers):
        if activation_checkpointing:
            layer = checkpoint_wrapper(layer)
        fully_shard(layer, mesh=par.fsdp_mesh, mp_policy=policy)
        layers[i] = layer
    fully_shard(model, mesh=par.fsdp_mesh, mp_policy=policy)
    return model


class Trainer:
    """Builds everything from a ``Config`` and runs steps; see the module docstring."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        cfg.check_world_size(dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1)))
        check_output_dirs(cfg)
        timeout_s = cfg.parallel.timeout_minutes * 60
        self.par = par = init_parallel(cfg.parallel.data, cfg.parallel.context, cfg.train.device, timeout_s)
        att, data = cfg.attention, cfg.data
        self.data = self._load_data()
        torch.manual_seed(cfg.train.seed)
        hf = build_model(cfg.model.path, cfg.model.config, cfg.model.rope_theta, cfg.model.rope_parameters)
        self._check_vocab(hf)
        cfg.check_layers(hf.config.num_hidden_layers)
        if cfg.train.fused_kernels == "liger":
            if par.device.type != "cuda":
                raise ValueError("train.fused_kernels=liger runs on CUDA only: set train.fused_kernels=none on the CPU")
            use_liger_kernels(hf)
        self.hf_config = hf.config
        self.layout = make_layout(att.layout, data.seq_len, par.cp_size, att.block_size)
        self.attention = bind(
            hf,
            AttentionContext(
                group=par.cp_group,
                layout=self.layout if par.cp_size > 1 else None,
                pattern_config=pattern_config(att),
                dense_layers=frozenset(att.dense_layers),
                min_sparse_len=att.min_sparse_len,
                max_density=att.max_density,
                backend=att.backend,
                replay_patterns={} if cfg.train.activation_checkpointing else None,
                replay_outputs={} if cfg.train.save_attention_outputs is True else None,
            ),
        )
        self._flops_matmul = self._flops_per_token(hf, 0.0)
        self._flops_attention = self._flops_per_token(hf, 1.0) - self._flops_matmul
        loss_model = CausalLMLoss(hf, cfg.train.loss_chunk_tokens, cfg.train.loss_impl)
        # what a checkpoint of this run belongs to (train/resume.py), before sharding renames nothing
        self.run_info = describe_run(cfg, model_identity(hf.config, loss_model.state_dict()), par.dp_size, par.cp_size)
        # float32 weights and AdamW's two moments
        check_free_space(cfg.checkpoint.dir, 12 * sum(p.numel() for p in loss_model.parameters()), "checkpoint.dir")
        self.model = shard_model(loss_model, par, _DTYPES[cfg.model.dtype], cfg.train.activation_checkpointing)
        o = cfg.optim
        self.optimizer = build_optimizer(self.model, o.lr, o.weight_decay, o.betas, o.eps)
        notes: list[str] = []
        self.step, self.last_checkpoint = resume(cfg, self.run_info, self.model, self.optimizer, notes.append)
        self.monitor = Monitor(
            par.is_main, cfg.log.dir, cfg.train.steps, self.step, cfg.log.every, cfg.log.tensorboard, cfg.log.progress
        )
        for note in notes:
            self.monitor.write(note)
        self.watchdog = StepWatchdog.for_default_group(timeout_s)
        self._peak = peak_tflops(par.device, cfg.log.peak_tflops)
        self._plan_outputs = cfg.train.save_attention_outputs == "auto" and cfg.train.activation_checkpointing

    # ------------------------------------------------------------------ setup helpers
    def _load_data(self) -> PackedSamples:
        d, m = self.cfg.data, self.cfg.model
        # the model directory's tokenizer only matters for text sources (token files need none)
        has_text = any(p.suffix not in TOKEN_SUFFIXES for p in expand_sources(d.sources))
        tok_path = d.tokenizer or (m.path if has_text else None)
        tokenizer = TextTokenizer(tok_path) if tok_path is not None else None
        stream = token_stream(d.sources, tokenizer, d.text_field, d.separator, d.token_dtype)
        self.vocab_needed = int(stream.max()) + 1
        return PackedSamples(stream, d.seq_len, seed=self.cfg.train.seed, shuffle=d.shuffle)

    def _check_vocab(self, hf: nn.Module) -> None:
        vocab = hf.get_input_embeddings().weight.shape[0]
        if self.vocab_needed > vocab:
            raise ValueError(
                f"the data holds token id {self.vocab_needed - 1} but the model's vocab_size is {vocab}; "
                "use the model's own tokenizer or raise model.config.vocab_size"
            )

    def _flops_per_token(self, hf: nn.Module, density: float) -> float:
        c = hf.config
        return flops_per_token(
            matmul_params(hf), c.num_hidden_layers, c.num_attention_heads, _head_dim(c), self.cfg.data.seq_len, density
        )

    # ------------------------------------------------------------------ steps
    @property
    def tokens_per_step(self) -> int:
        return self.par.dp_size * self.cfg.data.batch_size * self.cfg.data.seq_len

    def _local_batch(self, step: int):
        samples = self.data.batch(step, self.par.dp_rank, self.par.dp_size, self.cfg.data.batch_size)
        shard = shard_batch(samples, self.layout, self.par.cp_rank)
        dev = self.par.device
        return shard.input_ids.to(dev), shard.labels.to(dev), shard.position_ids.to(dev)

    def train_step(self) -> dict[str, float]:
        """One optimizer step on the next batch; returns its metrics (identical on every rank)."""
        cfg, par, step = self.cfg, self.par, self.step
        start = time.perf_counter()
        input_ids, labels, position_ids = self._local_batch(step)
        counts = torch.zeros(2, dtype=torch.float64, device=par.device)
        counts[0] = (labels != IGNORE_INDEX).sum()
        self.attention.stats.clear()
        logged = (step + 1) % cfg.log.every == 0 or step + 1 == cfg.train.steps
        recall = logged and cfg.log.recall
        self.attention.record, self.attention.replay = ("recall" if recall else "density"), False
        loss_sum = self.model(input_ids, labels, position_ids)
        # activation checkpointing re-runs the forward in the backward: with the forward's patterns
        # (attention.replay_patterns), recording nothing
        self.attention.record, self.attention.replay = "off", True
        counts[1] = loss_sum.detach()
        dist.all_reduce(counts)  # [global tokens, global loss sum]
        tokens, total = counts.tolist()
        # FSDP averages gradients over all ranks: scale so they are d(global loss sum)/d(params) / tokens.
        (loss_sum * (par.world_size / tokens)).backward()
        for saved in (self.attention.replay_patterns, self.attention.replay_outputs):
            if saved is not None:
                saved.clear()
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip is not None else float("inf")
        grad_norm = _to_float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))  # waits for the device
        check_finite(step + 1, total / tokens, grad_norm, self.last_checkpoint)  # before a NaN reaches the weights
        lr = lr_at(step, cfg.optim.lr, cfg.optim.warmup_steps, cfg.train.steps, cfg.optim.min_lr_ratio)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return self._metrics(total / tokens, grad_norm, lr, time.perf_counter() - start)

    def _decide_saved_outputs(self) -> None:
        """train.save_attention_outputs=auto, after the first step: keep the outputs if they fit on every rank."""
        memory = device_memory(self.par.device)
        if memory is None:
            return
        peak = torch.tensor(float(memory[0]), device=self.par.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # one decision for all ranks
        c = self.hf_config
        local_tokens = self.cfg.data.batch_size * self.cfg.data.seq_len // self.par.cp_size
        act_bytes = _DTYPES[self.cfg.model.dtype].itemsize
        saved = saved_outputs_bytes(c.num_hidden_layers, local_tokens, c.num_attention_heads, _head_dim(c), act_bytes)
        keep, why = plan_saved_outputs(int(peak.item()), saved, memory[1])
        if keep:
            self.attention.replay_outputs = {}
        self.monitor.write(why)

    def _metrics(self, loss: float, grad_norm: float, lr: float, elapsed: float) -> dict[str, float]:
        stats = list(self.attention.stats.values())
        density = sum(s.density for s in stats) / len(stats) if stats else None
        recalls = [s.recall for s in stats if s.recall is not None]
        tokens_per_s = self.tokens_per_step / elapsed
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tokens_per_s}
        if stats:
            metrics["dense_fallback"] = sum(s.ran_dense for s in stats)
        if self._peak is not None:
            # Attention FLOPs actually computed: sparse layers at their density, the others dense.
            layers = self.hf_config.num_hidden_layers
            computed = sum(1.0 if s.ran_dense else s.density for s in stats)
            attention = self._flops_attention * ((layers - len(stats)) + computed) / layers
            executed = self._flops_matmul + attention
            metrics["mfu"] = executed * tokens_per_s / (self.par.world_size * self._peak * 1e12)
        metrics["peak_mem_gb"] = peak_memory_gb(self.par.device)
        metrics["step_s"] = elapsed
        if density is not None:
            metrics["density"] = density
        if recalls:
            metrics["recall"] = sum(recalls) / len(recalls)
        return metrics

    # ------------------------------------------------------------------ persistence
    def save(self) -> Path:
        """Collective: a distributed checkpoint of the current step."""
        if self.cfg.checkpoint.dir is None:
            raise ValueError("checkpoint.dir is not set; set it to save checkpoints")
        path = save_checkpoint(self.cfg.checkpoint.dir, self.step, self.model, self.optimizer, self.run_info)
        self.last_checkpoint = path
        self.monitor.write(f"saved checkpoint {path}")
        return path

    def export(self, out_dir: str | Path) -> Path:
        """Collective: write the current weights as a HF directory (rank 0 writes)."""
        state = full_model_state(self.model)
        failure = None
        if self.par.is_main:
            prefix = "model."
            weights = {k.removeprefix(prefix): v for k, v in state.items()}
            try:
                export_hf(weights, self.hf_config, out_dir, tokenizer=self.cfg.data.tokenizer or self.cfg.model.path)
                self.monitor.write(f"exported HF model to {out_dir}")
            except Exception as err:  # write_error hands back what is not a full disk or a permission problem
                failure = write_error(err, Path(out_dir), "exporting to")
        box = [failure]
        dist.broadcast_object_list(box, src=0)  # every rank stops the same way
        if box[0] is not None:
            raise box[0]
        return Path(out_dir)

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
            if stop.agreed():
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


def _to_float(value) -> float:
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)
