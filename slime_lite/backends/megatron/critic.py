"""The PPO critic: the policy's Megatron model with a value head; its values feed the actor's advantages (GAE), and
it trains toward the returns that step produced."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from slime_lite.backends.megatron import batch as B
from slime_lite.backends.megatron.loss import response_slices, value_rl_loss
from slime_lite.backends.megatron.worker import TrainWorker, reported
from slime_lite.types import TrainResult


class ValueHead(torch.nn.Module):
    """The critic's output layer: hidden -> one value, replicated on every TP rank (inputs are identical there;
    under --sequence-parallel each rank holds a slice of the sequence, gathered first as Megatron's output layer
    does)."""

    def __init__(self, hidden: int, dtype: torch.dtype, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> tuple:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(x, self.weight), None


class CriticActor(TrainWorker):
    role = "critic"
    metric_prefix = "train/critic-"  # slime's names for the critic's metrics (train/critic-value_loss, ...)

    def _lr(self) -> float:
        return self.args.critic_lr

    def _adapt_model(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        if ps.is_pipeline_last_stage():
            model.output_layer = ValueHead(self.hf_config.hidden_size, dtype, model.config.sequence_parallel)
        # the value head replaces the (tied) output layer: nothing is tied any more, on any stage. Under PP a first
        # stage still marked as tied would all-reduce its embedding gradient with the last stage, which no longer
        # takes part (a hang in the first step of a tied model such as Qwen2.5-0.5B)
        model.share_embeddings_and_output_weights = False

    def _values(self, mb: B.MicroBatch, output: torch.Tensor) -> list[torch.Tensor]:
        """Response-token values of each sample of a micro-batch (the value at a position predicts what follows)."""
        per_pos = output[..., :-1, 0].float()
        return response_slices(per_pos[0] if mb.packed else per_pos, mb.prompt_lengths, mb.response_lengths,
                               packed=mb.packed)

    def compute_values(self, samples: list) -> dict[int, torch.Tensor] | None:
        values = self._forward_all(samples, self._plan(samples, log_probs=True), B.padded_length(samples),
                                   self._values)
        values = self._gather(values) if self.last_stage else values
        return values if self.reporter else None

    def train(self, rollout_id: int, samples: list, old_values: list, returns: list) -> TrainResult | None:
        """``--num-steps-per-rollout`` value steps toward the returns (clipped around the values of this rollout);
        ``old_values`` and ``returns`` are the refs of the ranks' ``compute_values`` and of the actor's train."""
        old_values, returns = reported(old_values), reported(returns)
        masks = B.loss_masks(samples)
        traj = B.trajectory_denominators(samples, masks)  # a split trajectory: one token mean over its samples

        def loss_fn(mb: B.MicroBatch, output: torch.Tensor, normalizer: float, non_loss_data: bool = False) -> tuple:
            vals, dev = self._values(mb, output), output.device
            idx = mb.indices
            loss, m = value_rl_loss(vals, B.samples_to_device(old_values, idx, dev),
                                    B.samples_to_device(returns, idx, dev), B.samples_to_device(masks, idx, dev),
                                    self.args.value_clip, normalizer,
                                    [traj[i] for i in idx] if traj is not None else None)
            return loss * self._num_mb, m

        result = self._train_steps(samples, loss_fn)
        return result if self.reporter else None
