from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch

from slime_lite.errors import DumpError, SlimeLiteError
from slime_lite.rollout.dumps import (
    check_replay_meta,
    check_replay_samples,
    check_rewards,
    check_template,
    dump_path,
    find_dumps,
    load_rollout_dump,
    save_rollout_dump,
    subsample_groups,
)
from slime_lite.types import Sample, Status
from tests.fakes.evil_pickle import Evil


def _samples(n_groups: int = 2, group_size: int = 2) -> list[Sample]:
    out = []
    for g in range(n_groups):
        for j in range(group_size):
            i = g * group_size + j
            out.append(Sample(
                group_index=g, index=i, prompt=[{"role": "user", "content": f"q{g}"}], tokens=[5, 6, 7 + i, 8],
                response=f"r{i}", response_length=2, label=str(g), reward={"acc": float(j), "fmt": 1.0},
                loss_mask=[1, 1], weight_versions=["3"], rollout_log_probs=[-0.5, -0.25 * i],
                status=Status.TRUNCATED if j else Status.COMPLETED,
                metadata={"sampling_params": {"temperature": 1.0, "sampling_seed": i}, "extra": [1, {"a": None}]},
            ))
    return out


def test_round_trip_keeps_every_field_meta_and_extra_keys(tmp_path: Path) -> None:
    path = tmp_path / "d_0.pt"
    samples = _samples()
    samples[0].spec_info.spec_accept_token_num = 4
    samples[1].prefix_cache_info.cached_tokens = 3
    save_rollout_dump(str(path), 0, samples, meta={"n_samples_per_prompt": 2}, note="hello")
    dump = load_rollout_dump(str(path))
    assert dump.rollout_id == 0 and dump.format_version == 1 and dump.path == str(path)
    assert dump.meta == {"n_samples_per_prompt": 2} and dump.extra == {"note": "hello"}
    assert [s.to_dict() for s in dump.samples] == [s.to_dict() for s in samples]
    assert dump.samples[1].status is Status.TRUNCATED
    assert dump.samples[0].spec_info.spec_accept_token_num == 4
    assert dump.samples[1].prefix_cache_info.cached_tokens == 3
    # what slime reads: a plain dict with 'samples', loadable with weights_only=True
    raw = torch.load(path, weights_only=True)
    assert raw["samples"][1]["status"] == "truncated" and isinstance(raw["samples"][0]["spec_info"], dict)


def test_numpy_arrays_of_slime_hooks_are_saved_and_other_objects_name_the_file_sample_and_field(
        tmp_path: Path) -> None:
    """slime's generate keeps rollout_routed_experts as a numpy array: the dump (and a checkpoint's carried samples)
    holds it as a tensor (it was a bare 'can only convert an array of size 1' ValueError in the dump writer).
    A value no weights_only load can read names the dump, the sample and the field."""
    import numpy as np

    samples = _samples(1, 1)
    samples[0].rollout_routed_experts = np.arange(12, dtype=np.int32).reshape(3, 2, 2)
    samples[0].metadata["score"] = np.float32(0.5)
    save_rollout_dump(str(tmp_path / "d_0.pt"), 0, samples)
    loaded = load_rollout_dump(str(tmp_path / "d_0.pt")).samples[0]
    assert torch.equal(loaded.rollout_routed_experts, torch.arange(12, dtype=torch.int32).reshape(3, 2, 2))
    assert loaded.metadata["score"] == 0.5
    samples[0].metadata["handle"] = object()
    with pytest.raises(DumpError, match=r"rollout dump .*d_1\.pt not written: sample 0: metadata: cannot save a "
                                        r"value of type object"):
        save_rollout_dump(str(tmp_path / "d_1.pt"), 1, samples)
    assert not (tmp_path / "d_1.pt").exists()


def test_slime_style_dump_with_missing_and_unknown_keys_loads(tmp_path: Path) -> None:
    path = tmp_path / "slime_3.pt"
    item = {"index": 7, "prompt": "1+1=", "tokens": [1, 2, 3], "response": "2", "response_length": 1,
            "reward": 1.0, "status": "completed", "some_future_field": {"x": 1},
            "prompt_length": 99, "__dict__": {}}  # named like Sample's own attributes: not data, skipped
    torch.save({"rollout_id": 3, "samples": [item]}, path)
    dump = load_rollout_dump(str(path))
    assert dump.meta is None and dump.format_version is None and dump.rollout_id == 3
    s = dump.samples[0]
    assert (s.index, s.prompt, s.tokens, s.reward, s.status) == (7, "1+1=", [1, 2, 3], 1.0, Status.COMPLETED)
    assert s.loss_mask is None and s.metadata == {} and s.group_index is None  # defaults
    assert s.some_future_field == {"x": 1}  # unknown key kept as an attribute
    assert s.prompt_length == 2 and s.response == "2"  # the property, derived from the tokens
    check_replay_meta(dump, {"n_samples_per_prompt": 8, "rollout_batch_size": 4})  # no meta: accepted


def test_a_dump_without_sample_indices_keeps_one_trajectory_a_sample(tmp_path: Path) -> None:
    """slime's Sample.index defaults to None: a replay took every sample of a prompt group for one trajectory split
    into parts (the trainer's steps count trajectories), so it trained the wrong steps or stopped. Numbered by
    position, as a live rollout numbers them; indices that are there and distinct are kept, as are split ones."""
    from slime_lite.types import trajectory_ends

    def saved(name, indices, rollout_ids=(None,) * 4):
        items = [{"index": i, "group_index": k // 2, "tokens": [1, 2], "response_length": 1, "reward": 1.0,
                  "rollout_id": r, "status": "completed"} for k, (i, r) in enumerate(zip(indices, rollout_ids))]
        torch.save({"rollout_id": 0, "samples": items}, tmp_path / name)
        return load_rollout_dump(str(tmp_path / name)).samples

    for indices in ((None,) * 4, (0, 0, 1, 1)):
        got = saved("none.pt", indices)
        assert [s.index for s in got] == [0, 1, 2, 3] and len(trajectory_ends(got)) == 4
    assert [s.index for s in saved("kept.pt", (10, 11, 12, 13))] == [10, 11, 12, 13]
    split = saved("split.pt", (5, 5, 6, 7), rollout_ids=(3, 3, None, None))  # two parts of one trajectory
    assert [s.index for s in split] == [5, 5, 6, 7] and len(trajectory_ends(split)) == 3


class _FailsToPickle(int):
    """An int that fails while torch.save is already writing the file, like a crash mid-save."""

    def __reduce_ex__(self, protocol):  # noqa: ANN001
        raise RuntimeError("disk went away")


def test_failed_save_leaves_old_file_intact_and_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "d_0.pt"
    save_rollout_dump(str(path), 0, _samples(1, 1))
    before = path.read_bytes()
    bad = _samples(1, 1)
    bad[0].metadata["x"] = _FailsToPickle(5)
    with pytest.raises(RuntimeError, match="disk went away"):
        save_rollout_dump(str(path), 0, bad)
    assert path.read_bytes() == before
    assert load_rollout_dump(str(path)).samples[0].metadata.get("x") is None
    assert sorted(os.listdir(tmp_path)) == ["d_0.pt"]



def test_unsafe_pickle_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    path, marker = tmp_path / "evil_0.pt", tmp_path / "marker"
    torch.save({"rollout_id": 0, "samples": [Evil(str(marker))]}, path)
    with pytest.raises(DumpError, match=r"evil_0\.pt is not a plain-tensor file.*write_marker.*nothing in it ran"):
        load_rollout_dump(str(path))
    assert not marker.exists()
    # the file really would run code with an unsafe load, so the refusal above is what protected us
    torch.load(path, weights_only=False)
    assert marker.read_text() == "code ran"


def test_truncated_empty_missing_and_wrong_schema_files_name_the_file(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    save_rollout_dump(str(good), 0, _samples())
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DumpError, match=r"truncated\.pt is truncated"):
        load_rollout_dump(str(truncated))
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(DumpError, match=r"empty\.pt is empty"):
        load_rollout_dump(str(empty))
    with pytest.raises(DumpError, match=r"missing\.pt does not exist"):
        load_rollout_dump(str(tmp_path / "missing.pt"))
    cases = {
        "list.pt": [1, 2],
        "nosamples.pt": {"rollout_id": 0},
        "notdict.pt": {"samples": [3]},
        "badlen.pt": {"samples": [{"tokens": [1, 2], "response_length": 1, "rollout_log_probs": [0.0, 0.0]}]},
    }
    for name, payload in cases.items():
        torch.save(payload, tmp_path / name)
        with pytest.raises(DumpError, match=name.replace(".", r"\.")):
            load_rollout_dump(str(tmp_path / name))


def test_subsample_keeps_head_and_tail_whole_groups_at_least_one() -> None:
    samples = _samples(n_groups=10, group_size=4)
    kept = subsample_groups(samples, 0.4, 4)
    assert [s.group_index for s in kept[::4]] == [0, 1, 8, 9]
    assert all(kept[i].group_index == kept[i + 3].group_index for i in range(0, len(kept), 4))
    assert subsample_groups(samples, 0.5, 4) == subsample_groups(samples, 0.5, 4)  # deterministic
    assert [s.index for s in subsample_groups(samples, 0.01, 4)] == [0, 1, 2, 3]
    assert subsample_groups(samples, 1.0, 4) == samples
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(SlimeLiteError, match="subsample"):
            subsample_groups(samples, bad, 4)


def test_templates_eval_naming_and_find_dumps(tmp_path: Path) -> None:
    template = str(tmp_path / "data_{rollout_id}.pt")
    assert dump_path(template, 3).endswith("data_3.pt")
    assert dump_path(template, 3, evaluation=True).endswith("data_eval_3.pt")
    with pytest.raises(SlimeLiteError, match="rollout_id"):
        check_template(str(tmp_path / "data.pt"), "--save-debug-rollout-data")
    for rid, ev in ((0, False), (0, True), (2, False), (12, True)):
        save_rollout_dump(dump_path(template, rid, ev), rid, _samples(1, 1))
    assert find_dumps(template) == [
        ("train", 0, dump_path(template, 0)),
        ("eval", 0, dump_path(template, 0, True)),
        ("train", 2, dump_path(template, 2)),
        ("eval", 12, dump_path(template, 12, True)),
    ]


def test_find_dumps_finds_the_eval_dump_of_every_eval_set(tmp_path: Path) -> None:
    """With several --eval-prompt-data sets the manager writes one eval dump per set, data_eval_<i>_<name>.pt:
    display-rollouts and send-to-engine --eval find them (not only a single set's data_eval_<i>.pt)."""
    template = str(tmp_path / "data_{rollout_id}.pt")
    save_rollout_dump(dump_path(template, 1), 1, _samples(1, 1))
    root, ext = os.path.splitext(dump_path(template, 1, evaluation=True))
    for name in ("math", "aime"):  # as RolloutManager.evaluate names them
        save_rollout_dump(f"{root}_{name}{ext}", 1, _samples(1, 1), eval_name=name)
    save_rollout_dump(dump_path(template, 12, evaluation=True), 12, _samples(1, 1))
    assert find_dumps(template) == [
        ("train", 1, dump_path(template, 1)),
        ("eval", 1, f"{root}_aime{ext}"),
        ("eval", 1, f"{root}_math{ext}"),
        ("eval", 12, dump_path(template, 12, True)),
    ]


def test_check_replay_meta_names_both_values(tmp_path: Path) -> None:
    path = tmp_path / "d_0.pt"
    save_rollout_dump(str(path), 0, _samples(), meta={"n_samples_per_prompt": 2, "rollout_batch_size": 1,
                                                       "tokenizer_fingerprint": "abc"})
    dump = load_rollout_dump(str(path))
    check_replay_meta(dump, {"n_samples_per_prompt": 2, "rollout_batch_size": 1, "tokenizer_fingerprint": "abc"})
    with pytest.raises(DumpError, match=r"n_samples_per_prompt=2.*--n-samples-per-prompt = 4"):
        check_replay_meta(dump, {"n_samples_per_prompt": 4})
    with pytest.raises(DumpError, match=r"'abc'.*'xyz'"):
        check_replay_meta(dump, {"tokenizer_fingerprint": "xyz"})


def _raw(**changes) -> dict:
    """The raw dict of a good sample (response of 2 tokens), with ``changes`` applied (None deletes a key)."""
    item = _samples(1, 1)[0].to_dict()
    for key, value in changes.items():
        item[key] = value
    return item


# (case, fields of the second sample, what the error names after 'samples[1].')
MALFORMED = [
    ("tokens-str", {"tokens": "5 6 7 8"}, r"tokens: expected a list of token ids, got str"),
    ("token-float", {"tokens": [5, 6, 7.5, 8]}, r"tokens\[2\]: 7\.5 is not a token id"),
    ("token-negative", {"tokens": [5, -6, 7, 8]}, r"tokens\[1\]: -6 is not a token id"),
    ("length-str", {"response_length": "2"}, r"response_length: '2' is not a non-negative int"),
    ("length-negative", {"response_length": -3, "loss_mask": None, "rollout_log_probs": None},
     r"response_length: -3 is not a non-negative int"),
    ("length-too-long", {"response_length": 9, "loss_mask": None, "rollout_log_probs": None},
     r"response_length: 9 is more than len\(tokens\) = 4"),
    ("mask-length", {"loss_mask": [1, 1, 1]}, r"loss_mask: has 3 entries but response_length is 2"),
    ("mask-type", {"loss_mask": "11"}, r"loss_mask: expected a list of numbers or None, got str"),
    # a hook's sample of response only: the trainer failed on it mid-step, naming its place in a micro-batch
    ("no-prompt", {"tokens": [5, 6]}, r"response_length: 2 is all of tokens: a sample needs at least one prompt"),
    ("logprobs-length", {"rollout_log_probs": [-0.1]}, r"rollout_log_probs: has 1 entries but response_length is 2"),
    ("logprobs-item", {"rollout_log_probs": [-0.1, "x"]}, r"rollout_log_probs\[1\]: 'x' is not a number"),
    ("reward-str", {"reward": "high"}, r"reward: expected a number, a dict or None, got str 'high'"),
    ("index-str", {"index": "1"}, r"index: expected an int or None, got str '1'"),
    ("status", {"status": "done"}, r"status: 'done' is not one of pending, completed"),
    ("token-versions", {"metadata": {"token_weight_versions": [3]}},
     r"metadata\['token_weight_versions'\]: expected one int weight version per response token \(2\)"),
    ("token-version-str", {"metadata": {"token_weight_versions": [3, "4"]}}, r"metadata\['token_weight_versions'\]"),
    # these passed the check and failed later with a bare traceback (after Ray had started, for weight_versions)
    ("weight-versions-int", {"weight_versions": 3}, r"weight_versions: expected a list .*got 3"),
    ("prefix-cache-str", {"prefix_cache_info": "x"}, r"prefix_cache_info: expected a dict, got str 'x'"),
    ("spec-info-int", {"spec_info": 5}, r"spec_info: expected a dict, got int 5"),
    # a multi-turn record the tools and the rollout's metrics read (a hook's own turn count under the same key)
    ("turns-int", {"metadata": {"turns": 3}}, r"metadata\['turns'\]: expected a list of turns"),
    ("turns-outside", {"metadata": {"turns": [{"start": 1, "length": 5, "source": "model"}]}},
     r"metadata\['turns'\]\[0\]: start 1 and length 5 must be non-negative ints inside the 2 response tokens"),
    ("turns-source", {"metadata": {"turns": [{"start": 0, "length": 2, "source": "bot"}]}},
     r"metadata\['turns'\]\[0\]\.source: 'bot' is not one of model, tool"),
]


@pytest.mark.parametrize("case,fields,needle", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_sample_names_file_sample_and_field(tmp_path: Path, case: str, fields: dict, needle: str) -> None:
    path = tmp_path / f"{case}_0.pt"
    torch.save({"rollout_id": 0, "samples": [_raw(), _raw(**fields)]}, path)
    with pytest.raises(DumpError, match=rf"rollout dump .*{case}_0\.pt: samples\[1\]\.{needle}"):
        load_rollout_dump(str(path))


def test_text_file_named_pt_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "notes_0.pt"
    path.write_text("these are my notes, not a dump\n")
    with pytest.raises(DumpError, match=r"notes_0\.pt is not a torch file \(corrupt, or another format: it starts with b'these are my'\)"):
        load_rollout_dump(str(path))


def test_slime_dump_with_tensor_tokens_loads(tmp_path: Path) -> None:
    path = tmp_path / "t_0.pt"
    torch.save({"samples": [_raw(tokens=torch.tensor([5, 6, 7, 8]), loss_mask=torch.ones(2),
                                 rollout_log_probs=torch.tensor([-0.5, -0.25]))]}, path)
    sample = load_rollout_dump(str(path)).samples[0]
    assert sample.response_length == 2
    # lists, as every reader (display-rollouts' stats, diff, explain, replay) takes them
    assert sample.tokens == [5, 6, 7, 8] and sample.loss_mask == [1.0, 1.0]
    assert sample.rollout_log_probs == [-0.5, -0.25]
    from slime_lite.rollout.stats import _sample_logprob_mean

    assert _sample_logprob_mean(sample) == -0.375


def test_a_slime_moe_dump_with_numpy_routed_experts_loads_and_other_objects_stay_refused(tmp_path: Path) -> None:
    """slime keeps a sample's routed experts as a numpy array (np.frombuffer of the engine's table): the numeric
    array loads, as a tensor; a numpy object array (which could name any class) is still refused; metadata null is
    read as no metadata."""
    import numpy as np

    path = tmp_path / "moe_0.pt"
    table = np.arange(3 * 2 * 2, dtype=np.int32).reshape(3, 2, 2)
    torch.save({"samples": [_raw(tokens=[5, 6, 7, 8], rollout_routed_experts=table, metadata=None)]}, path)
    sample = load_rollout_dump(str(path)).samples[0]
    assert torch.equal(torch.as_tensor(sample.rollout_routed_experts), torch.from_numpy(table))
    assert sample.metadata == {}
    for dtype in (np.uint16, np.uint32):  # unsigned expert ids read as int64 (torch has few uint ops: min() fails)
        torch.save({"samples": [_raw(tokens=[5, 6, 7, 8], rollout_routed_experts=table.astype(dtype))]}, path)
        got = load_rollout_dump(str(path)).samples[0].rollout_routed_experts
        assert got.dtype == torch.int64 and torch.equal(got, torch.from_numpy(table).long()) and int(got.min()) == 0
    torch.save({"samples": [_raw(tokens=[5, 6, 7, 8], rollout_routed_experts=np.array([Status.COMPLETED]))]}, path)
    with pytest.raises(DumpError, match="is not a plain-tensor file"):
        load_rollout_dump(str(path))
    # numpy 1 names its rebuild function numpy.core.multiarray._reconstruct; a big-endian table reads the same
    torch.save({"samples": [_raw(tokens=[5, 6, 7, 8], rollout_routed_experts=table.astype(">i4"))]}, path)
    with zipfile.ZipFile(path) as z:
        files = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in files if n.endswith("data.pkl"))
    files[pkl] = files[pkl].replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    assert torch.equal(torch.as_tensor(load_rollout_dump(str(path)).samples[0].rollout_routed_experts),
                       torch.from_numpy(table))
    torch.save({"samples": [_raw(tokens=[5, 6, 7, 8], metadata=[1])]}, path)
    with pytest.raises(DumpError, match=r"samples\[0\]\.metadata: expected a dict or None, got list"):
        load_rollout_dump(str(path))


def test_replay_checks_vocab_samples_and_rewards(tmp_path: Path) -> None:
    path = tmp_path / "r_0.pt"
    save_rollout_dump(str(path), 0, _samples())
    check_replay_samples(load_rollout_dump(str(path)), vocab_size=11, reward_key="acc")  # tokens < 11: fine
    with pytest.raises(DumpError, match=r"r_0\.pt: samples\[3\]\.tokens\[2\] = 10 is not below the model's vocab "
                                        r"size 10"):
        check_replay_samples(load_rollout_dump(str(path)), vocab_size=10, reward_key="acc")
    with pytest.raises(DumpError, match=r"r_0\.pt: samples\[0\]\.reward: .*pass --reward-key"):
        check_replay_samples(load_rollout_dump(str(path)), vocab_size=11, reward_key=None)
    for bad in (float("nan"), float("inf"), -float("inf")):
        samples = _samples()
        samples[2].reward = {"acc": bad}
        save_rollout_dump(str(path), 0, samples)
        with pytest.raises(SlimeLiteError, match=rf"r_0\.pt: samples\[2\]\.reward is {bad} \(sample index 2, "
                                                 r"prompt group 1\)\. Rewards must be finite"):
            check_replay_samples(load_rollout_dump(str(path)), vocab_size=11, reward_key="acc")
    samples = _samples()
    samples[1].loss_mask, samples[1].rollout_log_probs = [1, 0], [-0.5, float("nan")]  # masked: NaN x 0 is NaN
    save_rollout_dump(str(path), 0, samples)
    with pytest.raises(DumpError, match=r"r_0\.pt: samples\[1\]\.rollout_log_probs\[1\] = nan is not finite"):
        check_replay_samples(load_rollout_dump(str(path)), vocab_size=11, reward_key="acc")
    torch.save({"rollout_id": 0, "samples": []}, path)
    with pytest.raises(DumpError, match=r"r_0\.pt has no samples"):
        check_replay_samples(load_rollout_dump(str(path)), vocab_size=11, reward_key="acc")


def test_generated_rollout_with_nan_reward_stops_but_missing_rewards_are_left_to_the_trainer() -> None:
    samples = _samples()
    samples[1].reward = None  # e.g. an aborted sample: the trainer reports it if it is trained on
    check_rewards(samples, "acc", "rollout 4", strict=False)
    samples[3].reward = {"acc": float("nan")}
    with pytest.raises(SlimeLiteError, match=r"rollout 4: samples\[3\]\.reward is nan"):
        check_rewards(samples, "acc", "rollout 4", strict=False)
