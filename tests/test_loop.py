"""The full RL loop through Ray on CPU: GRPO and PPO with --ci-test, every weight transport (the engine then
samples from the new weights; with distributed, an engine killed mid-rollout under --use-fault-tolerance too),
colocate, --async (one-step-off), and kill-and-resume reproducing an uninterrupted run."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from slime_lite.tasks import make_data

    out = tmp_path_factory.mktemp("loopdata") / "addition.jsonl"
    make_data("addition", str(out), n_train=256, n_eval=16, seed=0)
    return out


def base(model, data, out: Path, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "addition",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
            "--rollout-shuffle", "--use-kl-loss", "--kl-loss-coef", "0.01", "--lr", "3e-3", "--seed", "3",
            "--kl-loss-type", "low_var_kl",  # k3: rollout/kl > 0 once the policy moved
            "--entropy-coef", "0.01",  # a random model gets no reward: entropy makes sure every step moves it
            "--metrics-path", str(out / "m.jsonl"), *extra]


def train(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", *argv], capture_output=True, text=True,
                          timeout=600, **kw)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("estimator", ["grpo", "ppo"])
def test_end_to_end_ci_test(tiny_model_dir, data, tmp_path, estimator):
    extra = ["--advantage-estimator", estimator, "--num-rollout", "3", "--ci-test", "--check-weight-update-equal",
             "--eval-interval", "2", "--eval-prompt-data", "add", str(data.with_name("addition_eval.jsonl"))]
    # rollout correction on (issue 17): every variant must pass --ci-test, since train == rollout here
    extra += ["--get-mismatch-metrics", "--use-tis", "--tis-level", "sequence"] if estimator == "ppo" else [
        "--get-mismatch-metrics", "--use-tis", "--tis-level", "geometric", "--tis-mode", "mask", "--use-rs",
        "--rs-level", "sequence", "--rs-veto-threshold", "1e-4"]
    if estimator == "ppo":
        extra += ["--kl-coef", "0.01", "--kl-loss-coef", "0", "--skip-eval-before-train"]  # one KL (slime's rule)
    else:  # the other logging sinks, next to --metrics-path; pass@k
        extra += ["--use-tensorboard", "--tensorboard-dir", str(tmp_path / "tb"), "--use-wandb", "--wandb-dir",
                  str(tmp_path), "--log-passrate"]
    # slime's --ref-update-interval (grpo: the reference takes the actor's weights after rollout 1) and
    # --reset-optimizer-states (ppo: actor and critic start each rollout with a fresh Adam)
    extra += ["--reset-optimizer-states"] if estimator == "ppo" else ["--ref-update-interval", "2"]
    proc = train(base(tiny_model_dir, data, tmp_path, *extra), env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = rows(tmp_path)
    trained = [x for x in r if x["rollout_id"] >= 0]
    assert [x["rollout_id"] for x in trained] == [0, 1, 2]
    # one optimizer step a rollout: the steps file holds each at train/step = its rollout id, with the rollout's
    # train values (the actor's and, for PPO, the critic's in one record)
    steps = [json.loads(line) for line in (tmp_path / "m.train_steps.jsonl").read_text().splitlines()]
    assert [(x["train/step"], x["rollout_id"]) for x in steps] == [(0, 0), (1, 1), (2, 2)]
    for key in ("train/loss", "train/grad_norm") + (("train/critic-value_loss",) if estimator == "ppo" else ()):
        assert [x[key] for x in steps] == [x[key] for x in trained], key
    assert trained[0]["rollout/kl"] == 0.0 and trained[0]["train/first_step/ppo_kl"] == 0.0
    if estimator == "grpo":  # rollout 1 against the start weights; rollout 2 against the actor's after rollout 1
        assert trained[1]["rollout/kl"] > 0 and trained[2]["rollout/kl"] == 0.0
    else:  # logged by the actor's and the critic's rank 0 after each rollout (Ray folds repeated lines)
        assert "--reset-optimizer-states: cleared the optimizer state" in proc.stdout + proc.stderr
    assert all(x["train/train_rollout_logprob_abs_diff"] < 1e-5 for x in trained)
    for x in trained:  # float32 engine and trainer agree: ratios 1, nothing truncated or rejected
        assert abs(x["mismatch/token_ratio_max"] - 1) < 1e-4 and x["mismatch/seq_ratio_outside_frac"] == 0.0
        assert x["train/tis_clipfrac"] == 0.0 and x.get("train/rejected_frac", 0.0) == 0.0
        assert len(x["mismatch/worst_tokens"]) == 10 and isinstance(x["mismatch/worst_tokens"][0]["token"], str)
    assert ("train/rejected_frac" in trained[0]) == (estimator == "grpo")
    for x in trained:  # the step's tokens per second of the step
        assert x["perf/tokens_per_s"] * x["perf/step_time"] > 16  # 16 samples of prompt and response tokens
    # --skip-eval-before-train (ppo): no eval before the first rollout
    assert [x["rollout_id"] for x in r if "eval/add" in x] == ([1, 2] if estimator == "ppo" else [-1, 1, 2])
    assert all(("passrate/pass@1" in x) == (estimator == "grpo") for x in trained)
    if estimator == "ppo":
        assert "train/critic-value_loss" in trained[0]
    else:
        assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
        assert list((tmp_path / "wandb").glob("offline-run-*"))


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", ["qwen3", "glm4", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("precision", ["cpu-float32", pytest.param("cuda-bfloat16", marks=_CUDA)])
def test_qwen3_and_glm4_train_and_rollout_log_probs_agree_under_ci_test(data, tmp_path, arch, precision):
    """A tiny Qwen3 (QK-norm, head size 48 of a 128 hidden size over 4 heads), a tiny GLM4 (partial interleaved
    rotary, q/k/v biases, post-norms, fused gate/up), a tiny Qwen3-MoE and a tiny Qwen2-MoE (4 experts, top 2; a
    gated shared expert) through the whole loop: the embedded engine rolls out, Megatron trains, the weights are
    pushed by HF name (every expert by its on-disk name) and checked equal, and --ci-test's checks pass: in float32
    on CPU; on a GPU in bf16, colocated, with the engine's CUDA graphs and fused kernels, under the bf16 bound."""
    from slime_lite.tiny_model import make_tiny_model

    make_tiny_model(tmp_path / "model", arch=arch, warm_start_steps=0, num_layers=2,
                    head_dim=48 if arch == "qwen3" else None)
    bf16 = ["--colocate", "--bf16", "--engine-dtype", "bfloat16"] if precision == "cuda-bfloat16" else []
    # Qwen3-MoE with rollout routing replay, two steps a rollout (the second on moved weights): the mismatch is
    # that of the log-prob pass, engine against trainer on the same weights
    replay = ["--use-rollout-routing-replay", "--num-steps-per-rollout", "2"] if arch == "qwen3_moe" else []
    proc = train(base(tmp_path / "model", data, tmp_path, "--num-rollout", "2", "--ci-test",
                      "--check-weight-update-equal", "--debug-scramble-engine-weights", *bf16, *replay))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    r = rows(tmp_path)
    assert [x["rollout_id"] for x in r] == [0, 1] and r[0]["rollout/kl"] == 0.0
    bound = 5e-2 if bf16 else 1e-5  # rollout 1: sampled from the pushed weights
    assert all(x["train/train_rollout_logprob_abs_diff"] < bound for x in r), [
        x["train/train_rollout_logprob_abs_diff"] for x in r]
    if replay:
        assert all("train/routing_mismatch/layer_1" in x for x in r)
        if not bf16:  # float32: the engine's routers and the trainer's pick the same experts
            assert [x["train/routing_mismatch"] for x in r] == [0.0, 0.0]


@pytest.mark.parametrize("transport", ["tensor", "distributed", "disk"])
def test_weight_transport_engine_samples_new_weights(tiny_model_dir, data, tmp_path, transport):
    # lr 3e-3 moves the weights a lot: had the push failed, the engine's log-probs of rollout 1 (sampled from the
    # pushed weights) would disagree with the trainer's by far more than fp32 noise.
    # The distributed run also carries the fault-tolerance case (one run instead of two): kill -9 of the engine's
    # process while rollout 1 is generated, after its first group finished (--debug-inject-fault kill-engine). Under
    # --use-fault-tolerance the engine is restarted on its bundle, gets the trained weights (version 1, through a
    # new broadcast group, checked equal), the requests that did not finish are sent again, and the run ends.
    # The tensor run also carries slime's --load fallback: --load names no checkpoint yet and --ref-load a model
    # with other weights than --hf-checkpoint's (same architecture), so the actor starts from --ref-load and the
    # initial push before rollout 0 gives the engines those weights.
    fault = ["--use-fault-tolerance", "--debug-inject-fault", "kill-engine"] if transport == "distributed" else []
    ref_load = []
    if transport == "tensor":
        from slime_lite.tiny_model import make_tiny_model

        make_tiny_model(tmp_path / "ref", warm_start_steps=0, seed=1)
        ref_load = ["--load", str(tmp_path / "ckpt"), "--ref-load", str(tmp_path / "ref")]
    proc = train(base(tiny_model_dir, data, tmp_path, "--num-rollout", "2", "--update-weight-transport", transport,
                      "--check-weight-update-equal", "--debug-scramble-engine-weights", *fault, *ref_load))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    r = rows(tmp_path)
    if ref_load:
        assert log.count(f"the actor from --ref-load {tmp_path / 'ref'}") == 1, log[-3000:]
        assert r[0]["rollout/kl"] == 0.0  # the actor starts with the reference's weights
        # rollout 0 was sampled from the pushed --ref-load weights: the trainer's log-probs agree (an engine left
        # with --hf-checkpoint's, or scrambled, weights would disagree by far more)
        assert r[0]["train/train_rollout_logprob_abs_diff"] < 1e-5
    # rollout 1's samples (the retried ones included) came from the pushed weights the trainer scores with
    assert r[1]["rollout/weight_version"] == 1.0
    assert r[1]["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert r[1]["rollout/kl"] > 0  # the policy really moved away from the reference
    # the push's parts, timed in the actor: each within the driver's time of the whole push
    parts = [r[1][f"perf/update_weights/{p}_time"] for p in ("gather", "send", "check")]
    assert all(t > 0 for t in parts) and sum(parts) < r[1]["perf/update_weights_time"], parts
    if fault:
        assert "failed and is taken out of rotation" in log  # requests were in flight when it died
        assert re.search(r"engine 0 \(http://[\d.:]+\) is dead: ", log)
        assert re.search(r"engine 0 restarted at http://[\d.:]+ in [\d.]+s \(weights version 1 pushed, weight "
                         r"check passed\)", log)
        assert [x["rollout/engine_restarts"] for x in r] == [0.0, 1.0]


def test_update_weights_interval_pushes_every_n_rollouts_and_before_evals(tiny_model_dir, data, tmp_path):
    """--update-weights-interval 3 with an eval after 2 trained rollouts: the push after rollout 0 is skipped
    (rollout 1 is generated with version 0, and --ci-test expects it), the one before the eval is not (rollout 2
    gets version 2). The same run saves with --save-hf and --no-save-optim."""
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    proc = train(base(tiny_model_dir, data, tmp_path, "--num-rollout", "3", "--update-weights-interval", "3",
                      "--ci-test", "--check-weight-update-equal", "--eval-interval", "2", "--skip-eval-before-train",
                      "--eval-prompt-data", "add", str(data.with_name("addition_eval.jsonl")), "--save", str(ckpt),
                      "--save-interval", "2", "--no-save-optim", "--save-hf", str(hf / "{rollout_id}")))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    r = rows(tmp_path)
    trained = [x for x in r if x["rollout_id"] >= 0]
    assert [x["rollout/weight_version"] for x in trained] == [0.0, 0.0, 2.0]
    assert [x["rollout_id"] for x in r if "eval/add" in x] == [1, 2]
    assert ["perf/update_weights_time" in x for x in trained] == [False, True, True]
    diffs = [x["train/train_rollout_logprob_abs_diff"] for x in trained]
    assert diffs[0] < 1e-5 and diffs[1] > 1e-3 and diffs[2] < 1e-5, diffs  # rollout 1: the trainer moved since v0
    assert sorted(p.name for p in hf.iterdir()) == ["1", "2"]
    assert all((hf / n / "model.safetensors").exists() and (hf / n / "config.json").exists() for n in ("1", "2"))
    assert "optimizer" not in torch.load(ckpt / "iter_0000002" / "rank_000.pt", weights_only=True)


def test_async_overlaps_generation_with_training(tiny_model_dir, data, tmp_path):
    # --async (slime's train_async.py), disaggregated (engine and trainer in their own slots): rollout r + 1 is
    # generated while rollout r trains, with the weights from before that training (lag 1), and --ci-test passes
    # with the off-policy checks relaxed (and says so)
    proc = train(base(tiny_model_dir, data, tmp_path, "--num-rollout", "3", "--async", "--ci-test",
                      "--check-weight-update-equal"))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "--ci-test with --async: rollouts after the first are generated with weights one version older" in log
    r = rows(tmp_path)
    assert [x["rollout/off_policy_lag"] for x in r] == [0.0, 1.0, 1.0]
    assert [x["rollout/weight_version"] for x in r] == [0.0, 0.0, 1.0]  # pushes land between generations
    for prev, nxt in itertools.pairwise(r):  # launched before the previous rollout's training started, so they overlap
        assert nxt["timeline/generate_start"] <= prev["timeline/train_start"] < prev["timeline/train_end"]
        assert "perf/async_overlap_time" in prev
    assert r[0]["train/train_rollout_logprob_abs_diff"] < 1e-5  # on-policy: rollout 0 only
    assert r[2]["train/train_rollout_logprob_abs_diff"] > 1e-3  # one step off: the trainer has moved since


def test_partial_rollout_continues_aborted_samples_and_ci_test_passes(tiny_model_dir, data, tmp_path, capsys):
    """8 groups started for 4, the engine running 2 at a time: once 4 are done the rest are aborted (never trained)
    and --partial-rollout continues them in the next rollout; --ci-test passes with them in the batch (the weight
    version served is each rollout's, the train/rollout log-prob check is over the tokens of the newest weights),
    and the dumps and explain show each token's weight version."""
    d = tmp_path / "d"
    proc = train(base(tiny_model_dir, data, tmp_path, "--num-rollout", "3", "--over-sampling-batch-size", "8",
                      "--partial-rollout", "--engine-max-running-requests", "8", "--rollout-max-response-len", "16",
                      "--ci-test", "--save-debug-rollout-data", str(d / "data_{rollout_id}.pt"),
                      "--save-debug-train-data", str(d / "train_{rollout_id}_{rank}.pt")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = rows(tmp_path)
    assert [x["rollout/weight_version"] for x in r] == [0.0, 1.0, 2.0]
    assert all(x["rollout/over_sampling/aborted_groups"] > 0 for x in r)
    assert r[0]["rollout/partial/samples_carried"] == 0 and sum(x["rollout/partial/samples_carried"] for x in r) > 0
    from slime_lite.cli import main as cli
    from slime_lite.rollout.dumps import load_rollout_dump
    from slime_lite.types import TOKEN_VERSIONS

    for x in r[1:]:
        samples = load_rollout_dump(str(d / f"data_{x['rollout_id']}.pt")).samples
        assert all(s.status.value != "aborted" for s in samples)
        mixed = [s for s in samples if len(set(s.metadata[TOKEN_VERSIONS])) > 1]
        if mixed:
            assert x["train/train_rollout_logprob_abs_diff"] < 1e-5  # the older tokens are left out of the check
            assert cli(["explain", "--rollout-dump", str(d / f"data_{x['rollout_id']}.pt"), "--train-dump",
                        str(d / f"train_{x['rollout_id']}_0.pt"), "--sample", str(mixed[0].index)]) == 0
            assert "continued since rollout" in capsys.readouterr().out


def test_partial_rollout_resume_continues_the_samples_carried_at_the_checkpoint(tiny_model_dir, data, tmp_path):
    argv = base(tiny_model_dir, data, tmp_path, "--over-sampling-batch-size", "8", "--partial-rollout",
                "--engine-max-running-requests", "8", "--rollout-max-response-len", "16")
    first = train(argv + ["--num-rollout", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "1"])
    assert first.returncode == 0, first.stderr[-3000:]
    kept = int(rows(tmp_path)[-1]["rollout/partial/samples_kept"])
    assert kept > 0
    resumed = train(argv + ["--num-rollout", "3", "--load", str(tmp_path / "ckpt")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"--partial-rollout: {kept} samples carried from the checkpoint continue" in resumed.stderr
    assert [x["rollout_id"] for x in rows(tmp_path)] == [0, 1, 2]


def test_colocate_second_iteration(tiny_model_dir, data, tmp_path, capsys):
    proc = train(base(tiny_model_dir, data, tmp_path, "--num-rollout", "2", "--colocate", "--ci-test",
                      "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--global-batch-size", "8",
                      "--save-debug-rollout-data", str(tmp_path / "d" / "data_{rollout_id}.pt"),
                      "--save-debug-train-data", str(tmp_path / "d" / "train_{rollout_id}_{rank}.pt")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = rows(tmp_path)
    assert len(r) == 2 and r[1]["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert "perf/memory/engine_released/rss_mb" in r[1] and "perf/offload_time" in r[1]
    for key in ("perf/offload/engine_release_time", "perf/offload/engine_resume_time", "perf/rollout/generate_time",
                "perf/rollout/engine_busy_time", "perf/rollout/engine_idle_time",
                "perf/update_weights/engine_resume_time"):
        assert key in r[1], key
    # the parts of perf/offload_time do not pass it (the weights' resume is the push's, counted there only)
    parts = r[1]["perf/offload/engine_release_time"] + r[1]["perf/offload/engine_resume_time"]
    assert parts <= r[1]["perf/offload_time"] + 1e-6
    assert r[1]["perf/update_weights/engine_resume_time"] <= r[1]["perf/update_weights_time"] + 1e-6
    # each of the 2 data-parallel ranks dumped its samples; together they join 1:1 with the rollout dump
    from slime_lite.backends.megatron.train_dump import load_train_dumps
    from slime_lite.cli import main as cli

    ranks = [str(tmp_path / "d" / f"train_1_{rank}.pt") for rank in (0, 1)]
    joined = load_train_dumps(ranks)
    assert sorted(joined.rows) == list(range(16)) and set(joined.rows[0]) >= {"ref_log_probs", "entropy", "returns"}
    assert cli(["explain", "--rollout-dump", str(tmp_path / "d" / "data_1.pt"), "--train-dump", *ranks,
                "--sample", "13"]) == 0
    assert "0 token(s) with |diff| > 0.05" in capsys.readouterr().out


# packed by a token budget that some samples (prompt + response) exceed: those are micro-batches of their own
DETERMINISTIC = ("--num-rollout", "3", "--deterministic-mode", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "10")


@pytest.fixture(scope="module")
def full_run(tiny_model_dir, data, tmp_path_factory) -> Path:
    """An uninterrupted 3-rollout --deterministic-mode run with its rollout dumps; two tests compare with it."""
    full = tmp_path_factory.mktemp("full")
    proc = train(base(tiny_model_dir, data, full, *DETERMINISTIC, "--save-debug-rollout-data",
                      str(full / "dumps" / "{rollout_id}.pt")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return full


def test_kill_and_resume_matches_uninterrupted(tiny_model_dir, data, tmp_path, full_run):
    full = full_run
    part = tmp_path / "part"
    ckpt = part / "ckpt"
    argv = base(tiny_model_dir, data, part, *DETERMINISTIC, "--save", str(ckpt), "--save-interval", "1")
    job = subprocess.Popen([sys.executable, "-m", "slime_lite.cli", "train", *argv], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not ((ckpt / "latest").exists() and (ckpt / "latest").read_text() == "iter_0000001"):
        assert job.poll() is None, "the job ended before its second checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)  # the whole job, driver and Ray, at once
    job.wait()

    resumed = train(base(tiny_model_dir, data, part, *DETERMINISTIC, "--load", str(ckpt)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    last = [x for x in rows(part) if x["rollout_id"] == 2]
    assert len(last) == 1, "the resumed run did not start at rollout 2"
    want = [x for x in rows(full) if x["rollout_id"] == 2][0]
    got = last[0]
    for key in ("rollout/raw_reward", "rollout/response_len/mean"):
        assert got[key] == want[key], key  # same prompts, same sampled tokens
    for key in ("train/loss", "train/grad_norm", "rollout/log_probs"):
        assert abs(got[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (key, got[key], want[key])


def test_a_runs_dumps_replay_under_its_own_flags(tiny_model_dir, data, tmp_path, full_run):
    """The token budget is one rule (what fits, and what happens to a longer sample) for batching, flag checks and
    replay preflight: the run packed its over-budget samples alone, and its dumps replay with the same flags (no
    engines, --ci-test on) to the run's own numbers."""
    out = tmp_path / "replay"
    proc = train(base(tiny_model_dir, data, out, *DETERMINISTIC, "--ci-test", "--load-debug-rollout-data",
                      str(full_run / "dumps" / "{rollout_id}.pt")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "longer than --max-tokens-per-gpu 10" in proc.stderr, proc.stderr[-3000:]
    want, got = rows(full_run)[0], rows(out)[0]
    for key in ("train/loss", "train/grad_norm", "rollout/log_probs"):
        assert abs(got[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (key, got[key], want[key])


def test_deterministic_mode_two_runs_are_byte_identical_and_profiling_writes_traces(tiny_model_dir, data,
                                                                                   tmp_path, full_run):
    """--deterministic-mode: the same run twice gives the same metrics (timings excluded) and byte-identical
    rollout dumps on CPU. The second run also profiles (train workers, engine, driver timeline): it must not change
    a number, and its traces are Chrome trace JSON with the events of their process."""
    import filecmp

    from slime_lite.debug.compare_runs import main as compare_runs
    from slime_lite.metrics import is_timing_metric

    a, b = full_run, tmp_path / "b"
    proc = train(base(tiny_model_dir, data, b, *DETERMINISTIC, "--save-debug-rollout-data",
                      str(b / "dumps" / "{rollout_id}.pt"), "--profile-target", "train", "rollout", "driver",
                      "--profile-step-start", "1", "--profile-step-end", "2", "--tensorboard-dir",
                      str(tmp_path / "traces")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert compare_runs([str(a / "m.jsonl"), str(b / "m.jsonl"), "--rtol", "0"]) == 0
    lines = [[json.dumps({k: v for k, v in json.loads(line).items() if not is_timing_metric(k)})
              for line in (out / "m.jsonl").read_text().splitlines()] for out in (a, b)]
    assert lines[0] == lines[1] and len(lines[0]) == 3
    names = sorted(p.name for p in (a / "dumps").iterdir())
    assert names == sorted(p.name for p in (b / "dumps").iterdir()) == ["0.pt", "1.pt", "2.pt"]
    assert all(filecmp.cmp(a / "dumps" / n, b / "dumps" / n, shallow=False) for n in names)

    traces = tmp_path / "traces"
    train_trace = json.loads((traces / "train_actor_rank0.trace.json").read_text())
    engine_trace = json.loads(next(traces.glob("rollout_engine0-*.trace.json")).read_text())
    for trace in (train_trace, engine_trace):  # the model's matmuls ran inside the window
        assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    assert any("backward" in e.get("name", "").lower() for e in train_trace["traceEvents"])
    spans = [e for e in json.loads((traces / "driver_timeline.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {(e["name"], e["args"]["rollout_id"]) for e in spans} >= {
        (phase, rid) for phase in ("rollout", "log_probs", "train", "update_weights") for rid in (0, 1, 2)}


def test_fully_async_generates_through_training_and_ci_test_passes(tiny_model_dir, data, tmp_path):
    # --fully-async (slime's examples/fully_async), disaggregated: the engine keeps generating while the trainer
    # trains and the pushes pause it in place; --ci-test passes (served version r at rollout r, the log-prob check
    # only when tokens of the trainer's weights are in the batch) and every token's version is within the bound
    d = tmp_path / "d"
    proc = train(base(tiny_model_dir, data, tmp_path, "--num-rollout", "3", "--fully-async", "--ci-test",
                      "--max-weight-staleness", "1", "--max-weight-staleness-mode", "mask",
                      "--save-debug-rollout-data", str(d / "data_{rollout_id}.pt")))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "--ci-test with --fully-async: the engines must serve weight version r" in log
    r = rows(tmp_path)
    assert [x["rollout/weight_version"] for x in r] == [0.0, 1.0, 2.0]
    assert r[0]["rollout/async/lag_max"] == 0 and all(x["rollout/async/lag_max"] <= 2 for x in r)
    assert sum(x["rollout/async/queued_groups"] + x["rollout/async/in_flight_groups"] for x in r) > 0
    from slime_lite.rollout.dumps import load_rollout_dump
    from slime_lite.types import TOKEN_VERSIONS

    for x in r:
        for s in load_rollout_dump(str(d / f"data_{x['rollout_id']}.pt")).samples:
            versions = s.metadata[TOKEN_VERSIONS]
            assert len(versions) == s.response_length and max(versions) <= x["rollout_id"]
            # mask: tokens more than 1 version behind the trainer are not trained
            assert all(m == 0 for m, v in zip(s.loss_mask, versions) if x["rollout_id"] - v > 1)

