"""--rollout-function-path / --eval-function-path / --custom-generate-function-path: slime's signatures, checked
before Ray starts, run by the rollout manager against a real in-process embedded engine (no Ray)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from slime_lite.args import parser_defaults
from slime_lite.errors import SlimeLiteError
from slime_lite.preflight import check_hooks
from slime_lite.rollout.dumps import load_rollout_dump
from tests.engine.engine_helpers import start_engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    server = start_engine(tiny_model_dir, max_running_requests=8)
    yield server
    server.stop()


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    """Write a module of hooks into tmp_path and make it importable."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return write


def _prompts(tmp_path: Path, n: int = 4) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(n)))
    return str(path)


def _manager(tiny_model_dir, engine, tmp_path, **flags):
    from slime_lite.rollout.manager import RolloutManager

    args = parser_defaults(**{"hf_checkpoint": str(tiny_model_dir), "prompt_data": _prompts(tmp_path),
                              "rm_type": "addition", "rollout_batch_size": 2, "n_samples_per_prompt": 2,
                              "rollout_max_response_len": 4, **flags})
    return RolloutManager(args, [engine.url])


@pytest.mark.parametrize("flag, path, expected", [
    ("rollout_function_path", "no_such_module.generate_rollout",
     r"--rollout-function-path 'no_such_module.generate_rollout': cannot import module 'no_such_module'"),
    ("rollout_function_path", "bad_hooks.two_args",
     r"--rollout-function-path 'bad_hooks.two_args': bad_hooks.two_args\(args, rollout_id\) cannot be called as "
     r"generate_rollout\(args, rollout_id, data_source, evaluation=False\)"),
    ("eval_function_path", "bad_hooks.no_evaluation",
     r"--eval-function-path 'bad_hooks.no_evaluation': bad_hooks.no_evaluation\(args, rollout_id, data_source\) "
     r"cannot be called as generate_rollout\(args, rollout_id, data_source, evaluation=False\)"),
    ("custom_generate_function_path", "bad_hooks.two_args",
     r"--custom-generate-function-path 'bad_hooks.two_args': .* cannot be called as async generate\(args, sample, "
     r"sampling_params\)"),
    ("custom_generate_function_path", "bad_hooks.missing",
     r"--custom-generate-function-path 'bad_hooks.missing': module 'bad_hooks' has no function 'missing'"),
])
def test_a_hook_that_does_not_import_or_has_the_wrong_signature_is_refused_before_ray_starts(
        tiny_model_dir, tmp_path, hooks, flag, path, expected):
    hooks("bad_hooks", """
        def two_args(args, rollout_id):
            pass

        def no_evaluation(args, rollout_id, data_source):
            pass
    """)
    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), prompt_data=_prompts(tmp_path), rm_type="addition",
                           **{flag: path})
    with pytest.raises(SlimeLiteError, match=expected):
        check_hooks(args)


def test_the_default_rollout_is_registered_through_the_flag_and_passes_the_check(tiny_model_dir, tmp_path):
    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), prompt_data=_prompts(tmp_path), rm_type="addition")
    assert args.rollout_function_path == "slime_lite.rollout.functions.generate_rollout"
    check_hooks(args)


def test_a_custom_rollout_and_eval_function_replace_the_step(tiny_model_dir, engine, tmp_path, hooks):
    """A sync rollout function (slime's shape: data_source.get_samples, its own event loop) and an async eval
    function: their samples are trained and evaluated, their metrics logged next to slime-lite's."""
    hooks("my_rollout", """
        import asyncio
        from slime_lite.rollout.functions import RolloutFnEvalOutput, RolloutFnTrainOutput
        from slime_lite.engine_client import AsyncEngineClient
        from slime_lite.rollout.generate import fill_response

        async def _generate(urls, groups):
            client = AsyncEngineClient(urls, timeout=60)
            try:
                for group in groups:
                    for s in group:
                        out = await client.generate({"input_ids": s.tokens, "return_logprob": True,
                                                     "sampling_params": {"max_new_tokens": 3, "temperature": 1.0}})
                        fill_response(s, out)
                        s.reward = float(len(s.response))
            finally:
                await client.close()

        def generate_rollout(args, rollout_id, data_source, evaluation=False):
            groups = data_source.get_samples(args.rollout_batch_size)
            asyncio.run(_generate(args.engine_client.urls, groups))  # a plain function runs its own loop
            return RolloutFnTrainOutput(samples=groups, metrics={"custom/rollout_id": rollout_id})

        async def evaluate(args, rollout_id, data_source, evaluation=False):
            assert evaluation
            groups = data_source.get_eval_samples("held_out")
            assert len(groups) == 2 and all(len(g) == 1 for g in groups)  # --n-samples-per-eval-prompt 1
            for s in groups[0]:
                fill_response(s, await args.engine_client.generate(
                    {"input_ids": s.tokens, "return_logprob": True,
                     "sampling_params": {"max_new_tokens": 2, "temperature": 1.0}}))
                s.reward = 1.0
            return RolloutFnEvalOutput(data={"mine": {"rewards": [1.0, 1.0], "truncated": [True, True],
                                                     "samples": groups[0]}}, metrics={"custom/evaluated": 1.0})
    """)
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(2)))
    manager = _manager(tiny_model_dir, engine, tmp_path, rollout_function_path="my_rollout.generate_rollout",
                       eval_function_path="my_rollout.evaluate", eval_prompt_data=["held_out", str(held_out)],
                       save_debug_rollout_data=str(tmp_path / "d_{rollout_id}.pt"), log_passrate=True)
    samples, metrics = manager.generate(3)
    assert [(s.group_index, s.index) for s in samples] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert all(s.response_length == 3 and len(s.rollout_log_probs) == 3 for s in samples)
    assert metrics["custom/rollout_id"] == 3 and metrics["rollout/raw_reward"] == pytest.approx(
        sum(len(s.response) for s in samples) / 4)
    from slime_lite.rollout.stats import pass_at_k

    passrate = {k.removeprefix("passrate/"): v for k, v in metrics.items() if k.startswith("passrate/")}
    assert passrate == pass_at_k(samples, {i: s.reward for i, s in enumerate(samples)}) and len(passrate) == 2
    out = manager.evaluate(3)
    assert out["custom/evaluated"] == 1.0 and out["eval/mine"] == 1.0 and out["eval/mine/response_len/mean"] == 2
    assert not any("pass@" in k for k in out)  # one sample per eval prompt: no pass@k
    manager.close()
    assert len(load_rollout_dump(str(tmp_path / "d_3.pt")).samples) == 4


def test_a_generate_hook_may_return_a_list_of_samples_sharing_rollout_id(tiny_model_dir, engine, tmp_path, hooks):
    """One trajectory split into two training samples: both are trained, with the trajectory's rollout_id. A group
    estimator (GRPO) compares the trajectories: each sample trains on its trajectory's reward (its last sample's)
    normalised over the group's two trajectories. A hook that returns samples of several trajectories (rollout_ids
    of their own) gives groups of the wrong size: refused naming the group and the way out."""
    hooks("split_hook", """
        import copy
        from slime_lite.rollout.generate import default_generate

        async def generate(args, sample, sampling_params):
            first = await default_generate(args, copy.deepcopy(sample), sampling_params)
            second = await default_generate(args, sample, sampling_params)
            first.reward, second.reward = -5.0, float(sample.index)  # the trajectory's reward is its last sample's
            return [first, second]

        async def two_trajectories(args, sample, sampling_params):
            first, second = await generate(args, sample, sampling_params)
            first.rollout_id, second.rollout_id = 100 + sample.index, 200 + sample.index
            return [first, second]
    """)
    from slime_lite.types import POST_PROCESSED_REWARD

    manager = _manager(tiny_model_dir, engine, tmp_path, custom_generate_function_path="split_hook.generate",
                       advantage_estimator="reinforce_plus_plus")
    samples, metrics = manager.generate(0)
    assert len(samples) == 8 and [s.group_index for s in samples] == [0, 0, 0, 0, 1, 1, 1, 1]
    pairs = [(samples[i].rollout_id, samples[i + 1].rollout_id) for i in range(0, 8, 2)]
    assert all(a == b for a, b in pairs) and len({a for a, _ in pairs}) == 4
    assert not any(POST_PROCESSED_REWARD in s.metadata for s in samples)  # per-sample: each its own reward
    assert "rollout/samples_per_trajectory" not in metrics
    for estimator, normed in (("grpo", 0.5 ** 0.5), ("reinforce_plus_plus_baseline", 0.5)):
        grouped = _manager(tiny_model_dir, engine, tmp_path, custom_generate_function_path="split_hook.generate",
                           advantage_estimator=estimator)
        samples, metrics = grouped.generate(0)
        # trajectory rewards [0, 1] and [2, 3]: centred (and divided by the std, sqrt(0.5), for GRPO)
        expected = [-normed] * 2 + [normed] * 2 + [-normed] * 2 + [normed] * 2
        assert [s.metadata[POST_PROCESSED_REWARD] for s in samples] == pytest.approx(expected, abs=1e-5)
        assert metrics["rollout/samples_per_trajectory"] == 2.0
        grouped.close()
    whole = _manager(tiny_model_dir, engine, tmp_path)  # GRPO, nothing split: the trainer normalises the groups
    samples, metrics = whole.generate(0)
    assert len(samples) == 4 and not any(POST_PROCESSED_REWARD in s.metadata for s in samples)
    assert "rollout/samples_per_trajectory" not in metrics
    whole.close()
    several = _manager(tiny_model_dir, engine, tmp_path, custom_generate_function_path="split_hook.two_trajectories")
    with pytest.raises(SlimeLiteError, match=r"rollout group 0 has 4 trajectories \(4 samples\), "
                                             "--n-samples-per-prompt is 2: --advantage-estimator grpo"):
        several.generate(0)
    manager.close(), several.close()


def test_a_rollout_of_whole_trajectories_keeps_no_normalised_reward():
    """Without a split trajectory the trainer normalises the groups itself: nothing is kept, and a value left from
    an earlier pass (a replayed dump of split trajectories, or a carried sample) is dropped, so the trainer does not
    take a stale reward as given."""
    from slime_lite.backends.megatron import batch
    from slime_lite.rollout.train_data import normalize_split_trajectories
    from slime_lite.types import POST_PROCESSED_REWARD, Sample

    samples = [Sample(group_index=i // 2, index=i, reward=float(i), metadata={POST_PROCESSED_REWARD: 9.0})
               for i in range(4)]
    assert batch.has_post_processed_rewards(samples)
    assert normalize_split_trajectories(samples, 2, "grpo", True, None) == {}
    assert not any(POST_PROCESSED_REWARD in s.metadata for s in samples)
    assert not batch.has_post_processed_rewards(samples)
    samples[0].rollout_id = samples[1].rollout_id = 7  # samples 0 and 1 are one trajectory: group 0 holds one
    with pytest.raises(SlimeLiteError, match="rollout group 0 has 1 trajectories, --n-samples-per-prompt is 2"):
        normalize_split_trajectories(samples, 2, "grpo", True, None)


@pytest.mark.parametrize("rm_type", ["addition", None])
def test_a_reward_a_generate_hook_sets_is_kept(tiny_model_dir, engine, tmp_path, hooks, rm_type):
    """As in slime, a hook may set ``sample.reward`` (an environment's reward): the reward model scores only the
    samples left without one, and without --rm-type the data needs no rm_type for a hook that sets them all."""
    hooks("rewarding_hook", """
        from slime_lite.rollout.generate import default_generate

        async def generate(args, sample, sampling_params):
            await default_generate(args, sample, sampling_params)
            if sample.index % 2 == 0:
                sample.reward = 0.75
            elif args.rm_type is None:
                sample.reward = 0.25
            return sample
    """)
    manager = _manager(tiny_model_dir, engine, tmp_path, custom_generate_function_path="rewarding_hook.generate",
                       rm_type=rm_type)
    samples, _ = manager.generate(0)
    manager.close()
    assert [s.reward for s in samples if s.index % 2 == 0] == [0.75, 0.75]
    odd = [s.reward for s in samples if s.index % 2]
    assert odd == [0.25, 0.25] if rm_type is None else all(r in (0.0, 1.0) for r in odd)


def test_the_group_reward_model_scores_every_sample_of_the_group_as_slime(tiny_model_dir, engine, tmp_path, hooks):
    """--group-rm: slime's group reward model gets the whole group (a hook's rewards included) and its rewards
    stand; the per-sample reward model skips only rewarded samples."""
    hooks("group_rm_hooks", """
        from slime_lite.rollout.generate import default_generate

        SEEN = []

        async def generate(args, sample, sampling_params):
            await default_generate(args, sample, sampling_params)
            sample.reward = 0.75 if sample.index % 2 == 0 else None
            return sample

        async def rank(args, samples):
            SEEN.append([s.index for s in samples])
            return [float(i) for i, _ in enumerate(samples)]
    """)
    import group_rm_hooks

    manager = _manager(tiny_model_dir, engine, tmp_path, custom_generate_function_path="group_rm_hooks.generate",
                       custom_rm_path="group_rm_hooks.rank", group_rm=True)
    samples, _ = manager.generate(0)
    manager.close()
    assert sorted(map(len, group_rm_hooks.SEEN)) == [2, 2]  # each prompt's whole group
    assert sorted(s.reward for s in samples) == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("breaks, expected", [
    ("sample.loss_mask = sample.loss_mask[:-1]",
     r"rollout 0: sample 1 \(index 1\): loss_mask: has 3 entries but response_length is 4"),
    ("sample.rollout_log_probs = sample.rollout_log_probs + [0.0]",
     r"rollout 0: sample 1 \(index 1\): rollout_log_probs: has 5 entries but response_length is 4"),
    ("sample.tokens[-1] = 10 ** 6",
     r"rollout 0: sample 1 \(index 1\): tokens\[\d+\]: 1000000 is not below the model's vocab size"),
])
def test_a_malformed_hook_sample_fails_the_rollout_naming_sample_and_field_and_the_dump_is_written(
        tiny_model_dir, engine, tmp_path, hooks, breaks, expected):
    name = hooks(f"broken_hook_{abs(hash(breaks))}", f"""
        from slime_lite.rollout.generate import default_generate

        async def generate(args, sample, sampling_params):
            sample = await default_generate(args, sample, dict(sampling_params, stop=None, no_stop_trim=True,
                                                               ignore_eos=True))
            if sample.index == 1:
                {breaks}
            return sample
    """)
    manager = _manager(tiny_model_dir, engine, tmp_path, custom_generate_function_path=f"{name}.generate",
                       save_debug_rollout_data=str(tmp_path / "d_{rollout_id}.pt"))
    with pytest.raises(SlimeLiteError, match=expected):
        manager.generate(0)
    manager.close()
    import torch

    dumped = torch.load(tmp_path / "d_0.pt", weights_only=True)["samples"]  # written as generated, to inspect
    assert len(dumped) == 4 and dumped[1]["response_length"] == 4


def test_a_response_the_engine_cuts_before_its_max_new_tokens_is_warned_once(monkeypatch, caplog):
    """The engine ends a response at its own limit (the model's context, the embedded engine's batch slot) before
    the tokens asked: logged once, naming the flags; a response that used all its tokens is not."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from slime_lite.rollout import generate as gen
    from slime_lite.types import Sample

    class Cuts:  # FAKE engine client: two tokens, finish "length"
        async def generate(self, body):
            return {"text": "ab", "output_ids": [5, 6], "meta_info": {
                "finish_reason": {"type": "length", "length": 2},
                "output_token_logprobs": [[-0.1, 5, None], [-0.1, 6, None]]}}

    monkeypatch.setattr(gen, "_CUT_WARNED", [])
    args = SimpleNamespace(engine_client=Cuts(), use_rollout_routing_replay=False)
    with caplog.at_level(logging.WARNING, logger="slime_lite.rollout.generate"):
        asyncio.run(gen.default_generate(args, Sample(index=0, tokens=[1, 2]), {"max_new_tokens": 2}))
        assert not caplog.records  # all its tokens: not cut
        for i in range(3):
            asyncio.run(gen.default_generate(args, Sample(index=i, tokens=[1, 2]), {"max_new_tokens": 8}))
    assert len(caplog.records) == 1
    assert "2 of the 8 tokens asked" in caplog.text and "--engine-kv-cache-tokens" in caplog.text


def test_group_rm_scores_each_generated_group_at_once(engine, tiny_model_dir, tmp_path, hooks):
    """--group-rm through the default rollout: the custom reward model gets each prompt's group (as generated, the
    engine's responses) in one call and its rewards land on the samples."""
    hooks("group_rm_hook", """
        CALLS = []

        async def rank(args, samples):
            CALLS.append([s.index for s in samples])
            return [float(s.index % 2) + len(s.response) / 100 for s in samples]
    """)
    import group_rm_hook

    manager = _manager(tiny_model_dir, engine, tmp_path, custom_rm_path="group_rm_hook.rank",
                       group_rm=True)
    samples, _ = manager.generate(0)
    manager.close()
    assert sorted(group_rm_hook.CALLS) == [[0, 1], [2, 3]]  # once per group of --n-samples-per-prompt 2
    assert [s.reward for s in samples] == [s.index % 2 + len(s.response) / 100 for s in samples]


def test_eval_reward_key_picks_the_eval_metrics_scalar_of_a_dict_reward(engine, tiny_model_dir, tmp_path, hooks):
    """--eval-reward-key: the eval sets' metrics read that key of a dict reward; the rollout keeps --reward-key."""
    hooks("dict_rm_hook", """
        SEEN = []

        async def rm(args, sample):
            return {"score": 0.25, "acc": 1.0}

        def log_eval(rollout_id, args, data, extra_metrics):
            SEEN.append(data["held"]["rewards"])
            return False
    """)
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(2)))
    manager = _manager(tiny_model_dir, engine, tmp_path, custom_rm_path="dict_rm_hook.rm", reward_key="score",
                       eval_reward_key="acc", eval_prompt_data=["held", str(held_out)], eval_interval=1,
                       eval_max_response_len=2, custom_eval_rollout_log_function_path="dict_rm_hook.log_eval")
    _, metrics = manager.generate(0)
    out = manager.evaluate(1)
    manager.close()
    assert metrics["rollout/raw_reward"] == 0.25 and out["eval/held"] == 1.0
    import dict_rm_hook

    assert dict_rm_hook.SEEN == [[1.0, 1.0]]  # the eval log hook gets the scalars, as slime gives them


@pytest.mark.parametrize("flags", [{"deterministic_mode": True},  # the wave in one request: still per group
                                   {"over_sampling_batch_size": 8, "rollout_batch_size": 1,
                                    "rollout_max_response_len": 200}])  # groups cut short: not scored
def test_group_rm_gets_whole_groups_in_waves_and_never_a_group_cut_short(engine, tiny_model_dir, tmp_path, hooks,
                                                                         flags):
    hooks("group_rm_whole", """
        CALLS = []

        async def rank(args, samples):
            CALLS.append(sorted(s.index for s in samples))
            return [0.0 for s in samples]
    """)
    import group_rm_whole

    group_rm_whole.CALLS.clear()
    manager = _manager(tiny_model_dir, engine, tmp_path, custom_rm_path="group_rm_whole.rank", group_rm=True,
                       **flags)
    manager.generate(0)
    manager.close()
    assert group_rm_whole.CALLS and all(len(c) == 2 and c[1] == c[0] + 1 for c in group_rm_whole.CALLS)
    if flags.get("deterministic_mode"):
        assert sorted(group_rm_whole.CALLS) == [[0, 1], [2, 3]]


def test_a_nan_eval_reward_stops_the_eval_naming_the_set_after_its_dump(engine, tiny_model_dir, tmp_path, hooks):
    """A reward model answering NaN for the eval samples: the eval set is named (its dump written first, to
    inspect), not logged as a NaN metric."""
    from slime_lite.errors import SlimeLiteError

    hooks("nan_rm_hook", """
        async def rm(args, sample):
            return float("nan") if sample.prompt.startswith(("7+", "8+")) else 1.0
    """)
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in (7, 8)))
    manager = _manager(tiny_model_dir, engine, tmp_path, custom_rm_path="nan_rm_hook.rm",
                       eval_prompt_data=["held", str(held_out)], eval_interval=1, eval_max_response_len=2,
                       save_debug_rollout_data=str(tmp_path / "dumps" / "d_{rollout_id}.pt"))
    try:
        manager.generate(0)  # the rollout's rewards are 1.0
        with pytest.raises(SlimeLiteError, match=r"eval held at rollout 1: samples\[0\]\.reward is nan"):
            manager.evaluate(1)
        manager.wait_dumps()
        assert any("eval" in f.name and "1" in f.name for f in (tmp_path / "dumps").iterdir())
    finally:
        manager.close()


def test_a_failing_hook_cancels_its_groups_other_hooks():
    """One sample's generate hook raising ends the rollout: the group's other hooks are cancelled, not left calling
    the engines after it (gather_or_cancel, used for a group's hooks and an eval's groups)."""
    import asyncio

    from slime_lite.rollout.generate import gather_or_cancel

    events = []

    async def fails():
        await asyncio.sleep(0.01)
        raise RuntimeError("hook failed")

    async def long():
        try:
            await asyncio.sleep(5)
            events.append("finished")
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    async def main():
        with pytest.raises(RuntimeError, match="hook failed"):
            await gather_or_cancel([fails(), long(), long()])
        await asyncio.sleep(0.05)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(main()) == [] and events == ["cancelled", "cancelled"]
    assert asyncio.run(gather_or_cancel_ok()) == [1, 2]


async def gather_or_cancel_ok():
    from slime_lite.rollout.generate import gather_or_cancel

    async def v(x):
        return x

    return await gather_or_cancel(v(x) for x in (1, 2))


def test_get_samples_called_again_numbers_on_so_no_two_prompts_share_sampling_seeds():
    """slime's rollout functions draw prompts in rounds (get_samples in a loop): the sampling seed is the rollout's
    base plus the sample's index, so a second round numbered from 0 again gave its prompts the first round's draws."""
    import types

    from slime_lite.rollout.data import Prompt
    from slime_lite.rollout.functions import DataSource

    prompts = iter(Prompt(i, f"{i}+{i}=", str(2 * i), {}) for i in range(10))
    source = types.SimpleNamespace(next_batch=lambda n: [next(prompts) for _ in range(n)])
    gen = types.SimpleNamespace(encode=lambda p: (p.prompt, [1, 2]),
                                config=types.SimpleNamespace(n_samples_per_prompt=2))
    data = DataSource(gen, source, {})
    groups = data.get_samples(2) + data.get_samples(3)
    assert [g[0].group_index for g in groups] == [0, 1, 2, 3, 4]
    assert [s.index for g in groups for s in g] == list(range(10))
    assert DataSource(gen, source, {}).get_samples(1)[0][0].index == 0  # each rollout's source numbers from 0
