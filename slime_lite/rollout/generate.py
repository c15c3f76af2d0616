"""Turn prompts into Samples through the engine API: sampling, rewards, dynamic-sampling filters."""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import time
from collections import Counter
from typing import Any, Callable

from slime_lite.checks.faults import sampling_temperature
from slime_lite.config import RolloutConfig
from slime_lite.engine_client import AsyncEngineClient
from slime_lite.errors import SlimeLiteError
from slime_lite.hooks import HookArgs, call_maybe_async, load_hook
from slime_lite.rollout.data import Prompt, PromptSource, encode_prompt
from slime_lite.rollout.filters import drop_reasons, filter_verdict
from slime_lite.rollout.oversample import GENERATED_TOKENS, MAX_SUBMITS, OverSampler, complete, stamp_versions
from slime_lite.rollout.resumed_stop import end_at_resumed_stop
from slime_lite.rollout.rewards import compute_group_rewards, compute_reward
from slime_lite.rollout.turns import model_tokens, routed_experts
from slime_lite.types import TOKEN_VERSIONS, Sample, Status, version_number

log = logging.getLogger(__name__)


def sampling_params(cfg: RolloutConfig, evaluation: bool = False) -> dict[str, Any]:
    temperature = sampling_temperature(cfg.debug_inject_fault,
                                       cfg.eval_temperature if evaluation else cfg.rollout_temperature, evaluation)
    params = {
        "temperature": temperature,
        "top_p": cfg.eval_top_p if evaluation else cfg.rollout_top_p,
        "top_k": cfg.eval_top_k if evaluation else cfg.rollout_top_k,
        "max_new_tokens": cfg.eval_max_response_len if evaluation else cfg.rollout_max_response_len,
        "stop": cfg.rollout_stop,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if cfg.rollout_stop_token_ids:
        params["stop_token_ids"] = list(cfg.rollout_stop_token_ids)
    if evaluation and cfg.eval_min_new_tokens:
        params["min_new_tokens"] = cfg.eval_min_new_tokens
    return params


def new_group(prompt: Prompt, n: int, group_index: int, first_index: int, text: str, ids: list[int]) -> list[Sample]:
    return [
        Sample(
            group_index=group_index,
            index=first_index + j,
            # copies: a hook that edits a sample's chat history or metadata in place leaves its group's other
            # samples and the data set (read again next epoch) as they were
            prompt=copy.deepcopy(prompt.prompt),
            tokens=list(ids),
            label=copy.deepcopy(prompt.label),
            metadata=copy.deepcopy({**prompt.metadata, "prompt_index": prompt.index, "prompt_text": text}),
        )
        for j in range(n)
    ]


def fill_response(sample: Sample, out: dict[str, Any]) -> Sample:
    """Append one /generate result (SGLang's response shape) to the sample: a new sample's whole response, or the
    rest of an aborted one continued from its tokens (--partial-rollout)."""
    meta = out["meta_info"]
    ids = list(out["output_ids"])
    logprobs = [float(t[0]) for t in meta.get("output_token_logprobs") or []]
    had = sample.response_length
    before = sample.rollout_log_probs if had else []
    sample.tokens = sample.tokens + ids
    sample.response = (sample.response if had else "") + out["text"]
    sample.response_length = had + len(ids)
    sample.rollout_log_probs = before + logprobs if before is not None and len(logprobs) == len(ids) else None
    sample.loss_mask = (list(sample.loss_mask or [1] * had) if had else []) + [1] * len(ids)
    sample.status = Status.from_finish_reason((meta.get("finish_reason") or {}).get("type"))
    if meta.get("weight_version") is not None:
        sample.weight_versions.append(str(meta["weight_version"]))
    per_token = meta.get("output_token_weight_versions")  # a request in flight across a push spans two versions
    before_versions = sample.metadata.get(TOKEN_VERSIONS) if had else []
    if per_token is not None and len(per_token) == len(ids) and before_versions is not None \
            and len(before_versions) == had:
        sample.metadata[TOKEN_VERSIONS] = list(before_versions) + [version_number(str(v)) for v in per_token]
    sample.prefix_cache_info.cached_tokens += int(meta.get("cached_tokens") or 0)
    sample.prefix_cache_info.total_prompt_tokens += int(meta.get("prompt_tokens") or 0)
    if meta.get("routed_experts") is not None:  # --use-rollout-routing-replay: every position but the last
        sample.rollout_routed_experts = routed_experts(meta["routed_experts"])
    return sample



def continued(params: dict[str, Any], sample: Sample) -> dict[str, Any]:
    """The sampling params of a sample's request: a continued one (--partial-rollout) has its response tokens in
    its input ids and may generate only the rest of --rollout-max-response-len."""
    return dict(params, max_new_tokens=params["max_new_tokens"] - sample.response_length) if sample.response_length \
        else params


_CUT_WARNED: list[bool] = []  # once per process


def _filled(args: Any, sample: Sample, out: dict[str, Any], params: dict[str, Any]) -> Sample:
    """``fill_response`` of the request made with ``params``, ended first at a stop string that spans a
    --partial-rollout resume, with a resumed response's text decoded whole (resumed_stop.py); and a warning (once)
    when the engine ended the response at its own length limit before the tokens asked: every such response is cut
    short."""
    had, asked = sample.response_length, params["max_new_tokens"]
    text = end_at_resumed_stop(args, sample, out, params)
    fill_response(sample, out)
    if text is not None:
        sample.response = text
    got = sample.response_length - had
    if (out["meta_info"].get("finish_reason") or {}).get("type") == "length" and got < asked and not _CUT_WARNED:
        _CUT_WARNED.append(True)
        log.warning("sample %s: the engine ended its response at %d of the %d tokens asked (finish 'length'): the "
                    "prompt plus --rollout-max-response-len do not fit what the engine serves per request, the "
                    "model's context or, for the embedded engine, its batch slot (min(context, 4096) tokens unless "
                    "--engine-kv-cache-tokens / --engine-max-running-requests make it larger); such responses are "
                    "truncated (logged once)", sample.index, got, asked)
    return sample


async def default_generate(args: Any, sample: Sample, params: dict[str, Any]) -> Sample:
    """slime's generate signature; sends the prompt ids (and a continued sample's response so far) to an engine and
    fills the response fields."""
    p = continued(params, sample)
    body = {"input_ids": sample.tokens, "sampling_params": p, "return_logprob": True,
            "return_routed_experts": bool(args.use_rollout_routing_replay)}
    return _filled(args, sample, await args.engine_client.generate(body), p)


async def generate_group(args: Any, group: list[Sample], params: list[dict[str, Any]]) -> list[Sample]:
    """A prompt group in one /generate call (a list of prompts, one sampling-params dict each): one HTTP round
    trip instead of n; the engine batches them as it would n separate requests."""
    ps = [continued(p, s) for s, p in zip(group, params)]
    body = {"input_ids": [s.tokens for s in group], "sampling_params": ps,
            "return_logprob": True, "return_routed_experts": bool(args.use_rollout_routing_replay)}
    outs = await args.engine_client.generate(body)
    return [_filled(args, s, out, p) for s, out, p in zip(group, outs, ps)]


async def gather_or_cancel(coros: Any) -> list[Any]:
    """``asyncio.gather`` of ``coros`` that, when one raises, cancels the others (a group's other hooks would go on
    calling the engines after the rollout failed) and waits a little for them before raising."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=10)
        for t in tasks:  # retrieved: no "exception was never retrieved" for a second failure
            if t.done() and not t.cancelled():
                t.exception()
        raise


def split_samples(out: Any, sample: Sample) -> list[Sample]:
    """A generate hook's result: one Sample, or a list of them (one trajectory split into several training samples,
    which share ``rollout_id``: the index of the sample the hook was given)."""
    parts = out if isinstance(out, list) else [out]
    if not parts or not all(isinstance(s, Sample) for s in parts):
        raise SlimeLiteError(
            f"--custom-generate-function-path returned {type(out).__name__}"
            + (f" of {sorted({type(s).__name__ for s in parts})}" if isinstance(out, list) else "")
            + f" for sample {sample.index}: expected a Sample or a non-empty list of Samples.")
    if len(parts) > 1:
        for s in parts:
            if s.rollout_id is None:
                s.rollout_id = sample.index
    return parts


def seed_base(rollout_seed: int, salt: int) -> int:
    """The base of a rollout's sampling seeds (each sample adds its index): --rollout-seed mixed with ``salt`` (the
    rollout id's share, or fully async generation's), kept within int64 (SGLang and the embedded engine refuse a
    sampling_seed outside it) whatever --rollout-seed is."""
    return (rollout_seed * 1_000_003 + salt) % (1 << 62)


class Generator:
    """Generates groups of samples for a rollout (with dynamic sampling) or for an eval set."""

    def __init__(self, args: Any, tokenizer: Any, client: AsyncEngineClient | None) -> None:
        self.client = client
        self.args = HookArgs(args, client)  # what the generate/filter/reward hooks get, as in slime
        self.config = RolloutConfig.from_args(args)
        self.tokenizer = tokenizer
        path = args.custom_generate_function_path
        self.generate_fn: Callable[..., Any] = (
            load_hook(path, "--custom-generate-function-path") if path else default_generate
        )
        # slime passes evaluation= to a generate hook that takes it
        self.takes_evaluation = "evaluation" in inspect.signature(self.generate_fn).parameters
        path = args.dynamic_sampling_filter_path
        self.filter_fn = filter_verdict(load_hook(path, "--dynamic-sampling-filter-path")) if path else None
        self.progress = [0, 0]  # samples finished, samples wanted (read by the driver's progress bar)
        self.kill_engine: Callable[[], Any] | None = None  # --debug-inject-fault kill-engine (set by the manager)
        # monotonic times of this rollout's first request sent and last response back (perf/rollout/generate_time)
        self.first_sent: float | None = None
        self.last_back: float | None = None
        self.over = OverSampler(self)  # over-sampling, aborts, and the samples carried between rollouts
        # the last rollout's groups that came back, kept or not, in the order they started (slime's all_samples)
        self.all_groups: list[list[Sample]] = []

    def _sent(self) -> None:
        if self.first_sent is None:
            self.first_sent = time.monotonic()

    def _back(self) -> None:
        self.last_back = time.monotonic()

    def encode(self, prompt: Prompt) -> tuple[str, list[int]]:
        return encode_prompt(prompt, self.tokenizer, self.args)

    async def run_group(self, group: list[Sample], params: dict[str, Any], seed_base: int,
                         evaluation: bool = False, sizes: list[int] | None = None) -> list[Sample]:
        """Generate and score ``group`` (with ``sizes``: several prompts' groups back to back, one request: the
        deterministic waves). A generate hook may split a sample into several. With --group-rm each prompt's group
        is scored at once, after all of it came back."""
        per_sample = [dict(params, sampling_seed=seed_base + s.index) for s in group]
        for s, p in zip(group, per_sample):
            s.metadata["sampling_params"] = p
            s.generate_function_path = self.args.custom_generate_function_path
        t0 = time.monotonic()
        self._sent()
        if self.generate_fn is default_generate:
            parts = [[s] for s in await generate_group(self.args, group, per_sample)]
            self._back()
        else:
            async def one(sample: Sample, p: dict[str, Any]) -> list[Sample]:
                kwargs = {"evaluation": evaluation} if self.takes_evaluation else {}
                out = await call_maybe_async(self.generate_fn, self.args, sample, p, **kwargs)
                self._back()
                split = split_samples(out, sample)
                return split if self.args.group_rm else await self._score(split, t0)  # as each sample ends

            parts = await gather_or_cancel(one(s, p) for s, p in zip(group, per_sample))
        if not self.args.group_rm:
            if self.generate_fn is default_generate:
                await self._score([s for p in parts for s in p], t0)
            return [s for p in parts for s in p]
        out: list[Sample] = []
        start = 0
        for n in sizes or [len(group)]:  # each prompt's group: the samples its samples became
            prompt_group = [s for p in parts[start:start + n] for s in p]
            start += n
            if any(s.status is Status.ABORTED for s in prompt_group):  # cut short: no group reward (as slime)
                out += prompt_group
                continue
            out += await self._score(prompt_group, t0)
        return out

    async def _score(self, samples: list[Sample], t0: float) -> list[Sample]:
        """Rewards of the samples that were not aborted (an aborted one is dropped, or continued and scored later),
        as slime gives them: one call of the group reward model with --group-rm over all of them, else each
        sample's that has none (a generate hook may set ``sample.reward`` itself)."""
        live = [s for s in samples if s.status is not Status.ABORTED]
        t1 = time.monotonic()
        if self.args.group_rm:
            scored = live
            rewards = await compute_group_rewards(self.args, live)
        else:
            scored = [s for s in live if s.reward is None]
            rewards = await asyncio.gather(*(compute_reward(self.args, s) for s in scored))
        for sample, r in zip(scored, rewards):
            sample.reward = r
            if not self.config.deterministic_mode:  # wall-clock values would tell two identical dumps apart
                sample.non_generation_time = time.monotonic() - t1
                sample.metadata["generation_time"] = t1 - t0
        self.progress[0] += len(live)
        return samples

    def new_group(self, prompt: Prompt, first_index: int) -> list[Sample]:
        """A prompt's group of ``--n-samples-per-prompt`` samples, numbered from ``first_index``."""
        text, ids = self.encode(prompt)
        return new_group(prompt, self.config.n_samples_per_prompt, 0, first_index, text, ids)

    async def rollout(self, rollout_id: int, source: PromptSource) -> tuple[list[Sample], dict[str, float]]:
        """``--rollout-batch-size`` groups of ``--n-samples-per-prompt``: over-sampled, filtered and aborted as
        rollout/oversample.py says; under --deterministic-mode in whole waves instead (nothing aborted)."""
        a = self.config
        params = sampling_params(a)
        self.progress = [0, a.rollout_batch_size * a.n_samples_per_prompt]
        self.first_sent = self.last_back = None
        base = seed_base(a.rollout_seed, rollout_id * 100_003)  # resumable: (seed, rollout id, position)
        if not a.deterministic_mode:
            return await self.over.rollout(rollout_id, source, params, base)
        return await self._rollout_in_waves(source, params, base)

    async def _rollout_in_waves(self, source: PromptSource, params: dict[str, Any],
                                seed_base: int) -> tuple[list[Sample], dict[str, float]]:
        """--deterministic-mode: waves of ``--over-sampling-batch-size`` groups, each run to its end (nothing is
        aborted, so the same run twice keeps the same groups), until the filter kept ``--rollout-batch-size``."""
        a = self.config
        wave = a.over_sampling_batch_size or a.rollout_batch_size
        kept: list[list[Sample]] = []
        late: list[list[Sample]] = []  # generated, never trained: cut short, or finished beyond the target
        generated = dropped = cut = 0
        reasons: Counter[str | None] = Counter()
        next_index = 0
        self.all_groups = []
        for _ in range(MAX_SUBMITS):
            groups = []
            for prompt in source.next_batch(wave):
                groups.append(self.new_group(prompt, next_index))
                next_index += a.n_samples_per_prompt
            results = await self._run_together(groups, params, seed_base)
            remaining = len(kept) + len(results)  # slime's: kept, or in this wave and not dropped yet
            for group in results:
                generated += 1
                self.all_groups.append(group)
                if not complete(group):  # the engine cut it short (an engine error): never trained
                    cut += 1
                    remaining -= 1
                    late.append(group)
                    continue
                verdict = self.filter_fn(self.args, group) if self.filter_fn else None
                if verdict is not None and verdict.drops(remaining, a.rollout_batch_size):
                    dropped += 1
                    remaining -= 1
                    reasons[verdict.reason] += 1
                elif len(kept) < a.rollout_batch_size:
                    kept.append(group)
                else:
                    late.append(group)
            if len(kept) >= a.rollout_batch_size:
                break
        else:
            raise SlimeLiteError(
                f"only {len(kept)} of {generated} groups were kept after {MAX_SUBMITS} waves ({dropped} dropped by "
                f"--dynamic-sampling-filter-path, {cut} cut short by the engines): the filter is too strict for this "
                "model/data, or the engines abort requests."
            )
        samples = []
        for gi, group in enumerate(kept):
            for s in group:
                s.group_index = gi
                s.index = len(samples)
                stamp_versions(s)
                samples.append(s)
        stats: dict[str, float] = {}
        if self.filter_fn:
            stats.update({"rollout/dynamic_filter/generated_groups": float(generated),
                          "rollout/dynamic_filter/dropped_groups": float(dropped), **drop_reasons(reasons)})
        if a.over_sampling_batch_size is not None:  # as the over-sampler logs them (nothing is carried here)
            stats["rollout/over_sampling/submitted_groups"] = float(generated)
            stats["rollout/over_sampling/tokens_wasted"] = float(sum(s.response_length for g in late for s in g))
        if cut:
            stats["rollout/over_sampling/aborted_groups"] = float(cut)
        # every group the waves generated, trained or not (perf/rollout_tokens_per_s)
        stats[GENERATED_TOKENS] = float(sum(model_tokens(s) for g in self.all_groups for s in g))
        return samples, stats

    async def _run_together(self, groups: list[list[Sample]], params: dict[str, Any],
                            seed_base: int) -> list[list[Sample]]:
        """--deterministic-mode: the whole wave in one /generate call, so the engine admits and batches the same
        sequences in the same order every run (concurrent group requests arrive in a different order each time,
        and batch composition changes the numerics). A generate hook's groups run side by side, each as its own
        (its samples may split into several, so one flat list could not be cut back into groups)."""
        if self.generate_fn is not default_generate:
            return list(await gather_or_cancel(self.run_group(g, params, seed_base) for g in groups))
        sizes = [len(g) for g in groups]
        flat = await self.run_group([s for g in groups for s in g], params, seed_base, sizes=sizes)
        return [flat[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(groups))]

    async def _kill_engine_before(self, run: Any, wait_for_a_group: bool) -> list[Sample]:
        """--debug-inject-fault kill-engine: once a group has finished (the others are in flight), kill engine 0,
        then send this group: its request and the unfinished ones fail (retried under --use-fault-tolerance)."""
        kill, self.kill_engine = self.kill_engine, None  # once per run: the restarted engine is left alone
        deadline = time.monotonic() + 60
        while wait_for_a_group and self.progress[0] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await kill()
        return await run

    async def evaluate(self, name: str, prompts: list[Prompt], rollout_id: int) -> list[Sample]:
        a = self.config
        params = sampling_params(a, evaluation=True)
        n = a.n_samples_per_eval_prompt
        groups = []
        for gi, prompt in enumerate(prompts):
            text, ids = self.encode(prompt)
            groups.append(new_group(prompt, n, gi, gi * n, text, ids))
        base = seed_base(a.rollout_seed, 7_919 + rollout_id * 100_003)
        if a.deterministic_mode and self.generate_fn is default_generate:
            results = await self._run_together(groups, params, base)
        else:
            results = await gather_or_cancel(self.run_group(g, params, base, True) for g in groups)
        return [s for g in results for s in g]
