"""slime's hooks around a rollout's end, its logging and its training data: --rollout-sample-filter-path,
--rollout-all-samples-process-path, --custom-reward-post-process-path, --custom-rollout-log-function-path,
--custom-eval-rollout-log-function-path (slime's signatures, checked before Ray starts, called where slime calls
them), run by the rollout manager against a real in-process embedded engine (no Ray); and
--custom-convert-samples-to-train-data-path, refused with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_lite.args import parser_defaults
from slime_lite.errors import SlimeLiteError
from slime_lite.preflight import check_hooks
from slime_lite.types import POST_PROCESSED_REWARD
from tests.rollout.test_functions import engine, hooks  # noqa: F401 - the shared fixtures


def _prompts(tmp_path: Path, n: int = 4, name: str = "prompts.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(n)))
    return str(path)


def _manager(tiny_model_dir, engine, tmp_path, **flags):
    from slime_lite.rollout.manager import RolloutManager

    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), prompt_data=_prompts(tmp_path), rm_type="addition",
                           rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=4, **flags)
    return RolloutManager(args, [engine.url] if engine is not None else [])


@pytest.mark.parametrize("flag, shown", [
    ("--rollout-sample-filter-path", r"filter\(args, samples\) -> None"),
    ("--rollout-all-samples-process-path", r"process\(args, all_samples, data_source\) -> None"),
    ("--custom-reward-post-process-path", r"post_process\(args, samples\) -> \(raw_rewards, rewards\)"),
    ("--custom-rollout-log-function-path",
     r"log_rollout_data\(rollout_id, args, samples, rollout_extra_metrics, rollout_time\) -> bool"),
    ("--custom-eval-rollout-log-function-path", r"log_eval_rollout_data\(rollout_id, args, data, extra_metrics\)"),
])
def test_a_hook_with_the_wrong_signature_or_module_is_refused_before_ray_starts(tmp_path, hooks, flag, shown):
    hooks("one_arg_hooks", """
        def one(x):
            pass
    """)
    dest = flag[2:].replace("-", "_")
    args = parser_defaults(prompt_data=_prompts(tmp_path), **{dest: "one_arg_hooks.one"})
    with pytest.raises(SlimeLiteError, match=rf"{flag} 'one_arg_hooks.one': .* cannot be called as {shown}"):
        check_hooks(args)
    args = parser_defaults(prompt_data=_prompts(tmp_path), **{dest: "no_such_hooks.fn"})
    with pytest.raises(SlimeLiteError, match=rf"{flag} 'no_such_hooks.fn': cannot import module 'no_such_hooks'"):
        check_hooks(args)


def test_a_replay_checks_the_hooks_its_rollout_manager_calls(tmp_path, hooks):
    hooks("replay_hooks", """
        def one(x):
            pass
    """)
    replay = {"load_debug_rollout_data": str(tmp_path / "d_{rollout_id}.pt"), "debug_train_only": True}
    check_hooks(parser_defaults(rollout_sample_filter_path="replay_hooks.one", **replay))  # never called: no check
    with pytest.raises(SlimeLiteError, match="--custom-reward-post-process-path 'replay_hooks.one'"):
        check_hooks(parser_defaults(custom_reward_post_process_path="replay_hooks.one", **replay))


def test_sample_filter_and_all_samples_hooks_run_at_the_end_of_the_default_rollout(
        tiny_model_dir, engine, tmp_path, hooks):
    """The filter gets the kept groups and marks a sample removed: it trains with loss mask 0 (and the dump holds
    that); the all-samples hook then gets every group that came back, the dynamic filter's drop included, and the
    data source."""
    hooks("end_hooks", """
        SEEN = {}

        def drop_prompt_0(args, samples):
            return samples[0].metadata["prompt_index"] != 0

        def remove_first(args, samples):
            SEEN["filter"] = [[s.index for s in g] for g in samples]
            for group in samples:
                group[0].remove_sample = True

        async def process(args, all_samples, data_source):
            SEEN["all"] = [g[0].metadata["prompt_index"] for g in all_samples]
            SEEN["source"] = data_source.__name__
    """)
    import end_hooks

    manager = _manager(tiny_model_dir, engine, tmp_path, dynamic_sampling_filter_path="end_hooks.drop_prompt_0",
                       rollout_sample_filter_path="end_hooks.remove_first",
                       rollout_all_samples_process_path="end_hooks.process",
                       save_debug_rollout_data=str(tmp_path / "d_{rollout_id}.pt"))
    samples, _ = manager.generate(0)
    manager.close()
    assert end_hooks.SEEN["filter"] == [[0, 1], [2, 3]]
    assert [s.loss_mask == [0] * s.response_length for s in samples] == [True, False, True, False]
    assert all(s.response_length and any(s.loss_mask) for s in samples[1::2])
    trained = {s.metadata["prompt_index"] for s in samples}
    assert 0 not in trained and 0 in end_hooks.SEEN["all"] and trained <= set(end_hooks.SEEN["all"])
    assert end_hooks.SEEN["all"] == sorted(end_hooks.SEEN["all"]) and end_hooks.SEEN["source"] == "get_samples"
    from slime_lite.rollout.dumps import load_rollout_dump

    dumped = load_rollout_dump(str(tmp_path / "d_0.pt")).samples
    assert [s.remove_sample for s in dumped] == [True, False, True, False] and not any(dumped[0].loss_mask)


def test_a_reward_post_process_hook_gives_the_rewards_the_estimator_trains_on(tiny_model_dir, engine, tmp_path, hooks):
    """Called with the rollout's samples after logging (not without a trainer); its rewards are kept per sample and
    logged; GRPO then takes them as they are (no group normalisation on top)."""
    hooks("post_hooks", """
        CALLS = []

        def post_process(args, samples):
            CALLS.append(len(samples))
            raw = [s.get_reward_value(args) for s in samples]
            return raw, [float(s.index) for s in samples]

        def wrong_length(args, samples):
            return [0.0], [0.0]
    """)
    import post_hooks
    from slime_lite import rl_math

    manager = _manager(tiny_model_dir, engine, tmp_path, custom_reward_post_process_path="post_hooks.post_process")
    samples, metrics = manager.generate(0)
    assert post_hooks.CALLS == [4]
    assert [s.metadata[POST_PROCESSED_REWARD] for s in samples] == [0.0, 1.0, 2.0, 3.0]
    assert metrics["rollout/rewards"] == 1.5
    assert metrics["rollout/raw_reward"] == pytest.approx(sum(s.reward for s in samples) / 4)
    rollout_only = _manager(tiny_model_dir, engine, tmp_path, custom_reward_post_process_path="post_hooks.post_process",
                            debug_rollout_only=True)
    rollout_only.generate(0)
    assert post_hooks.CALLS == [4]  # as slime: no training data without a trainer
    bad = _manager(tiny_model_dir, engine, tmp_path, custom_reward_post_process_path="post_hooks.wrong_length")
    with pytest.raises(SlimeLiteError, match="--custom-reward-post-process-path returned 1 raw_rewards for the "
                                             "rollout's 4 samples"):
        bad.generate(0)
    for m in (manager, rollout_only, bad):
        m.close()

    import torch

    from slime_lite.backends.megatron import batch

    assert batch.post_processed_rewards(samples) == [0.0, 1.0, 2.0, 3.0]  # what the train actor reads
    samples[0].metadata.pop(POST_PROCESSED_REWARD)
    with pytest.raises(SlimeLiteError, match="sample 0 has no metadata"):
        batch.post_processed_rewards(samples)
    logp = [torch.zeros(2) for _ in range(4)]
    masks = [torch.ones(2) for _ in range(4)]
    for estimator in ("grpo", "reinforce_plus_plus_baseline"):
        adv, _ = rl_math.compute_advantages_and_returns(estimator, [0.0, 1.0, 2.0, 3.0], logp, None, None, masks,
                                                        group_size=2, rewards_normalized=True)
        per_sample = [float(a[0]) for a in adv]
        if estimator == "grpo":
            assert per_sample == [0.0, 1.0, 2.0, 3.0]
        else:  # whitened over the batch, not centred per group first
            assert per_sample[1] < per_sample[2]


def test_custom_log_hooks_take_over_the_default_logging_when_they_return_true(
        tiny_model_dir, engine, tmp_path, hooks):
    hooks("log_hooks", """
        CALLS = []

        def log_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
            CALLS.append(("rollout", rollout_id, len(samples), type(rollout_extra_metrics).__name__,
                          rollout_time > 0))
            return args.rollout_seed == 1

        def log_eval(rollout_id, args, data, extra_metrics):
            CALLS.append(("eval", rollout_id, sorted(data), len(data["held"]["samples"])))
            return True
    """)
    import log_hooks

    held_out = _prompts(tmp_path, 2, "eval.jsonl")
    common = {"custom_rollout_log_function_path": "log_hooks.log_rollout",
              "custom_eval_rollout_log_function_path": "log_hooks.log_eval",
              "eval_prompt_data": ["held", held_out], "eval_max_response_len": 2}
    kept = _manager(tiny_model_dir, engine, tmp_path, **common)
    _, metrics = kept.generate(3)
    assert "rollout/raw_reward" in metrics and "rollout/response_len/mean" in metrics  # False: default logging too
    assert kept.evaluate(3) == {}
    taken = _manager(tiny_model_dir, engine, tmp_path, rollout_seed=1, **common)
    _, metrics = taken.generate(4)
    kept.close(), taken.close()
    assert "rollout/raw_reward" not in metrics and "rollout/response_len/mean" not in metrics
    assert "rollout/weight_version" in metrics and "perf/rollout_time" in metrics  # what the run's checks read
    assert log_hooks.CALLS == [("rollout", 3, 4, "dict", True), ("eval", 3, ["held"], 2),
                               ("rollout", 4, 4, "dict", True)]


def test_fully_async_refuses_the_default_rollouts_end_hooks():
    from slime_lite.args_async import check_fully_async

    args = parser_defaults(fully_async=True, rollout_sample_filter_path="m.f")
    with pytest.raises(SlimeLiteError, match="--fully-async: --rollout-sample-filter-path and "
                                             "--rollout-all-samples-process-path are called by the default rollout"):
        check_fully_async(args)


def test_convert_samples_to_train_data_is_refused_with_its_reason():
    from slime_lite.slime_flags import refused

    lines = refused(parser_defaults(custom_convert_samples_to_train_data_path="m.convert"))
    assert len(lines) == 1 and lines[0].startswith("--custom-convert-samples-to-train-data-path: not supported yet")
    assert "takes the Samples themselves" in lines[0]
