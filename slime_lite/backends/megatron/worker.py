"""Megatron-core train workers (a Ray actor per logical GPU): ``TrainWorker`` holds what the policy
(actor.py ``TrainActor``) and the critic (critic.py ``CriticActor``) share: model, optimizer, forward passes,
optimizer steps, offload, checkpoints.

All ranks of a group run the same calls in lockstep. Results are reported by the *reporter* rank: the last
pipeline stage, TP rank 0, DP rank 0, after the per-sample results of every DP rank were gathered to it.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

import ray
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config
from transformers import AutoConfig

from slime_lite.backends.megatron import batch as B
from slime_lite.backends.megatron import (
    checkpoint,
    lora,
    lora_config,
    optimizer_ops,
    peft_format,
    routing,
    train_offload,
)
from slime_lite.backends.megatron.convert import load_hf_weights
from slime_lite.backends.megatron.freeze import freeze_by_name, grads_through_frozen_embedding
from slime_lite.backends.megatron.model import (
    build_gpt_model,
    hf_arch,
    memory_overrides,
    moe_overrides,
    packed_seq_params,
    sequence_parallel,
    unwrap,
)
from slime_lite.backends.megatron.moe_metrics import ExpertLoad, padding_mask, real_tokens
from slime_lite.backends.megatron.optimizer_offload import optimizer_config
from slime_lite.backends.megatron.parallel import init_distributed, open_store
from slime_lite.config import TokenBudget
from slime_lite.determinism import set_deterministic
from slime_lite.logging_setup import setup_logging
from slime_lite.metrics import process_memory
from slime_lite.offload import TensorStash
from slime_lite.profiling import TorchProfile, dump_memory_snapshot, start_memory_history, stop_memory_history
from slime_lite.rl_math import PerTokenNormalizer
from slime_lite.types import TrainResult

log = logging.getLogger(__name__)


def reported(value: Any) -> Any:
    """A value handed over from another group: the Ray object refs of one call on each of its ranks (they pass
    between the groups without going through the driver) give the reporter rank's result; anything else (a value
    given directly, None) is itself."""
    return next(r for r in ray.get(value) if r is not None) if isinstance(value, list) else value


class TrainWorker:
    """What every train role shares. A role sets ``role`` (its checkpoint folder; "actor" = the top folder) and
    ``metric_prefix`` (what its metric names begin with), and may override ``_lr`` and ``_adapt_model``."""

    role = ""
    metric_prefix = ""

    def __init__(self, args: Any, rank: int, world_size: int) -> None:
        setup_logging(args.log_level)
        self.args, self.rank, self.world_size = args, rank, world_size
        self._store = None
        torch.set_num_threads(max(1, int(os.environ.get("SLIME_LITE_TRAIN_THREADS", "1"))))
        if args.deterministic_mode:
            set_deterministic()
        elif not torch.cuda.is_available():
            torch.use_deterministic_algorithms(True, warn_only=True)

    # ----------------------------------------------------------------- setup
    def open_store(self, master_addr: str) -> int:
        """Rank 0: serve the group's rendezvous store (the ranks reach it at ``master_addr``) on a port the OS
        picks; returns the port."""

        self._store = open_store(master_addr, 0, self.rank, self.world_size)
        return self._store.port

    def init(self, master_addr: str, master_port: int) -> dict[str, Any]:

        a = self.args
        if a.record_memory_history:  # before the model exists: its allocations are in the snapshot

            start_memory_history()
        store = self._store or open_store(master_addr, master_port, self.rank, self.world_size)
        init_distributed(a.tensor_model_parallel_size, a.pipeline_model_parallel_size, self.rank, self.world_size,
                         master_addr, master_port, seed=a.seed, store=store, ep=a.expert_model_parallel_size,
                         etp=a.expert_tensor_parallel_size, timeout_s=60.0 * a.distributed_timeout_minutes)
        self.hf_config = AutoConfig.from_pretrained(a.hf_checkpoint)
        dtype = torch.bfloat16 if a.bf16 else torch.float32
        model = build_gpt_model(self.hf_config, params_dtype=dtype, transformer_impl=a.transformer_impl,
                                **memory_overrides(a), **moe_overrides(a, self.hf_config))
        load_hf_weights(model, self._init_checkpoint(), self.hf_config)
        self.replay = routing.Replay(model) if a.use_rollout_routing_replay or a.use_routing_replay else None
        self._recording: dict | None = None  # --use-routing-replay: the pass being recorded fills it (routing.py)
        self._route_tables: dict | None = None  # ... and the training passes replay it
        self._free_routing = False  # a pass that routes on its own despite replay (the without-replay log-probs)
        moe = hf_arch(self.hf_config).moe
        self.expert_load = ExpertLoad(model, self.hf_config.num_hidden_layers, moe.num_experts) if moe else None
        self.lora = lora_config.settings(a, hf_arch(self.hf_config).fused_gate_up)
        if self.lora is not None:  # base frozen, adapters added (lora.py)
            lora.apply(model, self.lora, a.seed)
            if a.lora_adapter_path:
                lora.load_hf_adapters(model, self.hf_config, peft_format.read(a.lora_adapter_path),
                                      f"--lora-adapter-path {a.lora_adapter_path}")
        self._adapt_model(model, dtype)
        freeze_by_name(model, a.only_train_params_name_list, a.freeze_params_name_list)  # slime's, every role
        grads_through_frozen_embedding(unwrap(model))  # full recompute trains the layers after a frozen embedding
        config = model.config
        # --optimizer-cpu-offload: Megatron's hybrid optimizer, which runs under its distributed optimizer
        distributed = bool(a.optimizer_cpu_offload)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=distributed)
        self.model = DistributedDataParallel(config, ddp_config, model)
        lr = self._lr()
        opt_config = optimizer_config(a, optimizer="adam", lr=lr, min_lr=lr, weight_decay=a.weight_decay,
                                      adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2, clip_grad=a.clip_grad,
                                      bf16=a.bf16, params_dtype=dtype)
        optimizer_ops.install()
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        optimizer_ops.use_fused_adam(self.optimizer)
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        config.no_sync_func = self.model.no_sync
        self.ps = ps
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.last_stage = ps.is_pipeline_last_stage()
        self.reporter = self.last_stage and ps.get_tensor_model_parallel_rank() == 0 and self.dp_rank == 0
        state = {"next_rollout_id": 0, "data_state": None}
        if a.load and checkpoint.latest(a.load) is not None:
            state = checkpoint.load(self, a.load)  # replaces the param groups with the checkpoint's
        set_group_hyperparameters(self.optimizer, lr, a.weight_decay, log_changes=self.rank == 0)
        return state

    def _lr(self) -> float:
        return self.args.lr

    def _init_checkpoint(self) -> str:
        """The HF folder the model starts from (a --load checkpoint, if any, replaces it)."""
        return self.args.hf_checkpoint

    def _adapt_model(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        """Role-specific changes to the freshly loaded model, before DDP wraps it and a checkpoint is loaded."""

    def gpt(self) -> torch.nn.Module:
        return unwrap(self.model)

    # ----------------------------------------------------------------- forward passes
    def _run(self, samples: list, mbs: list[list[int]], length: int, forward_only: bool, loss_fn: Any) -> list:
        """Megatron's schedule over this rank's micro-batches; returns what loss_fn reported per micro-batch."""


        packed = self.args.use_dynamic_batch_size
        # --sequence-parallel splits each row's tokens over the TP ranks: the length must divide by TP
        m = self.args.tensor_model_parallel_size if sequence_parallel(self.args) else 1
        length = -(-length // m) * m
        batches = [B.make_packed_micro_batch(samples, idx, multiple=m) if packed
                   else B.make_micro_batch(samples, idx, length) for idx in mbs]
        it = iter(batches)
        if self.args.pipeline_model_parallel_size > 1:  # a step of split trajectories: micro-batches of several
            # sizes, whose shapes the stages then send each other before the activations (Megatron's option)
            get_model_config(self.model).variable_seq_lengths = len({b.tokens.shape for b in batches}) > 1

        def forward_step(data_iterator: Any, model: Any) -> tuple:
            mb = next(data_iterator)
            if self.replay is not None:
                self._route(samples, mb)
            if self.expert_load is not None and self.expert_load.counting:  # training passes: real tokens only
                self.expert_load.next_micro_batch(real_tokens(samples, mb, sequence_parallel(self.args)))
            dev = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            extra = {"packed_seq_params": packed_seq_params(mb.cu_seqlens, mb.max_seqlen, dev)} if mb.packed else {}
            if self.expert_load is not None:  # an MoE model: padding out of the router losses (the first stage
                # splits the mask over the TP ranks itself under --sequence-parallel; later stages get it split)
                sp_split = sequence_parallel(self.args) and not unwrap(model).pre_process
                extra["padding_mask"] = B.to_device(padding_mask(samples, mb, sp_split), dev)
            # each TP rank keeps its vocabulary slice of the logits (logprobs.py reduces over the slices)
            out = model(B.to_device(mb.tokens, dev), B.to_device(mb.position_ids, dev), None,
                        runtime_gather_output=False, **extra)
            if self._recording is not None:
                self.replay.recorded(mb, samples, self._recording)
            return out, partial(loss_fn, mb)

        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=it, model=[self.model], num_microbatches=len(batches),
                seq_length=max(b.tokens.shape[1] for b in batches), micro_batch_size=batches[0].tokens.shape[0],
                forward_only=forward_only,
            )
        finally:
            if self.replay is not None:
                self.replay.clear()

    def _route(self, samples: list, mb: Any) -> None:
        """Before micro-batch ``mb``'s forward: record the routers' own experts, replay the engine's
        (--use-rollout-routing-replay) or the recorded ones (--use-routing-replay, training passes), or route
        freely (--use-routing-replay, the reference pass); a replay holds for the backward pass too."""
        if self._recording is not None:
            self.replay.record()
        elif self._free_routing:
            self.replay.clear()
        elif self.args.use_rollout_routing_replay or self._route_tables is not None:
            tables = None if self.args.use_rollout_routing_replay else self._route_tables
            self.replay.set(*routing.targets(samples, mb, self.replay.layer_ids, self.hf_config.num_hidden_layers,
                                             self.hf_config.num_experts_per_tok, sequence_parallel(self.args),
                                             tables))
        else:
            self.replay.clear()

    def _plan(self, samples: list, log_probs: bool = False) -> list[list[list[int]]]:
        """Sample indices per optimizer step, per micro-batch, for this DP rank: fixed --micro-batch-size, or
        packed by --max-tokens-per-gpu (--log-probs-max-tokens-per-gpu for the forward-only passes, which pack
        the whole rollout as one step); with --balance-data dealt to the DP ranks by estimated FLOPs. A step is
        --global-batch-size trajectories (``batch.trajectory_steps``: a split trajectory's samples in one step)."""
        a = self.args
        lengths = [len(s.tokens) for s in samples]
        costs = B.sample_flops(lengths, self.hf_config.hidden_size) if a.balance_data else None
        steps = B.trajectory_steps(samples, a.global_batch_size)
        if not a.use_dynamic_batch_size:
            return B.step_shards(steps, self.dp_rank, self.dp_size, a.micro_batch_size, costs)
        budget = TokenBudget.from_args(a)
        alone = budget.alone(lengths, log_probs)
        if alone and self.rank == 0:
            log.info("%d sample(s) longer than %s: each is a micro-batch of its own", len(alone),
                     budget.flags(log_probs))
        return B.dynamic_step_shards(lengths, [list(range(len(samples)))] if log_probs else steps, self.dp_rank,
                                     self.dp_size, budget.tokens(log_probs), costs)

    def _normalizer(self, samples: list, step: int) -> float:
        """What a step's micro-batch losses are divided by, so they add up (over micro-batches and the DP mean) to
        the step's loss: trajectories (samples, unless one was split) per DP rank, or with
        --calculate-per-token-loss the step's loss-mask tokens per DP rank. Independent of how the step is cut
        into micro-batches."""

        a = self.args
        g = a.global_batch_size
        if not a.calculate_per_token_loss:
            return g / self.dp_size
        step_samples = [samples[i] for i in B.trajectory_steps(samples, g)[step]]
        # each trajectory counts at least 1 (slime's clamp_min(loss_mask.sum(), 1)): one with no loss tokens too,
        # and a split one's parts together (a part without loss tokens adds none)
        tokens = sum(max(t, 1.0) for t in B.trajectory_tokens(step_samples, B.loss_masks(step_samples)).values())
        return PerTokenNormalizer(tokens / self.dp_size)

    def _forward_all(self, samples: list, steps: list, length: int, per_sample: Any) -> B.SampleTensors:
        """Forward-only pass over every micro-batch of this rank; {sample index: per_sample(mb, output)[k]} (last
        stage)."""
        results = B.SampleTensors()
        # each micro-batch's per-sample tensors, flattened into one on the device; to the host in one copy at the
        # end of the pass (a copy per micro-batch would wait for the GPU each time, and it would idle meanwhile)
        pending: list[tuple[list[int], list[torch.Size], torch.Tensor]] = []

        def collect(mb: B.MicroBatch, output: torch.Tensor, non_loss_data: bool = False) -> tuple:
            outs = [t.detach() for t in per_sample(mb, output)]
            pending.append((mb.indices, [t.shape for t in outs], torch.cat([t.reshape(-1) for t in outs])))
            return torch.zeros((), device=output.device), {}

        # eval mode: no dropout (--lora-dropout) in the log-prob and value passes, whose results must be those of
        # the weights the engines serve; _train_steps sets train mode again
        self.model.eval()
        with torch.no_grad():
            for mbs in steps:
                self._run(samples, mbs, length, True, collect)
        if pending:
            host = torch.cat([flat for _, _, flat in pending]).cpu().split([flat.numel() for _, _, flat in pending])
            for (indices, shapes, _), flat in zip(pending, host):
                for i, shape, h in zip(indices, shapes, flat.split([s.numel() for s in shapes])):
                    results[i] = h.view(shape)
        return results

    def _gather(self, local: B.SampleTensors) -> B.SampleTensors:
        """Union of per-sample tensors over the DP group (last-stage ranks only)."""

        if self.dp_size == 1:
            return local
        parts: list[Any] = [None] * self.dp_size
        dist.all_gather_object(parts, local, group=self.ps.get_data_parallel_group())
        return B.SampleTensors((k, v) for p in parts for k, v in p.items())

    def _train_steps(self, samples: list, loss_fn: Any) -> TrainResult:
        """Run the optimizer steps of one rollout: metrics averaged over steps (reporter's view), the grad-norm of
        each step, and each step's metrics."""

        length = B.padded_length(samples)
        steps = self._plan(samples)
        sums: dict[str, float] = {}
        per_step: list[dict[str, float]] = []
        norms: list[float] = []  # every step's grad-norm, for --ci-save-grad-norm / --ci-load-grad-norm
        if self.args.reset_optimizer_states:  # as slime: before each rollout's steps (a resumed run's loaded state too)
            cleared = optimizer_ops.reset_states(self.optimizer)
            if self.rank == 0 and cleared:
                log.info("--reset-optimizer-states: cleared the optimizer state of %d parameter(s)", cleared)
        self.model.train()
        if self.expert_load is not None:
            self.expert_load.start()
        for k, mbs in enumerate(steps):
            self._num_mb = len(mbs)
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            fn = partial(loss_fn, normalizer=self._normalizer(samples, k)) if loss_fn is not None else _no_loss
            reported = self._run(samples, mbs, length, False, _keyword_output(fn))
            ok, grad_norm, _ = self.optimizer.step()
            step = _summed(reported)
            if self.last_stage and self.dp_size > 1:
                keys = sorted(step)
                t = torch.tensor([step[x] for x in keys], dtype=torch.float64)
                dist.all_reduce(t, group=self.ps.get_data_parallel_group(with_context_parallel=False))
                step = {x: float(v) / self.dp_size for x, v in zip(keys, t)}
            step["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
            norms.append(step["grad_norm"])
            per_step.append(step)
            for key, v in step.items():
                sums[key] = sums.get(key, 0.0) + v
        prefix = self.metric_prefix
        out: dict[str, Any] = {f"{prefix}{k}": v / len(steps) for k, v in sums.items()}
        if self.expert_load is not None:  # all ranks
            out.update(self.expert_load.metrics(prefix))
        for key in ("ppo_kl", "grad_norm", "kl_loss", "value_loss"):
            if per_step and key in per_step[0]:
                out[f"{prefix}first_step/{key}"] = per_step[0][key]
        return TrainResult(out, norms, [{f"{prefix}{k}": v for k, v in step.items()} for step in per_step])

    def offload(self) -> None:
        """Free this worker's GPU memory while engines run (--offload-train): weights, optimizer state, grad buffers
        and caches (backends/megatron/train_offload.py)."""

        if getattr(self, "_stash", None) is None:
            self._stash = TensorStash(train_offload.device())
            self._held: list = []  # the parameter buffers' host copies (distributed optimizer)
        train_offload.offload(self.model, self.optimizer, self._stash, self._held)

    def onload(self) -> None:
        if getattr(self, "_stash", None) is not None:
            train_offload.onload(self.model, self._stash, self._held)

    def memory(self) -> dict[str, float]:
        return process_memory()

    # ----------------------------------------------------------------- profiling (driven by profiling.RunProfiler)
    def start_profile(self) -> None:
        self._profile = TorchProfile()
        # with --record-memory-history the allocator's own history already has every allocation
        self._profile.start(profile_memory=not self.args.record_memory_history)

    def stop_profile(self, folder: str) -> None:
        self._profile.stop(os.path.join(folder, f"train_{self.role}_rank{self.rank}.trace.json"))

    def memory_snapshot(self, folder: str, rollout_id: int) -> None:
        dump_memory_snapshot(os.path.join(folder, f"memory_snapshot_{self.role}_rank{self.rank}_"
                                                  f"rollout{rollout_id}.pickle"))
        stop_memory_history()

    def save(self, rollout_id: int, data_state: Any) -> None:
        checkpoint.save(self, self.args.save, rollout_id, data_state)


def set_group_hyperparameters(optimizer: Any, lr: float, weight_decay: float, log_changes: bool = False) -> None:
    """Each param group's learning rate and weight decay from the flags, times the group's ``lr_mult`` and
    ``wd_mult``, as Megatron's learning-rate scheduler sets them before every step (slime-lite runs without one: the
    rate is constant). Megatron builds the groups with ``wd_mult`` 0 for biases and 1-D weights (the norms), which
    are never decayed, but leaves the torch optimizer's ``weight_decay`` at the flag's value in every group until a
    scheduler applies the multipliers. Called after a checkpoint's groups replaced the fresh ones too: the flags of
    this run hold (a changed --lr / --critic-lr / --weight-decay is logged)."""
    changed: dict[str, tuple[float, float]] = {}
    for group in optimizer.param_groups:
        for key, value, mult in (("lr", lr, group.get("lr_mult", 1.0)),
                                 ("weight_decay", weight_decay, group.get("wd_mult", 1.0))):
            if mult and group.get(key, value * mult) != value * mult:
                changed[key] = (group[key] / mult, value)
            group[key] = value * mult
    if log_changes:
        for key, (old, new) in changed.items():
            log.info("optimizer %s: %g (this run's flags), not the checkpoint's %g", key, new, old)


def _summed(reported: list[dict]) -> dict[str, float]:
    """Each metric of a step's micro-batches summed in micro-batch order; the losses report 0-dim device tensors,
    brought to the host here in one copy (one device sync per step, not one per micro-batch)."""
    pairs = [(k, v) for m in reported for k, v in m.items()]
    tensors = [v.reshape(()).double() for _, v in pairs if torch.is_tensor(v)]
    host = iter(torch.stack(tensors).tolist() if tensors else ())
    out: dict[str, float] = {}
    for k, v in pairs:
        out[k] = out.get(k, 0.0) + (next(host) if torch.is_tensor(v) else float(v))
    return out


def _keyword_output(fn: Any) -> Any:
    def wrapped(mb: Any, output: torch.Tensor, non_loss_data: bool = False) -> tuple:
        return fn(mb, output)

    return wrapped


def _no_loss(mb: Any, output: torch.Tensor) -> tuple:
    return output.sum() * 0.0, {}
