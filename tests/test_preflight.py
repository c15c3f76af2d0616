"""Before Ray starts: every output location is created and writable, every dump of a replay is valid."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from slime_lite.args import parse_args
from slime_lite.errors import SlimeLiteError
from slime_lite.preflight import check_outputs, preflight
from slime_lite.rollout.dumps import make_meta, save_rollout_dump
from slime_lite.types import Sample, Status

RUN = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "3"]


def _samples(vocab_ok: bool = True) -> list[Sample]:
    return [Sample(group_index=i // 2, index=i, prompt="1+1=", tokens=[5, 6, 7, 8 if vocab_ok else 5000],
                   response_length=2, reward=float(i % 2), loss_mask=[1, 1], rollout_log_probs=[-0.5, -0.5],
                   status=Status.COMPLETED) for i in range(4)]


@pytest.fixture
def replay(tiny_model_dir, tmp_path) -> str:
    """Three good dumps of 2 prompts x 2 samples, made for the tiny model; returns the template."""
    from slime_lite.tokenizer import load_tokenizer, tokenizer_fingerprint

    meta_args = type("A", (), {"n_samples_per_prompt": 2, "rollout_batch_size": 2,
                               "hf_checkpoint": str(tiny_model_dir)})
    meta = make_meta(meta_args, tokenizer_fingerprint(load_tokenizer(str(tiny_model_dir))))
    for rid in range(3):
        save_rollout_dump(str(tmp_path / f"d_{rid}.pt"), rid, _samples(), meta)
    return str(tmp_path / "d_{rollout_id}.pt")


def _args(model, template: str, *extra: str):
    return parse_args(["--load-debug-rollout-data", template, "--hf-checkpoint", str(model), *RUN, *extra])


def test_good_replay_passes(tiny_model_dir, replay) -> None:
    preflight(_args(tiny_model_dir, replay))


def test_a_replay_never_overwrites_a_train_dump_already_there(tiny_model_dir, replay, tmp_path) -> None:
    """The original run's train dumps (train_data/ beside the rollout dumps replayed) are what a replay is compared
    against: a replay whose --save-debug-train-data names them is refused before Ray starts; a fresh path passes."""
    train = str(tmp_path / "train_data" / "{rollout_id}_{rank}.pt")
    preflight(_args(tiny_model_dir, replay, "--save-debug-train-data", train))  # nothing there yet
    (tmp_path / "train_data").mkdir(exist_ok=True)
    (tmp_path / "train_data" / "2_0.pt").write_bytes(b"the original run's")
    with pytest.raises(SlimeLiteError, match=r"--save-debug-train-data .*: the replay would overwrite the train dump "
                                             r".*2_0\.pt \(rollout 2, rank 0\)"):
        preflight(_args(tiny_model_dir, replay, "--save-debug-train-data", train))
    assert (tmp_path / "train_data" / "2_0.pt").read_bytes() == b"the original run's"
    fresh = str(tmp_path / "replay" / "{rollout_id}_{rank}.pt")
    preflight(_args(tiny_model_dir, replay, "--save-debug-train-data", fresh))


@pytest.mark.parametrize("rollout", [1, 2])
def test_every_dump_of_the_replay_is_checked_not_only_the_first(tiny_model_dir, replay, tmp_path, rollout) -> None:
    bad = _samples()
    bad[3].reward = float("nan")
    save_rollout_dump(str(tmp_path / f"d_{rollout}.pt"), rollout, bad)
    with pytest.raises(SlimeLiteError, match=rf"d_{rollout}\.pt: samples\[3\]\.reward is nan"):
        preflight(_args(tiny_model_dir, replay))


def test_out_of_vocab_missing_and_empty_dumps(tiny_model_dir, replay, tmp_path) -> None:
    save_rollout_dump(str(tmp_path / "d_1.pt"), 1, _samples(vocab_ok=False))
    with pytest.raises(SlimeLiteError, match=r"d_1\.pt: samples\[0\]\.tokens\[3\] = 5000 is not below the model's "
                                             r"vocab size"):
        preflight(_args(tiny_model_dir, replay))
    torch.save({"rollout_id": 1, "samples": []}, tmp_path / "d_1.pt")
    with pytest.raises(SlimeLiteError, match=r"d_1\.pt has no samples"):
        preflight(_args(tiny_model_dir, replay))
    (tmp_path / "d_1.pt").unlink()
    with pytest.raises(SlimeLiteError, match=r"d_1\.pt does not exist"):
        preflight(_args(tiny_model_dir, replay))
    preflight(_args(tiny_model_dir, replay, "--num-rollout", "1"))  # a replay of rollout 0 only never reads it


def test_a_resumed_replay_checks_the_dumps_it_will_read(tiny_model_dir, replay, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "iter_0000000").mkdir()
    torch.save({"model": {}}, ckpt / "iter_0000000" / "rank_000.pt")  # (a folder without one is refused)
    (ckpt / "latest").write_text("iter_0000000")
    (tmp_path / "d_0.pt").write_text("rollout 0 is done; this file is never read again")
    preflight(_args(tiny_model_dir, replay, "--load", str(ckpt)))
    (tmp_path / "d_2.pt").write_text("not a dump")
    with pytest.raises(SlimeLiteError, match=r"d_2\.pt is not a torch file"):
        preflight(_args(tiny_model_dir, replay, "--load", str(ckpt)))


def test_sample_count_must_split_into_the_run_steps(tiny_model_dir, replay, tmp_path) -> None:
    save_rollout_dump(str(tmp_path / "d_2.pt"), 2, _samples()[:3])  # slime dump: no meta to compare
    with pytest.raises(SlimeLiteError, match=r"d_2\.pt does not fit this run \(1 setting\(s\)\): its 3 samples do "
                                             r"not split into steps of --global-batch-size 4"):
        preflight(_args(tiny_model_dir, replay))


def test_a_group_estimator_refuses_a_dump_whose_prompt_groups_are_not_its_groups(tiny_model_dir, replay,
                                                                                  tmp_path) -> None:
    """GRPO normalises the --n-samples-per-prompt adjacent samples as one prompt's: a dump of split trajectories
    (groups of 3 and 1; a rollout is dumped before its groups are checked, or made with a per-sample estimator)
    would be trained with prompts mixed. A generated rollout is refused so; a replay too. slime's dumps (no meta)
    are taken on trust, as their settings are."""
    meta = {"n_samples_per_prompt": 2, "rollout_batch_size": 2}
    split = _samples()
    for s, group in zip(split, (0, 0, 0, 1)):
        s.group_index = group
    save_rollout_dump(str(tmp_path / "d_1.pt"), 1, split, meta)
    with pytest.raises(SlimeLiteError, match=r"d_1\.pt does not fit this run \(1 setting\(s\)\): its prompt group 0 "
                                             r"has 3 trajectories, but --advantage-estimator grpo compares"):
        preflight(_args(tiny_model_dir, replay))
    preflight(_args(tiny_model_dir, replay, "--advantage-estimator", "reinforce_plus_plus"))  # per sample
    save_rollout_dump(str(tmp_path / "d_1.pt"), 1, split)  # slime's: no meta
    preflight(_args(tiny_model_dir, replay))
    for s, group in zip(split, (0, 1, 0, 1)):  # right sizes, not adjacent
        s.group_index = group
    save_rollout_dump(str(tmp_path / "d_1.pt"), 1, split, meta)
    with pytest.raises(SlimeLiteError, match=r"the samples of its prompt group 0 are apart"):
        preflight(_args(tiny_model_dir, replay))
    for s in split:  # no group indices: positions only, as the trainer reads them
        s.group_index = None
    save_rollout_dump(str(tmp_path / "d_1.pt"), 1, split, meta)
    preflight(_args(tiny_model_dir, replay))


def test_a_dump_of_split_trajectories_replays_under_a_group_estimator(tiny_model_dir, replay, tmp_path) -> None:
    """Samples that share a rollout_id are one trajectory's parts: a dump whose groups hold 2 trajectories each, in
    4 samples, replays under GRPO (the manager normalises the groups over their trajectories); the same samples
    with rollout_ids of their own are 4 trajectories a group and refused."""
    from slime_lite.rollout.dumps import make_meta
    from slime_lite.tokenizer import load_tokenizer, tokenizer_fingerprint

    meta_args = type("A", (), {"n_samples_per_prompt": 2, "rollout_batch_size": 2,
                               "hf_checkpoint": str(tiny_model_dir)})
    meta = make_meta(meta_args, tokenizer_fingerprint(load_tokenizer(str(tiny_model_dir))))
    samples = _samples() + _samples()
    for i, (s, rid) in enumerate(zip(samples, (50, 50, 51, 51, 60, 60, 60, None))):
        s.index, s.group_index, s.rollout_id = i, i // 4, rid
    save_rollout_dump(str(tmp_path / "d_1.pt"), 1, samples, meta)
    preflight(_args(tiny_model_dir, replay))
    # 7 samples, not whole steps of --global-batch-size 4: a split dump replays (the trainer trims it as it did live)
    save_rollout_dump(str(tmp_path / "d_1.pt"), 1, samples[:3] + samples[4:], meta)
    preflight(_args(tiny_model_dir, replay))
    for s in samples:
        s.rollout_id = None
    save_rollout_dump(str(tmp_path / "d_1.pt"), 1, samples, meta)
    with pytest.raises(SlimeLiteError, match=r"its prompt group 0 has 4 trajectories"):
        preflight(_args(tiny_model_dir, replay))


def test_train_only_without_dumps_is_refused_before_ray(tiny_model_dir, tmp_path) -> None:
    """--debug-train-only starts no engine: without dumps it built the trainer and stopped at rollout 0 with 'no
    engines to generate from'. No output folder is created for the refused run."""
    args = parse_args(["--hf-checkpoint", str(tiny_model_dir), *RUN, "--debug-train-only", "--save",
                       str(tmp_path / "ckpt")])
    with pytest.raises(SlimeLiteError, match=r"--debug-train-only starts no engine, so there is nothing to train on "
                                             r".*add --load-debug-rollout-data"):
        preflight(args)
    assert not (tmp_path / "ckpt").exists()


def test_a_config_field_the_trainer_cannot_build_is_refused_before_ray(tiny_model_dir, replay, tmp_path) -> None:
    """Not only when a train worker builds the model: an MLP bias (which Megatron's linears would drop) is named
    before Ray starts; a rollout-only run, which builds no trainer, is not refused for it."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "mlp_bias": True}))
    preflight(_args(model, replay))  # Qwen2's MLP has no bias whatever the key says (transformers ignores it)
    (model / "config.json").write_text(json.dumps({**cfg, "mlp_bias": True, "model_type": "llama",
                                                   "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(SlimeLiteError, match=r"--hf-checkpoint .*config\.json sets attention_bias/mlp_bias"):
        preflight(_args(model, replay))
    from slime_lite.preflight import check_model_family

    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    check_model_family(parse_args(["--hf-checkpoint", str(model), *RUN, "--debug-rollout-only",
                                   "--prompt-data", str(tmp_path / "p.jsonl"), "--rm-type", "addition"]))


def test_every_mismatched_setting_is_named_at_once(tiny_model_dir, replay, tmp_path) -> None:
    """A dump made with other --n-samples-per-prompt and --rollout-batch-size, whose samples do not split into this
    run's steps: one error names all three (not one per try)."""
    save_rollout_dump(str(tmp_path / "d_2.pt"), 2, _samples()[:3],
                      meta={"n_samples_per_prompt": 3, "rollout_batch_size": 3})
    with pytest.raises(SlimeLiteError, match=r"\(3 setting\(s\)\): n_samples_per_prompt=3 in the dump, "
                                             r"--n-samples-per-prompt = 2 in this run; rollout_batch_size=3 in the "
                                             r"dump, --rollout-batch-size = 2 in this run; its 3 samples"):
        preflight(_args(tiny_model_dir, replay))


@pytest.mark.parametrize("flag,value,problem", [
    ("--save", "blocker/ckpt", "cannot create the folder {t}/blocker/ckpt (Not a directory)"),
    ("--metrics-path", "blocker/m.jsonl", "{t}/blocker exists but is not a folder"),
    ("--dump-details", "blocker", "{t}/blocker exists but is not a folder"),
    ("--tensorboard-dir", "blocker/tb", "cannot create the folder {t}/blocker/tb (Not a directory)"),
])
def test_unwritable_outputs_name_the_flag_and_path(tiny_model_dir, replay, tmp_path, flag, value, problem) -> None:
    (tmp_path / "blocker").write_text("a file where a folder is needed")
    extra = [flag, str(tmp_path / value)] + (["--use-tensorboard"] if flag == "--tensorboard-dir" else [])
    want = f"{flag} {tmp_path / value}: " + problem.format(t=tmp_path)
    with pytest.raises(SlimeLiteError, match=re.escape(want)):
        check_outputs(_args(tiny_model_dir, replay, *extra))


def test_rollout_dump_folder_is_probed(tiny_model_dir, tmp_path) -> None:
    (tmp_path / "blocker").write_text("x")
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    template = str(tmp_path / "blocker" / "d_{rollout_id}.pt")
    args = parse_args(["--debug-rollout-only", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data),
                       "--rm-type", "addition", "--save-debug-rollout-data", template])
    with pytest.raises(SlimeLiteError, match=re.escape(f"--save-debug-rollout-data {template}: {tmp_path}/blocker "
                                                       "exists but is not a folder")):
        check_outputs(args)


def test_missing_output_folders_are_created(tiny_model_dir, replay, tmp_path) -> None:
    args = _args(tiny_model_dir, replay, "--save", str(tmp_path / "new" / "ckpt"), "--metrics-path",
                 str(tmp_path / "new" / "logs" / "m.jsonl"), "--dump-details", str(tmp_path / "new" / "details"))
    check_outputs(args)
    for sub in ("ckpt", "logs", "details/train_data"):
        assert (tmp_path / "new" / sub).is_dir(), sub
    (tmp_path / "metrics_dir").mkdir()
    with pytest.raises(SlimeLiteError, match=r"--metrics-path .*metrics_dir is a folder"):
        check_outputs(_args(tiny_model_dir, replay, "--metrics-path", str(tmp_path / "metrics_dir")))


def test_metrics_are_never_appended_to_a_file_the_run_reads(tiny_model_dir, tmp_path) -> None:
    """--metrics-path naming the prompt data (or a file of the model) appended metrics rows to it: the next run
    failed on its data. Refused before Ray starts, naming both flags; the file is left as it was."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = ["--debug-rollout-only", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type",
            "addition"]
    for path, flag in ((data, "--prompt-data"), (tiny_model_dir / "config.json", "--hf-checkpoint")):
        before = path.read_bytes()
        with pytest.raises(SlimeLiteError, match=f"--metrics-path {re.escape(str(path))} is or lies inside {flag}"):
            check_outputs(parse_args(base + ["--metrics-path", str(path)]))
        assert path.read_bytes() == before
    sliced = base[:4] + [f"{data}@[0:1]"] + base[5:]  # slime's PATH@[a:b] reads PATH: the same file
    with pytest.raises(SlimeLiteError, match=f"--metrics-path {re.escape(str(data))} is or lies inside --prompt-data"):
        check_outputs(parse_args(sliced + ["--metrics-path", str(data)]))
    check_outputs(parse_args(base + ["--metrics-path", str(tmp_path / "metrics.jsonl")]))
    (tmp_path / "run").mkdir()  # slime's --load X --save X, resumed, with the metrics beside the checkpoints: fine
    (tmp_path / "run" / "latest").write_text("iter_0000001")
    args = parse_args(base[1:] + ["--load", str(tmp_path / "run"), "--save", str(tmp_path / "run"),
                                  "--metrics-path", str(tmp_path / "run" / "m.jsonl")])
    assert args.load == str(tmp_path / "run") and check_outputs(args) is None


def test_cli_stops_before_ray_with_one_message(tiny_model_dir, replay, tmp_path) -> None:
    """A bad second dump ends `slime-lite train` before Ray starts: exit 2, the message and no traceback."""
    bad = _samples()
    bad[1].reward = float("inf")
    save_rollout_dump(str(tmp_path / "d_1.pt"), 1, bad)
    proc = subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", "--load-debug-rollout-data", replay,
                           "--hf-checkpoint", str(tiny_model_dir), *RUN], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "d_1.pt: samples[1].reward is inf" in proc.stderr and "Traceback" not in proc.stderr
    assert "Ray" not in proc.stderr  # stopped before Ray started (no wall-clock bound: machines here are noisy)


def test_cli_unwritable_output_stops_before_ray(tiny_model_dir, tmp_path) -> None:
    """A rollout-only run whose --metrics-path cannot be created ends at once, not after a rollout."""
    (tmp_path / "blocker").write_text("x")
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    metrics = tmp_path / "blocker" / "logs" / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", "--debug-rollout-only", "--hf-checkpoint",
                           str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "addition", "--metrics-path",
                           str(metrics)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"--metrics-path {metrics}: cannot create the folder {metrics.parent}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Ray" not in proc.stderr


@pytest.fixture
def mistral_model(tiny_model_dir, tmp_path):
    """The tiny model's folder with a config.json of an architecture slime-lite does not build."""
    import json
    import shutil

    out = tmp_path / "mistral"
    shutil.copytree(tiny_model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"model_type": "mistral",
                                                       "architectures": ["MistralForCausalLM"]}))
    return out


@pytest.mark.parametrize("extra, sides", [
    ([], ["the Megatron trainer cannot build it", "the embedded engine cannot serve it"]),
    (["--debug-rollout-only"], ["the embedded engine cannot serve it"]),
    (["--debug-train-only"], ["the Megatron trainer cannot build it"]),
])
def test_an_architecture_slime_lite_cannot_build_is_refused_naming_it_and_the_supported_ones(
        mistral_model, tmp_path, extra, sides) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    args = parse_args(["--hf-checkpoint", str(mistral_model), "--prompt-data", str(data), "--rm-type", "addition",
                       *RUN, *extra])
    with pytest.raises(SlimeLiteError) as info:
        preflight(args)
    msg = str(info.value)
    assert f"--hf-checkpoint {mistral_model / 'config.json'}: architecture MistralForCausalLM" in msg, msg
    for family in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Glm4ForCausalLM"):
        assert family in msg
    assert all(side in msg for side in sides) and len(re.findall("cannot", msg)) == len(sides), msg


def test_an_architecture_only_sglang_serves_passes_a_rollout_only_run_on_sglang(mistral_model, tmp_path) -> None:
    from tests import sglang_oracle as oracle

    oracle.require_sglang()
    oracle.sglang_module("sglang.srt.server_args")  # the launcher's flag check finds the real module
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    preflight(parse_args(["--hf-checkpoint", str(mistral_model), "--prompt-data", str(data), "--rm-type", "addition",
                          "--debug-rollout-only", "--rollout-backend", "sglang", *RUN]))


BAD_ROWS = [
    ('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": "4"', r":2: not valid JSON"),
    ('{"question": "1+1=", "label": "2"}', r":1: no 'prompt' key \(set --input-key"),
    ('{"prompt": "", "label": "2"}', r":1: the 'prompt' field is empty text"),
    ('{"prompt": null, "label": "2"}', r":1: the 'prompt' field is a NoneType"),
    ('{"prompt": 5, "label": "2"}', r":1: the 'prompt' field is a int"),
    ('{"prompt": [], "label": "2"}', r":1: the 'prompt' field is an empty list"),
    ('{"prompt": [{"rol": "user", "content": "x"}], "label": "2"}', r":1: .* a list that is not of chat messages"),
    ('{"prompt": "1+1="}', r":1: no label; rm_type addition compares .* \(set --label-key"),
    ('{"prompt": "1+1=", "label": ["2"]}', r":1: a list label"),
    ('{"prompt": "1+1=", "label": "2", "rm_type": "ifbench"}', r"rm_type 'ifbench' is not a reward type.*"
                                                                 r"score it with --custom-rm-path"),
    ('{"prompt": "1+1=", "label": "2", "rm_type": "dapo"}', r"prompt 0 is scored by dapo.*--reward-key score"),
    ('{"prompt": [{"role": "user", "content": "x"}], "label": "2"}', r":1: a prompt is a chat message list: add "
                                                                      r"--apply-chat-template"),
]


@pytest.mark.parametrize("text, problem", BAD_ROWS)
def test_a_bad_prompt_row_is_named_by_file_and_line_before_ray(tiny_model_dir, tmp_path, text, problem) -> None:
    """Each of these failed after the trainer and the engines had started (a traceback from a Ray actor), or was
    trained as garbage (an empty or null prompt rendered as an empty user turn)."""
    data = tmp_path / "p.jsonl"
    data.write_text(text + "\n")
    args = parse_args(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "addition",
                       *RUN])
    with pytest.raises(SlimeLiteError, match=re.escape(str(data)) + ".*" + problem):
        preflight(args)


def test_eval_data_and_the_chat_template_are_checked_too(tiny_model_dir, tmp_path) -> None:
    good, bad = tmp_path / "good.jsonl", tmp_path / "eval.jsonl"
    good.write_text('{"prompt": "1+1=", "label": 2.0}\n')
    bad.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": [{"content": "x"}], "label": "2"}\n')
    base = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(good), "--rm-type", "addition", *RUN]
    preflight(parse_args(base))  # 2.0 is the label 2
    with pytest.raises(SlimeLiteError, match=re.escape(str(bad)) + r":2: .*chat messages"):
        preflight(parse_args(base + ["--eval-prompt-data", "e", str(bad)]))
    template = ["--apply-chat-template", "--apply-chat-template-kwargs", '{"x": 1}']
    boom = tmp_path / "boom.jsonl"  # a tool call without a name: the tiny template adds its name to a string
    boom.write_text('{"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", '
                    '"tool_calls": [{"function": {"arguments": {}}}]}], "label": "2"}\n')
    with pytest.raises(SlimeLiteError, match=re.escape(str(boom)) + r":1: the chat template cannot render"):
        preflight(parse_args(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(boom), "--rm-type",
                              "addition", *RUN, *template]))
    from slime_lite.rollout.data import read_prompts

    assert read_prompts(str(good))[0].label == 2  # an integer in the data stays one


@pytest.mark.parametrize("flags, named", [
    (["--rollout-temperature", "nan"], "--rollout-temperature"), (["--lr", "inf"], "--lr"),
    (["--rollout-top-k", "0"], "--rollout-top-k"), (["--eval-top-k", "-7"], "--eval-top-k"),
    (["--rollout-stop", ""], "--rollout-stop"), (["--rollout-stop-token-ids", "-5"], "--rollout-stop-token-ids"),
    (["--rollout-request-timeout", "0"], "--rollout-request-timeout"), (["--tool-call-timeout", "-1"],
                                                                        "--tool-call-timeout"),
    (["--adam-beta1", "5"], "--adam-beta1"), (["--gamma", "1.5"], "--gamma"), (["--log-level", "verbose"],
                                                                               "--log-level"),
    (["--apply-chat-template-kwargs", '{"add_generation_prompt": false}'], "--apply-chat-template-kwargs"),
])
def test_numeric_and_text_flags_refuse_values_the_run_cannot_use(tiny_model_dir, capsys, flags, named) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", str(tiny_model_dir), "--rm-type", "addition", *flags])
    assert f"argument {named}" in capsys.readouterr().err


def test_a_duplicate_eval_name_and_a_nan_dual_clip_are_refused(tiny_model_dir, tmp_path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "addition"]
    with pytest.raises(SlimeLiteError, match="each NAME once"):
        parse_args(base + ["--eval-prompt-data", "aime", str(data), "aime", str(data)])
    with pytest.raises(SlimeLiteError, match="--eps-clip-c nan must be > 1"):
        parse_args(base + ["--eps-clip-c", "nan"])
    assert parse_args(base + ["--log-level", "debug"]).log_level == "DEBUG"


def test_rows_without_labels_pass_where_a_hook_generates_the_samples(tiny_model_dir, tmp_path) -> None:
    """A --custom-generate-function-path (or --rollout-function-path) hook may score without the data's label: the
    label check is the built-in rollout's only; the prompt checks still apply."""
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1="}\n')
    base = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "addition", *RUN]
    preflight(parse_args(base + ["--custom-generate-function-path", "slime_lite.rollout.calc_task.generate"]))
    with pytest.raises(SlimeLiteError, match="no label"):
        preflight(parse_args(base))


def test_limits_every_request_would_be_refused_for_are_refused_before_ray(tiny_model_dir, tmp_path,
                                                                          monkeypatch) -> None:
    """Each of these passed the checks and failed after the trainer and the engines had started: a response the
    model's context cannot hold, a stop token id outside the vocabulary, a prompt limit that leaves no prompt."""
    import json

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    context, vocab = cfg["max_position_embeddings"], cfg["vocab_size"]
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "addition", *RUN]
    preflight(parse_args(base + ["--rollout-max-response-len", str(context - 5), "--rollout-stop-token-ids",
                                 str(vocab - 1), "--rollout-max-prompt-len", "64"]))  # "1+1=": 4 tokens, 511 in all
    # a prompt whose tokens with the response's reach the context: its line, and a prompt limit that leaves it out
    with pytest.raises(SlimeLiteError, match=rf"p.jsonl:1: the prompt is 4 tokens as rendered, and with "
                                             rf"--rollout-max-response-len {context - 4} that is {context} tokens, "
                                             rf"not below the model's context \({context}.*--rollout-max-prompt-len 3"):
        preflight(parse_args(base + ["--rollout-max-response-len", str(context - 4)]))
    with pytest.raises(SlimeLiteError, match=rf"--rollout-max-response-len {context}: the model's context"):
        preflight(parse_args(base + ["--rollout-max-response-len", str(context)]))
    with pytest.raises(SlimeLiteError, match=rf"--eval-max-response-len {context}: the model's context"):
        preflight(parse_args(base + ["--eval-max-response-len", str(context)]))
    # a cache that gives each request no more tokens than the prompt: its requests refused by the engines; one that
    # cuts responses short passes (the engine caps them, with a warning)
    with pytest.raises(SlimeLiteError, match=r"p.jsonl:1: the prompt is 4 tokens as rendered, and "
                                             r"--engine-kv-cache-tokens 256 over --engine-max-running-requests 64 "
                                             r"gives each request 4 tokens of cache"):
        preflight(parse_args(base + ["--engine-kv-cache-tokens", "256", "--engine-max-running-requests", "64"]))
    preflight(parse_args(base + ["--rollout-max-response-len", "256", "--engine-kv-cache-tokens", "1024",
                                 "--engine-max-running-requests", "4"]))
    # an eval set generated by a custom function: what it sends is the function's (refused without it)
    (tmp_path / "my_eval.py").write_text("def generate_rollout(args, rollout_id, data_source, evaluation=False):\n"
                                         "    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    long_eval = base + ["--eval-prompt-data", "e", str(data), "--eval-interval", "1", "--eval-max-response-len",
                        str(context - 4)]
    with pytest.raises(SlimeLiteError, match=r"with --eval-max-response-len .* not below the model's context"):
        preflight(parse_args(long_eval))
    preflight(parse_args(long_eval + ["--eval-function-path", "my_eval.generate_rollout"]))
    from slime_lite.rollout.engines import train_flag_names  # what the engine says when it starts, in train's terms

    assert train_flag_names("--device cuda: CUDA is not available on this machine; use --device cpu.") == (
        "--rollout-device cuda: CUDA is not available on this machine; use --rollout-device cpu.")
    assert train_flag_names("--kv-cache-tokens 9: raise it or lower --max-running-requests.") == (
        "--engine-kv-cache-tokens 9: raise it or lower --engine-max-running-requests.")
    with pytest.raises(SlimeLiteError, match=rf"--rollout-stop-token-ids {vocab}: outside the model's vocabulary"):
        preflight(parse_args(base + ["--rollout-stop-token-ids", "3", str(vocab)]))
    with pytest.raises(SlimeLiteError, match=r"with --rollout-max-prompt-len: every prompt is longer than 1 tokens"):
        preflight(parse_args(base + ["--rollout-max-prompt-len", "1"]))
    with pytest.raises(SlimeLiteError, match=r"eval.jsonl with --eval-max-prompt-len: every prompt is longer"):
        (tmp_path / "eval.jsonl").write_text(data.read_text())
        preflight(parse_args(base + ["--eval-prompt-data", "e", str(tmp_path / "eval.jsonl"),
                                     "--eval-max-prompt-len", "1"]))


def test_a_model_folder_without_weights_or_with_a_broken_config_is_named(tiny_model_dir, tmp_path) -> None:
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    with pytest.raises(SlimeLiteError, match=rf"--hf-checkpoint {bare} holds no weights \(\*\.safetensors\)"):
        preflight(parse_args(["--hf-checkpoint", str(bare), "--prompt-data", str(data), "--rm-type", "addition",
                              *RUN]))
    for text, problem in (("{not json", "not a JSON file"), ("[1, 2]", "holds a JSON list"),
                          ('{"num_attention_heads": "4"}', "num_attention_heads is '4'; it must be a positive")):
        (bare / "config.json").write_text(text)
        with pytest.raises(SlimeLiteError, match=rf"--hf-checkpoint {bare}/config.json: {problem}"):
            parse_args(["--hf-checkpoint", str(bare), "--rm-type", "addition", *RUN])


def test_a_resume_whose_checkpoint_already_trained_every_rollout_is_refused(tiny_model_dir, tmp_path) -> None:
    from slime_lite.backends.megatron.checkpoint import plain_state

    root = tmp_path / "ckpt"
    (root / "iter_0000001").mkdir(parents=True)
    torch.save(plain_state({"model": {}, "optimizer": {}, "rng": {"cpu": torch.get_rng_state(), "cuda": None},
                            "next_rollout_id": 2, "data_state": None}), root / "iter_0000001" / "rank_000.pt")
    (root / "latest").write_text("iter_0000001")
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "addition",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--load", str(root)]
    preflight(parse_args(base + ["--num-rollout", "3"]))  # rollout 2 is left
    with pytest.raises(SlimeLiteError, match=r"has trained rollouts up to 1, and --num-rollout 2 ends there"):
        preflight(parse_args(base + ["--num-rollout", "2"]))
