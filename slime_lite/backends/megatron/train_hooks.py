"""slime's trainer-side hooks, called by the actor where slime calls them, with slime's signatures:

- ``--custom-advantage-function-path``: ``fn(args, rollout_data) -> None`` sets ``rollout_data["advantages"]`` and
  ``rollout_data["returns"]`` (per sample, per response token) in place of the advantage estimator's, after the
  per-token KL is computed; --normalize-advantages still whitens them afterwards (as slime does).
- ``--custom-loss-function-path`` (with ``--loss-type custom_loss``): ``fn(args, batch, logits, sum_of_sample_mean)
  -> (loss, metrics)`` is a micro-batch's whole policy loss (no PPO loss, KL loss or entropy term is added).
- ``--custom-pg-loss-reducer-function-path``: ``fn(total_lengths, response_lengths, loss_masks,
  calculate_per_token_loss) -> reducer``, called per micro-batch; ``reducer(per_token_pg_loss) -> scalar`` replaces
  the default reduction of the policy-gradient term only.

Mapping of slime's objects: ``args`` is the run's flags, read-only (every hook's ``args``). ``rollout_data`` holds
the whole rollout (slime: one data-parallel rank's share), lists per sample under slime's keys. ``batch`` holds the
micro-batch's samples the same way. ``logits`` is slime-lite's model output of the micro-batch ([rows, tokens,
vocabulary slice]: padded rows, or one packed row with --use-dynamic-batch-size; each tensor-parallel rank has its
slice of the vocabulary); since slime's helpers that turn it into log-probs are not here, ``batch["cur_log_probs"]``
and ``batch["entropy"]`` give the current policy's response-token log-probs (differentiable) and entropies. A
``sum_of_sample_mean`` or reducer value is a sum over the micro-batch's samples (of masked token means, or of token
values with --calculate-per-token-loss), as in slime; slime-lite divides it by the step's normalizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from slime_lite import rl_math
from slime_lite.errors import SlimeLiteError
from slime_lite.hooks import TRAIN_HOOKS, HookArgs, load_hook

ADVANTAGE, LOSS, PG_REDUCER = TRAIN_HOOKS


@dataclass(frozen=True)
class TrainHooks:
    advantage: Callable[..., Any] | None
    loss: Callable[..., Any] | None  # only with --loss-type custom_loss
    pg_reducer: Callable[..., Any] | None
    args: Any

    @classmethod
    def load(cls, args: Any) -> TrainHooks:
        def hook(flag: str) -> Callable[..., Any] | None:
            path = getattr(args, flag[2:].replace("-", "_"))
            return load_hook(path, flag) if path else None

        custom = args.loss_type == rl_math.CUSTOM_LOSS
        return cls(hook(ADVANTAGE), hook(LOSS) if custom else None, hook(PG_REDUCER), HookArgs(args))


def slime_rewards(args: Any, rewards: list[float], post_processed: bool) -> list[float]:
    """The per-sample rewards slime's trainer gets: a post-process hook's as they are; otherwise GRPO's rewards
    normalised in their groups (minus the mean, over the std unless --disable-grpo-std-normalization) and
    REINFORCE++-baseline's centred, as slime's rollout manager does; the raw rewards for the other estimators."""
    name = args.advantage_estimator
    if post_processed or name not in ("grpo", "reinforce_plus_plus_baseline"):
        return [float(r) for r in rewards]
    std = name == "grpo" and not args.disable_grpo_std_normalization
    return rl_math.grpo_advantages(torch.tensor(rewards, dtype=torch.float32), args.n_samples_per_prompt,
                                   std).tolist()


def advantages_by_hook(hooks: TrainHooks, samples: list, rewards: list[float], post_processed: bool,
                       log_probs: list, ref_log_probs: list | None, values: list | None, rollout_log_probs: list | None,
                       masks: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """--custom-advantage-function-path on a rollout -> (advantages, returns), one tensor per sample, checked."""
    a = hooks.args
    if ref_log_probs is None or a.kl_coef == 0.0:
        kl = [torch.zeros_like(lp) for lp in log_probs]
    else:
        kl = [rl_math.compute_kl(lp, r, a.kl_loss_type) for lp, r in zip(log_probs, ref_log_probs)]
    data: dict[str, Any] = {
        "tokens": [torch.tensor(s.tokens, dtype=torch.long) for s in samples],
        "total_lengths": [len(s.tokens) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "sample_indices": [s.index for s in samples],
        "loss_masks": list(masks), "rewards": slime_rewards(a, rewards, post_processed),
        "log_probs": list(log_probs), "kl": kl}
    if not post_processed:
        data["raw_reward"] = [float(r) for r in rewards]
    for key, xs in (("ref_log_probs", ref_log_probs), ("values", values), ("rollout_log_probs", rollout_log_probs)):
        if xs is not None:
            data[key] = list(xs)
    hooks.advantage(a, data)
    advantages, returns = (_per_token(data, key, log_probs) for key in ("advantages", "returns"))
    if a.normalize_advantages:
        advantages = rl_math.whiten(advantages, masks)
    return advantages, returns


def _per_token(data: dict, key: str, like: list) -> list[torch.Tensor]:
    xs = data.get(key)
    what = f"{ADVANTAGE}: rollout_data[{key!r}] must be a list of {len(like)} tensors, one per sample of the rollout"
    if xs is None or isinstance(xs, torch.Tensor) or len(xs) != len(like):
        raise SlimeLiteError(f"{what}, each as long as its response; the hook left {_shown(xs)}.")
    out = []
    for i, (x, ref) in enumerate(zip(xs, like)):
        t = torch.as_tensor(x).detach().to(device=ref.device, dtype=ref.dtype).reshape(-1)
        if t.numel() != ref.numel():
            raise SlimeLiteError(f"{what}: sample {i} has {t.numel()} values for a response of {ref.numel()} tokens.")
        out.append(t)
    return out


def _shown(x: Any) -> str:
    return "nothing" if x is None else f"a {type(x).__name__}" + (f" of {len(x)}" if hasattr(x, "__len__") else "")


def sum_of_sample_mean(masks: list[torch.Tensor], per_token: bool,
                       denominators: list[float] | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """slime's reducer of a micro-batch: a flat per-token tensor -> the sum over its samples of their masked token
    means (``per_token``: of their masked token values; ``denominators``: a split trajectory's samples make one
    mean, as `rl_math.aggregate_loss`)."""
    norm = rl_math.PerTokenNormalizer(1.0) if per_token else 1.0
    return lambda x: rl_math.aggregate_loss(x, masks, norm, denominators)


def pg_reducer(hooks: TrainHooks, prompt_lengths: list[int], response_lengths: list[int]) -> Callable | None:
    """For the policy loss: loss masks -> the --custom-pg-loss-reducer-function-path reducer of the micro-batch."""
    if hooks.pg_reducer is None:
        return None
    totals = [p + r for p, r in zip(prompt_lengths, response_lengths)]

    def make(masks: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        reducer = hooks.pg_reducer(totals, list(response_lengths), masks, bool(hooks.args.calculate_per_token_loss))
        if not callable(reducer):
            raise SlimeLiteError(f"{PG_REDUCER}: the hook returned {_shown(reducer)}; expected a function "
                                 "reducer(pg_loss) -> scalar tensor.")
        return reducer

    return make


def loss_batch(samples: list, indices: list[int], device: Any, on: Callable[[Any], list[torch.Tensor]],
               cur_log_probs: list[torch.Tensor], entropy: list[torch.Tensor] | None,
               per_sample: dict[str, Any]) -> dict[str, Any]:
    """The ``batch`` of --custom-loss-function-path: the micro-batch's samples (``indices`` into the rollout) as
    lists under slime's keys (``unconcat_tokens``: each sample's tokens; ``per_sample``'s given entries, each
    brought to the device by ``on``), plus ``cur_log_probs`` and ``entropy`` of the current policy."""
    chosen = [samples[i] for i in indices]
    batch: dict[str, Any] = {
        "unconcat_tokens": [torch.tensor(s.tokens, dtype=torch.long, device=device) for s in chosen],
        "total_lengths": [len(s.tokens) for s in chosen], "response_lengths": [s.response_length for s in chosen]}
    batch.update({key: on(xs) for key, xs in per_sample.items() if xs is not None})
    batch["cur_log_probs"], batch["entropy"] = cur_log_probs, entropy
    return batch


def custom_loss(hooks: TrainHooks, batch: dict, logits: torch.Tensor, masks: list[torch.Tensor],
                normalizer: float | None, denominators: list[float] | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """--custom-loss-function-path on a micro-batch -> (its loss, metrics), both divided by the step's normalizer
    (a metric the hook leaves out: ``loss``)."""
    reducer = sum_of_sample_mean(masks, bool(hooks.args.calculate_per_token_loss), denominators)
    out = hooks.loss(hooks.args, batch, logits, reducer)
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and torch.is_tensor(out[0]) and out[0].numel() == 1
            and isinstance(out[1], dict)):
        raise SlimeLiteError(f"{LOSS}: the hook returned {_shown(out)}; expected (loss, metrics): a one-element "
                             "loss tensor and a dict of scalar metrics.")
    d = rl_math.loss_divisor(normalizer, len(masks))
    loss = out[0].reshape(()) / d
    metrics = {str(k): torch.as_tensor(v).detach().to(loss.device, torch.float64).reshape(()) / d
               for k, v in out[1].items()}
    metrics.setdefault("loss", loss.detach().double())
    return loss, metrics
