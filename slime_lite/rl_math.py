"""RL maths for slime_lite: pure torch functions, nothing of the project imported.

Conventions for the whole module
- A batch of samples is a list of 1-D tensors, one per sample, each of length = that sample's response length
  (ragged). The loss mask travels alongside as a list of the same shapes (1 = trained token, 0 = not trained, e.g.
  a tool output in a multi-turn response). Element-wise functions (KL, policy/value loss) take tensors of any
  shape, so a flat concatenation of the list works as well.
- Values at mask-0 positions are computed like any other and carry no meaning: every consumer (loss aggregation,
  whitening statistics, metrics) masks them. The KL penalty that enters token rewards (PPO, REINFORCE++,
  REINFORCE++-baseline) is multiplied by the mask everywhere: a token the policy did not sample is not penalised.
- Arithmetic is in the input dtype; inputs are never modified in place. KL, policy loss and value loss are
  differentiable; advantage estimators need not be (their inputs carry no grad in practice).
- Loss aggregation: per-sample token means (masked), averaged over samples (`aggregate_loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
else:
    class _Torch:
        """torch, imported on the first attribute read: the flag parser reads the registries below, and
        ``slime-lite train --help`` and flag errors must not wait for torch to load."""

        def __getattr__(self, name: str) -> Any:
            import torch as loaded

            globals()["torch"] = loaded
            return getattr(loaded, name)

    torch = _Torch()

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
CUSTOM_LOSS = "custom_loss"  # the --loss-type whose loss is --custom-loss-function-path's (slime's name)

Tensors = Sequence["torch.Tensor"]


# ---------------------------------------------------------------- registries (advantage estimators, policy losses)
@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator gets, per sample: scalar ``rewards`` [N] (groups of ``group_size`` adjacent), the
    old-policy ``log_probs``, the critic's ``values`` (None without a critic), the ``loss_masks`` and the per-token
    ``kl`` to the reference (zeros without one or with ``kl_coef`` 0). ``normalized``: the rewards come normalised
    already (a reward post-process hook did it), so a group estimator takes them as they are."""

    rewards: torch.Tensor
    log_probs: Tensors
    values: Tensors | None
    loss_masks: Tensors
    kl: list[torch.Tensor]
    group_size: int
    kl_coef: float
    gamma: float
    lambd: float
    std_normalization: bool
    normalized: bool = False


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator: ``fn(AdvantageInputs) -> (advantages, returns)``, per sample. ``needs_critic``:
    it takes the critic's values (a critic group is placed and trained). ``needs_groups``: it compares the samples
    of one prompt (--n-samples-per-prompt 1 gives zero advantages). ``kl_in_reward``: --kl-coef enters its token
    rewards (otherwise the KL goes into the loss: --use-kl-loss). ``whitened``: its advantages are always whitened
    (--normalize-advantages adds nothing). ``group_std``: its group normalisation also divides by the group's std
    (unless --disable-grpo-std-normalization); else it only centres. ``reads``: which of ``ESTIMATOR_FLAGS`` it
    reads besides the critic's (those with ``needs_critic``)."""

    name: str
    fn: Callable[[AdvantageInputs], tuple[list[torch.Tensor], list[torch.Tensor]]]
    needs_critic: bool = False
    needs_groups: bool = False
    group_std: bool = False
    kl_in_reward: bool = True
    whitened: bool = False
    reads: tuple[str, ...] = ()


# the flags only some estimators read: the discount and GAE's lambda, and the critic's (read with ``needs_critic``)
ESTIMATOR_FLAGS = ("--gamma", "--lambd")
CRITIC_FLAGS = ("--value-clip", "--critic-lr", "--critic-num-nodes", "--critic-num-gpus-per-node")


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss (``--loss-type``): ``fn(logp, old, advantages, mask, eps_clip, eps_clip_high,
    eps_clip_c) -> (loss, clipfrac, ppo_kl)``, per token."""

    name: str
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


ESTIMATORS: dict[str, Estimator] = {}
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_estimator(name: str, **properties: Any) -> Callable:
    """Decorator: register ``fn(AdvantageInputs)`` as ``--advantage-estimator name`` with ``Estimator``'s
    properties. The flag's choices, the placement's critic and the group-size rule read the registry; an estimator
    that reads ``x.gamma`` or ``x.lambd`` says so with ``reads=("--gamma", "--lambd")`` (else giving those flags is
    warned about as changing nothing)."""

    def register(fn: Callable) -> Callable:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ESTIMATORS[name] = Estimator(name, fn, **properties)
        return fn

    return register


def register_policy_loss(name: str) -> Callable:
    """Decorator: register a per-token policy loss as ``--loss-type name``."""

    def register(fn: Callable) -> Callable:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = PolicyLoss(name, fn)
        return fn

    return register


def estimator(name: str) -> Estimator:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; expected one of {tuple(ESTIMATORS)}")
    return ESTIMATORS[name]


def compute_kl(logp: torch.Tensor, ref: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate with d = logp - ref: k1 = d, k2 = d^2/2, k3 = exp(-d) - 1 + d, low_var_kl = k3 in [-10, 10]."""
    d = logp - ref
    if kl_type == "k1":
        return d
    if kl_type == "k2":
        return d * d / 2
    if kl_type in ("k3", "low_var_kl"):
        k3 = torch.exp(-d) - 1 + d
        return k3.clamp(-10.0, 10.0) if kl_type == "low_var_kl" else k3
    raise ValueError(f"unknown kl type {kl_type!r}; expected one of {KL_TYPES}")


@register_policy_loss("policy_loss")
def policy_loss(
    logp: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token -> (loss, clipfrac, ppo_kl), each shaped like `logp`.

    loss = max(-A*r, -A*clamp(r, 1-eps_clip, 1+eps_clip_high)) with r = exp(logp - old); with `eps_clip_c` (> 1)
    tokens with A < 0 are further capped at -eps_clip_c*A (dual clip). clipfrac is 1.0 where the clipped term was
    strictly larger (chosen), else 0.0 (the dual-clip cap is not counted, as in slime). ppo_kl = old - logp.
    Outputs are zero where `mask` is 0 (mask None = all tokens).
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    ratio = torch.exp(logp - old)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).to(logp.dtype)
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"eps_clip_c must be > 1 for dual-clip PPO, got {eps_clip_c}")
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    ppo_kl = old - logp
    if mask is not None:
        keep = mask.bool()
        loss, clipfrac, ppo_kl = (torch.where(keep, t, torch.zeros_like(t)) for t in (loss, clipfrac, ppo_kl))
    return loss, clipfrac, ppo_kl


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss per token -> (loss, clipfrac).

    loss = max((V - G)^2, (V_clip - G)^2), V_clip = V_old + clamp(V - V_old, -value_clip, value_clip).
    No 0.5 factor (as slime's value loss). clipfrac is 1.0 where the value moved more than ``value_clip`` from
    V_old (slime's definition: clipped, whichever term was larger).
    """
    moved = values - old_values
    v_clip = old_values + moved.clamp(-value_clip, value_clip)
    loss = torch.maximum((values - returns) ** 2, (v_clip - returns) ** 2)
    return loss, (moved.abs() > value_clip).to(values.dtype)


GREEDY_EPS = 1e-6  # a temperature below it samples greedily (the embedded engine's rule, as SGLang's)


def scoring_temperature(rollout_temperature: float) -> float:
    """The temperature the trainer divides logits by to score a rollout: the rollout's own; 1 for a greedy rollout
    (temperature below ``GREEDY_EPS``), whose engine log-probs are those of the unscaled logits."""
    return rollout_temperature if rollout_temperature >= GREEDY_EPS else 1.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x*m)/sum(m); 0 when the mask is empty (as if the denominator were clamped to 1)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


class PerTokenNormalizer(float):
    """A normalizer under which `aggregate_loss` divides the sum over all masked tokens (not the per-sample token
    means) by it: --calculate-per-token-loss, with the step's token count as the normalizer. It may be below 1 (the
    count per data-parallel rank of a step with fewer loss tokens than ranks) and is used as it is; 0 (no loss
    token: every sum is 0) divides by 1."""


def aggregate_loss(
    per_token: Tensors | torch.Tensor, masks: Tensors, normalizer: float | None = None,
    denominators: Sequence[float] | None = None,
) -> torch.Tensor:
    """Per-sample masked token means, summed and divided by `normalizer` (default: the number of samples here).

    `per_token` is a list like `masks` or their flat concatenation. With `normalizer` = the number of samples of a
    global batch, the values of its micro-batches add up to the global per-sample mean. `denominators` (per sample,
    in place of its own mask count): a trajectory split into several samples is one mean over all its tokens, each
    part's masked sum divided by the trajectory's token count (a per-token normalizer ignores them).
    """
    if isinstance(per_token, torch.Tensor):
        per_token = torch.split(per_token, [m.numel() for m in masks])
    if len(per_token) != len(masks):
        raise ValueError(f"{len(per_token)} per-token tensors for {len(masks)} masks")
    if len(masks) == 0:
        return torch.zeros(())
    if isinstance(normalizer, PerTokenNormalizer):
        total = torch.stack([(x * m.to(x.dtype)).sum() for x, m in zip(per_token, masks)]).sum()
        return total / loss_divisor(normalizer, len(masks))
    if denominators is not None:
        means = torch.stack([(x * m.to(x.dtype)).sum() / max(float(d), 1.0)
                             for x, m, d in zip(per_token, masks, denominators)])
    else:
        means = torch.stack([masked_mean(x, m.to(x.dtype)) for x, m in zip(per_token, masks)])
    return means.sum() / loss_divisor(normalizer, len(masks))


def loss_divisor(normalizer: float | None, num_samples: int) -> float:
    """What `aggregate_loss` divides its sum (of per-sample means, or per token of token values) by: `normalizer`
    (default: `num_samples`), at least 1 for per-sample means, and 1 for a per-token normalizer of 0."""
    n = num_samples if normalizer is None else normalizer
    if isinstance(normalizer, PerTokenNormalizer):
        return float(n) if n > 0 else 1.0
    return float(max(n, 1))


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, std_normalization: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sample GRPO advantage: reward minus its group mean, divided by (unbiased group std + eps) if asked.

    `rewards` is [N] with the `group_size` samples of one prompt adjacent. A group of one has std 0.
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.reshape(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if std_normalization:
        std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(groups[:, :1])
        centered = centered / (std + eps)
    return centered.reshape(-1)


def group_normalized(estimator_name: str, rewards: torch.Tensor, group_size: int,
                     std_normalization: bool = True) -> torch.Tensor:
    """The rewards a group estimator trains on in place of the raw ones (what it takes as given with
    ``rewards_normalized``): centred in their groups of ``group_size`` adjacent, and divided by the group's std for
    an estimator that does (GRPO, unless ``std_normalization`` is off)."""
    spec = estimator(estimator_name)
    if not spec.needs_groups:
        raise ValueError(f"advantage estimator {estimator_name!r} does not normalise groups")
    return grpo_advantages(rewards, group_size, std_normalization and spec.group_std)


def _pad(xs: Tensors) -> torch.Tensor:
    """Right-pad a ragged list of 1-D tensors with zeros into [N, T_max]."""
    return torch.nn.utils.rnn.pad_sequence(list(xs), batch_first=True)


def _unpad(x: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    return [x[i, :n] for i, n in enumerate(lengths)]


def _reverse_scan(deltas: torch.Tensor, decay: float) -> torch.Tensor:
    """out[:, t] = deltas[:, t] + decay * out[:, t+1], with out[:, T] = 0, over a padded [N, T] batch."""
    acc = deltas.new_zeros(deltas.shape[0])  # (not deltas[:, 0]: a batch of empty responses has no column)
    cols = []
    for t in range(deltas.shape[1] - 1, -1, -1):
        acc = deltas[:, t] + decay * acc
        cols.append(acc)
    return torch.stack(cols[::-1], dim=1) if cols else deltas.clone()


def gae(
    token_rewards: Tensors, values: Tensors, gamma: float, lambd: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Generalized advantage estimation per sample -> (advantages, returns), ragged lists.

    delta_t = r_t + gamma*V_{t+1} - V_t with V_T = 0 after a sample's last token; A_t = delta_t + gamma*lambd*A_{t+1};
    returns = A + V. Every response token is a step (as in slime); the loss mask is applied by the consumers.
    """
    lengths = [v.numel() for v in values]
    if [r.numel() for r in token_rewards] != lengths:
        raise ValueError("token_rewards and values must have the same per-sample lengths")
    if not lengths:
        return [], []
    r, v = _pad(token_rewards), _pad(values)
    # zero padding makes V_{T} = 0 and keeps the pad region at advantage 0
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    adv = _reverse_scan(r + gamma * next_v - v, gamma * lambd)
    advantages = _unpad(adv, lengths)
    return advantages, [a + val for a, val in zip(advantages, values)]


def _masked_kl_rewards(kl: Tensors, masks: Tensors, kl_coef: float) -> list[torch.Tensor]:
    return [-kl_coef * k * m.to(k.dtype) for k, m in zip(kl, masks)]


def reinforce_plus_plus_returns(
    rewards: torch.Tensor, kl: Tensors, masks: Tensors, kl_coef: float, gamma: float
) -> list[torch.Tensor]:
    """REINFORCE++ returns (before whitening): token reward -kl_coef*kl*m plus R on the last mask token, discounted.

    A sample with an empty mask gets no reward (it is not trained anyway).
    """
    token_rewards = []
    for R, r, m in zip(rewards, _masked_kl_rewards(kl, masks, kl_coef), masks):
        idx = torch.nonzero(m).flatten()
        if idx.numel():
            bonus = torch.zeros_like(r)
            bonus[idx[-1]] = R
            r = r + bonus
        token_rewards.append(r)
    lengths = [r.numel() for r in token_rewards]
    if not lengths:
        return []
    return _unpad(_reverse_scan(_pad(token_rewards), gamma), lengths)


def reinforce_plus_plus_baseline(
    rewards: torch.Tensor, kl: Tensors, masks: Tensors, kl_coef: float, group_size: int, centered: bool = False
) -> list[torch.Tensor]:
    """REINFORCE++-baseline advantages (before whitening): R minus its group mean (``centered``: R is centred
    already), minus kl_coef*kl*m per token."""
    centered = rewards if centered else grpo_advantages(rewards, group_size, std_normalization=False)
    return [c + r for c, r in zip(centered, _masked_kl_rewards(kl, masks, kl_coef))]


def whiten(values: Tensors, masks: Tensors, eps: float = 1e-8) -> list[torch.Tensor]:
    """(x - mean) / sqrt(var + eps) with the masked mean and unbiased masked variance over all tokens of the batch."""
    if not values:
        return []
    flat = torch.cat(list(values))
    m = torch.cat([mk.to(flat.dtype) for mk in masks])
    count = m.sum()
    if count.item() == 0:
        raise ValueError("cannot whiten: every token of the batch is masked out")
    mean = (flat * m).sum() / count
    var = (((flat - mean) ** 2) * m).sum() / (count - 1).clamp(min=1)
    out = (flat - mean) * torch.rsqrt(var + eps)
    return list(torch.split(out, [v.numel() for v in values]))


@register_estimator("grpo", needs_groups=True, group_std=True, kl_in_reward=False)
def _grpo(x: AdvantageInputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The group-normalised reward on every token; returns = advantages. As in slime, GRPO puts the KL into the
    loss (--use-kl-loss), not into the reward."""
    per_sample = x.rewards if x.normalized else grpo_advantages(x.rewards, x.group_size, x.std_normalization)
    advantages = [torch.ones_like(lp) * a for lp, a in zip(x.log_probs, per_sample)]
    return advantages, list(advantages)


@register_estimator("ppo", needs_critic=True, reads=("--gamma", "--lambd"))
def _ppo(x: AdvantageInputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """KL-penalised token rewards with R on the last response token, GAE over the critic's values; returns =
    advantages + values."""
    if x.values is None:
        raise ValueError("the ppo estimator needs critic values")
    token_rewards = []
    for R, k in zip(x.rewards, _masked_kl_rewards(x.kl, x.loss_masks, x.kl_coef)):
        if k.numel():
            bonus = torch.zeros_like(k)
            bonus[-1] = R
            k = k + bonus
        token_rewards.append(k)
    return gae(token_rewards, x.values, x.gamma, x.lambd)


@register_estimator("reinforce_plus_plus", whitened=True, reads=("--gamma",))
def _reinforce_plus_plus(x: AdvantageInputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Discounted returns of the KL-penalised token rewards; advantages = whitened returns."""
    returns = reinforce_plus_plus_returns(x.rewards, x.kl, x.loss_masks, x.kl_coef, x.gamma)
    return whiten(returns, x.loss_masks), returns


@register_estimator("reinforce_plus_plus_baseline", needs_groups=True, whitened=True)
def _reinforce_plus_plus_baseline(x: AdvantageInputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Group-centred R minus the KL penalty; advantages whitened, returns unwhitened."""
    returns = reinforce_plus_plus_baseline(x.rewards, x.kl, x.loss_masks, x.kl_coef, x.group_size, x.normalized)
    return whiten(returns, x.loss_masks), returns


def compute_advantages_and_returns(
    estimator_name: str,
    rewards: Sequence[float] | torch.Tensor,
    log_probs: Tensors,
    ref_log_probs: Tensors | None,
    values: Tensors | None,
    loss_masks: Tensors,
    *,
    group_size: int,
    kl_coef: float = 0.0,
    kl_type: str = "k1",
    gamma: float = 1.0,
    lambd: float = 1.0,
    std_normalization: bool = True,
    normalize_advantages: bool = False,
    rewards_normalized: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Advantages and returns per sample (lists of per-token tensors) by the registered estimator ``estimator_name``.

    `log_probs` are the old-policy log-probs of each response token, `ref_log_probs` the reference model's (None:
    KL is zero), `values` the critic's (estimators that need a critic only), `rewards` one scalar per sample, groups
    of `group_size` adjacent. `normalize_advantages` whitens the advantages of estimators that do not always do it.
    `rewards_normalized`: the rewards are normalised already (--custom-reward-post-process-path), so GRPO and
    REINFORCE++-baseline take them as they are instead of normalising them in their groups (any group sizes).
    """
    spec = estimator(estimator_name)
    n = len(log_probs)
    if len(loss_masks) != n:
        raise ValueError(f"{len(loss_masks)} loss masks for {n} samples")
    ref = log_probs[0] if n else None
    r = torch.as_tensor(rewards, dtype=ref.dtype if ref is not None else None,
                        device=ref.device if ref is not None else None)
    if r.numel() != n:
        raise ValueError(f"{r.numel()} rewards for {n} samples")
    if ref_log_probs is None or kl_coef == 0.0:
        kl = [torch.zeros_like(lp) for lp in log_probs]
    else:
        kl = [compute_kl(lp, rl, kl_type) for lp, rl in zip(log_probs, ref_log_probs)]
    advantages, returns = spec.fn(AdvantageInputs(r, log_probs, values, loss_masks, kl, group_size, kl_coef, gamma,
                                                  lambd, std_normalization, rewards_normalized))
    if normalize_advantages and not spec.whitened:
        advantages = whiten(advantages, loss_masks)
    return advantages, returns
