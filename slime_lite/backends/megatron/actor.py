"""The policy's train worker (a Ray actor per logical GPU): log-probs (and the reference's), advantages, policy
steps, weights out to the engines. What it shares with the critic is worker.py's ``TrainWorker``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from slime_lite import rl_math
from slime_lite.backends.megatron import batch as B
from slime_lite.backends.megatron import lora, train_hooks
from slime_lite.backends.megatron.convert import iter_hf_weights
from slime_lite.backends.megatron.logprobs import sample_log_probs
from slime_lite.backends.megatron.loss import mismatch_report, rl_loss
from slime_lite.backends.megatron.train_dump import save_train_dump
from slime_lite.backends.megatron.weight_push import push, push_lora_to_sglang
from slime_lite.backends.megatron.worker import TrainWorker, reported
from slime_lite.checks.faults import breaks_sent_weights, sent_stage_weights
from slime_lite.config import LossConfig, TrainSideConfig, has_reference_model
from slime_lite.io import atomic_torch_save, atomic_write_text
from slime_lite.lora_wire import adapter_names, merged
from slime_lite.tokenizer import load_tokenizer
from slime_lite.types import TrainResult

log = logging.getLogger(__name__)


def _masked_mean_abs(a: list, b: list, masks: list) -> float:
    """Mean over samples (with a token in ``masks``) of the masked mean |a - b|."""
    rows = [rl_math.masked_mean((x - y).abs().float(), m) for x, y, m in zip(a, b, masks) if m.sum() > 0]
    return float(torch.stack(rows).mean()) if rows else 0.0


class TrainActor(TrainWorker):
    """The policy: log-probs (and the reference's), advantages, policy steps; sends its weights to the engines."""

    role = "actor"
    metric_prefix = "train/"

    def _init_checkpoint(self) -> str:
        return TrainSideConfig.from_args(self.args).init_checkpoint  # --ref-load when given (slime), else the HF one

    def _adapt_model(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        """Keep a CPU copy of the reference weights when a KL term needs them: the start weights, which are the
        reference's (--ref-load, else --hf-checkpoint), before a --load checkpoint replaces them."""
        a = self.args
        self.ref_state, self._ref_stream = None, None
        self.use_ref = has_reference_model(a)
        if self.use_ref and self.lora is None:  # with LoRA the reference is the model without its adapters
            self.ref_state = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
            if torch.cuda.is_available():  # pinned: each rollout's copy to the GPU runs at full speed
                self.ref_state = {n: t.pin_memory() for n, t in self.ref_state.items()}

    def update_reference(self) -> None:
        """--ref-update-interval: the reference weights become the actor's current ones (copied into the host copy
        in place, so it stays pinned on CUDA)."""
        if self.ref_state is None:
            return
        with torch.no_grad():
            for n, p in self.gpt().named_parameters():
                self.ref_state[n].copy_(p.detach())
        if self.rank == 0:
            log.info("the reference model now has the actor's current weights (--ref-update-interval %d)",
                     self.args.ref_update_interval)

    def _log_probs(self, mb: B.MicroBatch, output: torch.Tensor, entropy: bool = False) -> list[torch.Tensor]:
        """Response-token log-probs of each sample of a micro-batch, from the model output ([2, R]: log-probs and
        entropy, with ``entropy``)."""
        temp = rl_math.scoring_temperature(self.args.rollout_temperature)
        lp, ent = sample_log_probs(output, mb, temp, self.gpt().hf_vocab_size, with_entropy=entropy)
        return [torch.stack([x, e]) for x, e in zip(lp, ent)] if entropy else lp

    def _stage_ref(self) -> tuple[dict[str, torch.Tensor], Any] | None:
        """The reference weights where the model runs, and an event that marks them ready: on a GPU, copies from
        pinned host memory started on a side stream, so they overlap what runs next (the actor's log-prob pass);
        on the CPU, the host copy itself (no event)."""
        if self.ref_state is None or not torch.cuda.is_available():
            return None if self.ref_state is None else (self.ref_state, None)
        if self._ref_stream is None:  # one stream for good: the allocator caches blocks per stream
            self._ref_stream = torch.cuda.Stream()
        stream = self._ref_stream
        with torch.cuda.stream(stream):
            staged = {n: t.to("cuda", non_blocking=True) for n, t in self.ref_state.items()}
            ready = torch.cuda.Event()
            ready.record(stream)
        return staged, ready

    def _with_ref_weights(self, fn: Any, staged: tuple | None = None) -> Any:
        """fn() under the reference weights (``staged``: from ``_stage_ref``, else staged now). The parameters'
        storage is swapped, not copied, and swapped back afterwards, so the reference pass costs no copy on the
        GPU (the actor's own storage, views of Megatron's parameter buffer, is left untouched)."""
        if self.lora is not None:
            with lora.disabled(self.model):
                return fn()
        weights, ready = self._stage_ref() if staged is None else staged
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
            for t in weights.values():  # allocated on the side stream, read and freed on this one
                t.record_stream(torch.cuda.current_stream())
        params = dict(self.gpt().named_parameters())
        saved = {n: p.data for n, p in params.items()}
        try:
            for n, p in params.items():
                p.data = weights[n]
            return fn()
        finally:
            for n, p in params.items():
                p.data = saved[n]

    def train(self, rollout_id: int, samples: list, values: list | None) -> tuple[TrainResult | None, Any]:
        """Log-probs, advantages and ``--num-steps-per-rollout`` optimizer steps on one rollout. ``values``: the
        critic ranks' ``compute_values`` refs (None without a critic). Returns (the reporter's result, the
        per-sample returns the critic trains toward), each None on the other ranks."""

        a = self.args
        values = reported(values)  # {sample index: values} of the critic's reporter
        t0 = time.monotonic()
        length = B.padded_length(samples)
        steps = self._plan(samples, log_probs=True)
        dump = a.save_debug_train_data  # the old forward also gives each token's entropy for the train dump
        own_routes = self.replay is not None and not a.use_rollout_routing_replay  # --use-routing-replay
        if self.replay:  # the mismatch of this pass only (training steps route with weights that moved since)
            self.replay.counts.zero_()
        self._recording = {} if own_routes else None  # R2: the old policy's experts, replayed in training
        staged = self._stage_ref() if self.use_ref else None  # overlaps the actor's pass below
        old = self._forward_all(samples, steps, length, partial(self._log_probs, entropy=bool(dump)))
        tables, self._recording = self._recording, None
        route_metrics = self.replay.mismatch(self.hf_config.num_hidden_layers) \
            if self.replay and not own_routes else {}  # all ranks
        entropy = {i: t[1] for i, t in old.items()} if dump else None
        old = B.SampleTensors((i, t[0]) for i, t in old.items()) if dump else old
        own = self._own_routing_log_probs(samples, steps, length) if a.get_mismatch_metrics else None
        ref = self._with_ref_weights(lambda: self._forward_all(samples, steps, length, self._log_probs), staged) \
            if self.use_ref else None
        del staged
        log_probs_time = time.monotonic() - t0
        self._route_tables = tables
        if not self.last_stage:
            self._train_steps(samples, None)
            self._route_tables = None
            return None, None
        old, ref = self._gather(old), (self._gather(ref) if ref is not None else None)
        own = self._gather(own) if own is not None else None
        n = len(samples)
        masks = B.loss_masks(samples)
        logp = [old[i] for i in range(n)]
        ref_logp = [ref[i] for i in range(n)] if ref is not None else None
        values = [values[i] for i in range(n)] if values is not None else None
        # the hook's rewards, normalised by it; or a rollout of split trajectories, normalised by the manager
        post_processed = bool(a.custom_reward_post_process_path) or B.has_post_processed_rewards(samples)
        rewards = B.post_processed_rewards(samples) if post_processed else B.scalar_rewards(samples, a.reward_key)
        rollout_lp = B.rollout_log_probs(samples)
        hooks = self._train_hooks()
        if hooks.advantage is not None:  # --custom-advantage-function-path: slime's hook in place of the estimator
            advantages, returns = train_hooks.advantages_by_hook(hooks, samples, rewards, post_processed, logp,
                                                                 ref_logp, values, rollout_lp, masks)
        else:
            advantages, returns = rl_math.compute_advantages_and_returns(
                a.advantage_estimator, rewards, logp, ref_logp,
                values, masks,
                group_size=a.n_samples_per_prompt, kl_coef=a.kl_coef, kl_type=a.kl_loss_type, gamma=a.gamma,
                lambd=a.lambd, std_normalization=not a.disable_grpo_std_normalization,
                normalize_advantages=a.normalize_advantages, rewards_normalized=post_processed,
            )
        if dump and self.ps.get_tensor_model_parallel_rank() == 0:  # this rank's samples, before the update

            save_train_dump(dump, rollout_id, self.rank, samples, list(entropy), {
                "log_probs": logp, "ref_log_probs": ref_logp, "rollout_log_probs": rollout_lp,
                "advantages": advantages, "returns": returns, "loss_masks": masks, "entropy": entropy,
                "values": values})
        loss_cfg = LossConfig.from_args(a)
        traj = B.trajectory_denominators(samples, masks)  # a split trajectory: one token mean over its samples

        def loss_fn(mb: B.MicroBatch, output: torch.Tensor, normalizer: float, non_loss_data: bool = False) -> tuple:
            temp = rl_math.scoring_temperature(a.rollout_temperature)
            custom = hooks.loss is not None  # --loss-type custom_loss: slime's hook is the whole loss
            lp, ent = sample_log_probs(output, mb, temp, self.gpt().hf_vocab_size,
                                       with_entropy=custom or a.entropy_coef > 0)
            idx, dev = mb.indices, output.device
            den = [traj[i] for i in idx] if traj is not None else None
            def on(xs: list) -> list[torch.Tensor]:  # per-sample inputs of this micro-batch: one host->device copy
                return B.samples_to_device(xs, idx, dev)

            if custom:
                batch = train_hooks.loss_batch(samples, idx, dev, on, lp, ent, {
                    "loss_masks": masks, "log_probs": old, "ref_log_probs": ref, "rollout_log_probs": rollout_lp,
                    "advantages": advantages, "returns": returns, "values": values})
                loss, m = train_hooks.custom_loss(hooks, batch, output, batch["loss_masks"], normalizer, den)
                return loss * self._num_mb, m
            loss, m = rl_loss(
                lp, on(old), on(ref) if ref is not None else None,
                on(rollout_lp) if rollout_lp is not None else None, on(advantages),
                on(masks), ent, loss_cfg, normalizer, train_hooks.pg_reducer(hooks, mb.prompt_lengths,
                                                                             mb.response_lengths), den,
            )
            return loss * self._num_mb, m

        try:
            result = self._train_steps(samples, loss_fn)
        finally:
            self._route_tables = None
        if own_routes:  # all ranks: the share the updated weights would have routed elsewhere in the steps
            route_metrics = self.replay.mismatch(self.hf_config.num_hidden_layers, "train/routing_replay_mismatch")
        if not self.reporter:
            return None, None
        metrics = result.metrics
        metrics["perf/log_probs_time"] = log_probs_time
        metrics.update(route_metrics)
        metrics.update(self._rollout_stats(samples, logp, ref_logp, rollout_lp,
                                           advantages, masks, values))
        if a.get_mismatch_metrics:
            metrics.update(self._mismatch(rollout_id, samples, logp, rollout_lp,
                                          B.newest_weight_masks(samples, masks)))  # as the log-prob check
        if own is not None:  # the same batch with the trainer's own routing: what replay changed
            newest = B.newest_weight_masks(samples, masks)
            own_lp = [own[i] for i in range(n)]
            metrics["train/replay_logprob_abs_diff"] = _masked_mean_abs(logp, own_lp, newest)
            if rollout_lp is not None:
                metrics["train/train_rollout_logprob_abs_diff_without_replay"] = _masked_mean_abs(own_lp, rollout_lp,
                                                                                                  newest)
        details = {"log_probs": logp, "ref_log_probs": ref_logp, "advantages": advantages, "returns": returns,
                   "values": values}
        if a.dump_details:
            self._dump_train_details(rollout_id, samples, details, rollout_lp)
        # this call inside the actor: the driver's perf/train_time less this is Ray's share (samples in, results out)
        metrics["perf/actor_train_time"] = time.monotonic() - t0
        return result, B.SampleTensors(enumerate(returns))

    def _train_hooks(self) -> train_hooks.TrainHooks:
        """slime's trainer-side hooks the flags name, loaded (and their signatures checked) at the first rollout."""
        if getattr(self, "_hooks", None) is None:
            self._hooks = train_hooks.TrainHooks.load(self.args)
        return self._hooks

    def _own_routing_log_probs(self, samples: list, steps: list, length: int) -> B.SampleTensors | None:
        """With --use-rollout-routing-replay and --get-mismatch-metrics: the old policy's log-probs again, every
        router choosing its own experts (one more forward pass); None otherwise."""
        if self.replay is None or not self.args.use_rollout_routing_replay:
            return None
        self._free_routing = True
        try:
            return self._forward_all(samples, steps, length, self._log_probs)
        finally:
            self._free_routing = False

    def _mismatch(self, rollout_id: int, samples: list, logp: list, rollout_lp: Any, masks: list) -> dict[str, Any]:
        """--get-mismatch-metrics: mismatch/* scalars and mismatch/worst_tokens (token text decoded here, where the
        checkpoint's tokenizer loads); with --dump-details also DIR/mismatch/<rollout_id>.jsonl, a token a line."""


        a = self.args
        if rollout_lp is None:  # (the doctor asks for them whatever the run's generate hook records)
            if not getattr(self, "_told_no_rollout_lp", False):
                log.warning("--get-mismatch-metrics: a sample has no rollout log-probs (a generate hook that records "
                            "none, or a dump made without them): no mismatch/* metrics")
                self._told_no_rollout_lp = True
            return {}
        if getattr(self, "_tokenizer", None) is None:
            self._tokenizer = load_tokenizer(a.hf_checkpoint)
        out, worst = mismatch_report(samples, logp, rollout_lp, masks, a.mismatch_ratio_bound, a.mismatch_top_k,
                                     self._tokenizer.decode)
        if worst:
            w = worst[0]
            log.info("mismatch: rollout %d, worst token %r (sample %s, position %d): train %.4g, rollout %.4g",
                     rollout_id, w["token"], w["sample"], w["position"], w["train_log_prob"], w["rollout_log_prob"])
        if a.dump_details:
            atomic_write_text("".join(json.dumps({"rollout_id": rollout_id, **w}) + "\n" for w in worst),
                              os.path.join(a.dump_details, "mismatch", f"{rollout_id}.jsonl"))
        return {**out, "mismatch/worst_tokens": worst}

    def _rollout_stats(self, samples, logp, ref_logp, rollout_lp, advantages, masks, values) -> dict[str, float]:
        """Every statistic over loss-mask tokens only: inserted (tool, environment) tokens are not the model's."""
        def mean(xs: list) -> float:
            return float(torch.stack([rl_math.masked_mean(x.float(), m) for x, m in zip(xs, masks)]).mean())

        out = {"rollout/log_probs": mean(logp), "rollout/advantages": mean(advantages)}
        if ref_logp is not None:
            out["rollout/ref_log_probs"] = mean(ref_logp)
            out["rollout/kl"] = mean([rl_math.compute_kl(x, r, self.args.kl_loss_type) for x, r in zip(logp, ref_logp)])
            out["rollout/log_probs_ref_max_abs_diff"] = masked_max([(x - r).abs() for x, r in zip(logp, ref_logp)],
                                                                   masks)
        if rollout_lp is not None:
            out["rollout/rollout_log_probs"] = mean(rollout_lp)
            # over the tokens of the newest weights: a continued sample's older tokens (--partial-rollout) are
            # off-policy, and would read as a weight or precision fault
            newest = B.newest_weight_masks(samples, masks)
            diffs = [(x - r).abs() for x, r in zip(logp, rollout_lp)]
            fresh = [(d, m) for d, m in zip(diffs, newest) if m.sum() > 0]
            out["train/train_rollout_logprob_abs_diff"] = (
                float(torch.stack([rl_math.masked_mean(d.float(), m) for d, m in fresh]).mean()) if fresh else 0.0)
            out["train/train_rollout_logprob_abs_diff_max"] = masked_max(diffs, newest)
        if values is not None:
            out["rollout/values"] = mean(values)
        return out

    def _dump_train_details(self, rollout_id: int, samples: list, details: dict, rollout_lp: Any) -> None:
        kl = ([rl_math.compute_kl(x, r, self.args.kl_loss_type) for x, r in zip(details["log_probs"],
                                                                               details["ref_log_probs"])]
              if details["ref_log_probs"] is not None else None)
        payload = {"rollout_id": rollout_id, "rollout_log_probs": rollout_lp, "kl": kl, **details}
        payload = {k: ([t.tolist() for t in v] if isinstance(v, list) else v) for k, v in payload.items()}
        atomic_torch_save(payload, os.path.join(self.args.dump_details, "train_data", f"{rollout_id}.pt"))

    # ----------------------------------------------------------------- weights out
    def hf_weights(self, for_push: bool = False, on_device: bool = False,
                   views: bool = False) -> dict[str, torch.Tensor] | None:
        """Full HF-named tensors of the whole model on global rank 0 (None elsewhere); TP gathered, PP collected.
        CPU copies, or with ``on_device`` copies on the trainer's device (``_push_on_device``; PP=1 only).
        ``views`` (PP=1): where a tensor is a parameter or a view of one on the target device, that view, no copy
        (for a caller that is done with them before the model changes)."""


        ps = self.ps
        # one copy of each tensor: a view of a parameter is copied (unless ``views``), a tensor the merge made (q, k,
        # v; TP>1 gathers) only moved to the host where it is not already there
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()} if not views else set()
        device = None if on_device else "cpu"
        mine = {name: t.detach().to(device or t.device, copy=t.untyped_storage().data_ptr() in params)
                for name, t in iter_hf_weights(self.model, self.hf_config)}
        if for_push:
            mine = sent_stage_weights(self.args.debug_inject_fault, mine, ps.get_pipeline_model_parallel_rank())
        return self._whole_model(mine)

    def _whole_model(self, mine: dict[str, Any]) -> dict[str, Any] | None:
        """Every PP stage's ``mine`` (HF-named, the same on each TP rank) joined on global rank 0; None elsewhere."""
        ps = self.ps
        if ps.get_pipeline_model_parallel_world_size() > 1:
            parts: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(parts, mine if ps.get_tensor_model_parallel_rank() == 0 else {},
                                   group=ps.get_pipeline_model_parallel_group())
            mine = {k: v for p in parts for k, v in p.items()}
        return mine if self.rank == 0 else None

    def hf_lora(self, for_push: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """{HF weight name: (lora_A, lora_B unscaled)} of every adapter, host copies, on global rank 0 (None
        elsewhere); collective over the whole group (TP gathered, PP collected)."""
        mine = {n: (a.to("cpu", copy=True), b.to("cpu", copy=True))
                for n, (a, b) in lora.hf_adapters(self.model, self.hf_config).items()}
        if for_push:
            mine = sent_stage_weights(self.args.debug_inject_fault, mine, self.ps.get_pipeline_model_parallel_rank())
        return self._whole_model(mine)

    def _effective(self, base: dict[str, torch.Tensor], adapters: dict) -> dict[str, torch.Tensor]:
        """The weights an engine serves after an adapter push onto ``base`` (lora_wire.merged, the engine's formula)."""
        s = self.lora.scaling
        return {n: merged(t, adapters[n][0], adapters[n][1].float() * s) if n in adapters else t
                for n, t in base.items()}

    def _push_lora(self, urls: list[str], version: int, check: bool) -> dict[str, float] | None:
        """An adapter-only push: each adapted weight's lora_A and scaled lora_B (``lora_wire``), which the engines
        merge into their base weights. The disk transport writes whole folders: it gets the merged weights. The
        weight check compares the engines against the merged weights of the trainer's base. Real SGLang gets the
        adapters as a PEFT folder it loads by name (``weight_push.push_lora_to_sglang``)."""
        a = self.args
        t0 = time.perf_counter()
        adapters = self.hf_lora()
        sent = self.hf_lora(for_push=True) if breaks_sent_weights(a.debug_inject_fault) else adapters
        disk = a.update_weight_transport == "disk"
        # the trainer's base weights: on its GPU where it has one (PP=1), so the merge runs there; views of the
        # parameters except for a disk folder (safetensors refuses tensors sharing memory, as q/k/v views do)
        on_device = torch.cuda.is_available() and self.ps.get_pipeline_model_parallel_world_size() == 1
        if a.rollout_backend == "sglang":  # SGLang applies the adapters itself: a PEFT folder, loaded by name
            base = self.hf_weights(on_device=on_device, views=on_device) if check or a.check_weight_update_equal \
                else None
            if self.rank != 0:
                return None
            return {"perf/update_weights/gather_time": time.perf_counter() - t0,
                    "perf/update_weights/bytes": float(sum(x.numel() * x.element_size() for ab in sent.values()
                                                           for x in ab)),
                    # check is asked for an engine restarted by --use-fault-tolerance only (push_checked)
                    **push_lora_to_sglang(a, sent, self.lora, urls, version, adapters, base, restarted=check)}
        base = self.hf_weights(on_device=on_device, views=on_device and not disk) if disk or check or \
            a.check_weight_update_equal else None
        if self.rank != 0:
            return None
        wire = {}
        for n, (lora_a, lora_b) in sent.items():
            name_a, name_b = adapter_names(n)
            wire[name_a], wire[name_b] = lora_a, lora_b.float() * self.lora.scaling
        reference = self._effective(base, adapters) if base is not None else None
        named = self._effective(base, sent) if disk else wire
        return {"perf/update_weights/gather_time": time.perf_counter() - t0,
                "perf/update_weights/bytes": float(sum(t.numel() * t.element_size() for t in named.values())),
                **push(a, named, urls, version, reference=reference, check=check)}

    def _push_on_device(self) -> bool:
        """Whether a push's HF copies stay on the trainer's GPU (PP=1 only): a colocated tensor push (CUDA IPC
        handles of them), or a broadcast to engines on other GPUs (NCCL sends from the GPU: host copies would cost a
        round trip through pageable memory) when the copy fits in half the free GPU memory (else host copies)."""
        a = self.args
        if not torch.cuda.is_available() or self.ps.get_pipeline_model_parallel_world_size() != 1:
            return False
        if a.update_weight_transport == "tensor":
            return bool(a.colocate)
        if a.update_weight_transport != "distributed" or a.colocate:  # colocated engines receive by gloo (host)
            return False
        full = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return full * self.ps.get_tensor_model_parallel_world_size() < torch.cuda.mem_get_info()[0] // 2

    def push_weights(self, urls: list[str], version: int, check: bool = False) -> dict[str, float] | None:
        """Push to ``urls`` (rank 0 sends); rank 0 returns the push's parts in seconds: the HF gather
        (``perf/update_weights/gather_time``), the transport and the check (``weight_push.push``)."""

        a = self.args
        # offloaded (--offload-train) while an engine restarted by --use-fault-tolerance needs the weights: the
        # weights come back for the push and leave again after it
        offloaded = getattr(self, "_stash", None) is not None and self._stash.offloaded
        if offloaded:
            self.onload()
        try:
            if self.lora is not None:
                return self._push_lora(urls, version, check)
            t0 = time.perf_counter()
            on_device = self._push_on_device()  # after an onload: the free memory it leaves
            # the tensor and distributed transports copy into their buckets and are done before this call returns:
            # views of the parameters are enough (PP=1: nothing is pickled). A folder for the disk push must not
            # hold two tensors sharing memory (safetensors refuses them)
            views = a.update_weight_transport != "disk" and self.ps.get_pipeline_model_parallel_world_size() == 1
            named = self.hf_weights(on_device=on_device, views=views)
            sent = (self.hf_weights(for_push=True, on_device=on_device, views=views)
                    if breaks_sent_weights(a.debug_inject_fault) else named)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the copies' kernels, so that the gather's time is theirs
            gather = time.perf_counter() - t0
            if self.rank != 0:
                return None
            return {"perf/update_weights/gather_time": gather,
                    "perf/update_weights/bytes": float(sum(t.numel() * t.element_size() for t in sent.values())),
                    **push(self.args, sent, urls, version, reference=named, check=check)}
        finally:
            if offloaded:
                named = sent = None
                self.offload()


def masked_max(xs: list, masks: list) -> float:
    """The largest value over the loss-mask tokens of every sample (0 when none)."""
    kept = [x.detach()[m.to(torch.bool)] for x, m in zip(xs, masks)]
    return max((float(k.max()) for k in kept if k.numel()), default=0.0)
