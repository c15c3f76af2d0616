"""``--rollout-function-path`` / ``--eval-function-path``: the whole rollout (or eval) of a step, with slime's
signature ``generate_rollout(args, rollout_id, data_source, evaluation=False)`` and slime's output types.

A rollout function returns ``RolloutFnTrainOutput(samples=[[Sample, ...], ...], metrics={...})`` (prompt groups;
a plain list of groups, or of samples, is taken too, as slime takes it), an eval function
``RolloutFnEvalOutput(data={name: {"rewards": [...], "truncated": [...], "samples": [...]}}, metrics={...})`` (a
plain dict too). It may be a plain or an ``async`` function: a coroutine runs on the rollout manager's event loop,
where ``args.engine_client`` lives; a plain function is called outside it (it may run its own loop).

The default, ``slime_lite.rollout.functions.generate_rollout``, is registered through the same flag: prompts from
``--prompt-data``, one ``--custom-generate-function-path`` call (or the built-in generate) per sample, rewards, the
dynamic-sampling filter, then ``--rollout-sample-filter-path`` and ``--rollout-all-samples-process-path`` as slime's
default rollout calls them; eval over every ``--eval-prompt-data`` set.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Any

from slime_lite import rl_math
from slime_lite.errors import SlimeLiteError
from slime_lite.hooks import call_maybe_async, load_hook
from slime_lite.rollout.data import PromptSource
from slime_lite.rollout.generate import Generator, new_group
from slime_lite.types import Sample

@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


class DataSource:
    """What a rollout function draws prompts from (slime's ``data_source``).

    ``get_samples(n)``: the next ``n`` prompts of ``--prompt-data``, each a group of ``--n-samples-per-prompt``
    Samples whose ``tokens`` are the encoded prompt (chat template applied when asked). ``get_eval_samples(name)``:
    the prompts of an ``--eval-prompt-data`` set the same way (``eval_sets``: their names and prompts). ``generator``: the built-in generation (``await
    data_source.generator.run_group(group, sampling_params, seed)`` runs one group through the generate hook and the
    reward), which the default rollout uses."""

    def __init__(self, generator: Generator, prompts: PromptSource | None,
                 eval_sets: dict[str, list[Any]]) -> None:
        self.generator = generator
        self.prompts = prompts
        self.eval_sets = eval_sets
        self._drawn = 0  # groups get_samples gave out in this rollout: a later call numbers on (seeds are by index)

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        if self.prompts is None:
            raise SlimeLiteError("the rollout function asked for prompts, but no --prompt-data was given.")
        groups = self._groups(self.prompts.next_batch(num_samples), self.generator.config.n_samples_per_prompt,
                              self._drawn)
        self._drawn += len(groups)
        return groups

    def get_eval_samples(self, name: str) -> list[list[Sample]]:
        """Every prompt of the ``--eval-prompt-data`` set ``name``, in groups of ``--n-samples-per-eval-prompt``."""
        if name not in self.eval_sets:
            raise SlimeLiteError(f"the eval function asked for eval set {name!r}; --eval-prompt-data has "
                                 f"{sorted(self.eval_sets) or 'none'}.")
        return self._groups(self.eval_sets[name], self.generator.config.n_samples_per_eval_prompt)

    def _groups(self, prompts: list[Any], n: int, first: int = 0) -> list[list[Sample]]:
        groups = []
        for gi, prompt in enumerate(prompts, first):
            text, ids = self.generator.encode(prompt)
            groups.append(new_group(prompt, n, gi, gi * n, text, ids))
        return groups


async def generate_rollout(args: Any, rollout_id: int, data_source: DataSource,
                           evaluation: bool = False) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """The default rollout (and eval) of slime-lite."""
    gen = data_source.generator
    if evaluation:
        data = {}
        for name, prompts in data_source.eval_sets.items():
            samples = await gen.evaluate(name, prompts, rollout_id)
            key = args.eval_reward_key or args.reward_key  # as slime: the scalar of a dict reward
            data[name] = {"rewards": [s.reward[key] if key and isinstance(s.reward, dict) else s.reward
                                      for s in samples],
                          "truncated": [s.status == Sample.Status.TRUNCATED for s in samples], "samples": samples}
        return RolloutFnEvalOutput(data=data)
    if data_source.prompts is None:
        raise SlimeLiteError("no prompts to generate from: give --prompt-data (a JSONL file of prompts).")
    samples, metrics = await gen.rollout(rollout_id, data_source.prompts)
    groups = [list(g) for _, g in itertools.groupby(samples, key=lambda s: s.group_index)]
    # slime's end-of-rollout hooks: the kept groups (a sample may be given remove_sample), then every group back
    if args.rollout_sample_filter_path:
        fn = load_hook(args.rollout_sample_filter_path, "--rollout-sample-filter-path")
        await call_maybe_async(fn, args, groups)
    if args.rollout_all_samples_process_path:
        fn = load_hook(args.rollout_all_samples_process_path, "--rollout-all-samples-process-path")
        await call_maybe_async(fn, args, gen.all_groups, data_source.get_samples)  # slime passes the getter
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)


def train_samples(output: Any, flag: str) -> tuple[list[Sample], dict[str, Any]]:
    """A rollout function's result as one flat list (``group_index`` and ``index`` numbered in order) and its
    metrics; anything but groups of Samples is a SlimeLiteError naming ``flag`` and what came back."""
    metrics: dict[str, Any] = {}
    if isinstance(output, RolloutFnTrainOutput):
        output, metrics = output.samples, dict(output.metrics or {})
    if not isinstance(output, list) or not output:
        raise SlimeLiteError(f"{flag} returned {type(output).__name__}: expected RolloutFnTrainOutput(samples=[[Sample"
                             ", ...], ...]) or a non-empty list of sample groups.")
    groups = [g if isinstance(g, list) else [g] for g in output]
    flat: list[Sample] = []
    for gi, group in enumerate(groups):
        for s in group:
            if not isinstance(s, Sample):
                raise SlimeLiteError(f"{flag} returned a {type(s).__name__} in group {gi}: expected Samples.")
            s.group_index, s.index = gi, len(flat)
            flat.append(s)
    return flat, metrics


def check_group_sizes(samples: list[Sample], group_size: int, advantage_estimator: str) -> None:
    """Group estimators (GRPO, REINFORCE++-baseline) compare the ``--n-samples-per-prompt`` trajectories of a prompt
    (the samples one trajectory was split into share ``rollout_id`` and count once): a rollout whose groups hold
    another number of trajectories (a rollout function with other groups, a generate hook that returns samples of
    several trajectories) is a SlimeLiteError naming the group and the way out."""
    if not rl_math.estimator(advantage_estimator).needs_groups:
        return
    trajectories: dict[Any, set] = collections.defaultdict(set)
    sizes = collections.Counter(s.group_index for s in samples)
    for s in samples:
        trajectories[s.group_index].add(s.trajectory)
    bad = next(((g, len(t)) for g, t in trajectories.items() if len(t) != group_size), None)
    if bad is not None:
        raise SlimeLiteError(
            f"rollout group {bad[0]} has {bad[1]} trajectories ({sizes[bad[0]]} samples), --n-samples-per-prompt is "
            f"{group_size}: --advantage-estimator {advantage_estimator} compares the trajectories of one prompt "
            "group. A generate hook that splits one trajectory into several samples gives them one rollout_id (a "
            "returned list gets the given sample's index where none is set); else use --advantage-estimator "
            "reinforce_plus_plus or ppo (per-sample).")


def eval_samples(output: Any, flag: str) -> tuple[dict[str, list[Sample]], dict[str, Any]]:
    """An eval function's result as ``{name: samples}`` and its metrics."""
    metrics: dict[str, Any] = {}
    if isinstance(output, RolloutFnEvalOutput):
        output, metrics = output.data, dict(output.metrics or {})
    if not isinstance(output, dict):
        raise SlimeLiteError(f"{flag} returned {type(output).__name__}: expected RolloutFnEvalOutput(data={{name: "
                             "{'rewards': [...], 'truncated': [...], 'samples': [...]}}}) or that dict.")
    out = {}
    for name, entry in output.items():
        samples = entry.get("samples") if isinstance(entry, dict) else None
        if not isinstance(samples, list) or not all(isinstance(s, Sample) for s in samples):
            raise SlimeLiteError(f"{flag} returned eval set {name!r} without a 'samples' list of Samples (slime-lite "
                                 "recomputes the eval metrics and writes the eval dumps from them).")
        out[name] = samples
    return out, metrics

