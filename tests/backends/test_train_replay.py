"""Replaying dumped rollouts into the Megatron trainer (no engines): step-1 invariants, parallelism invariance,
bitwise reproducibility, resume, and clear errors for bad inputs."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.slow

BASE = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "2", "--use-kl-loss",
        "--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl",  # k3: rollout/kl > 0 once the policy moved
        "--entropy-coef", "0.01", "--lr", "1e-4", "--seed", "7"]


def args_for(model, dumps, tmp_path, name, *extra):
    return ["--load-debug-rollout-data", dumps, "--hf-checkpoint", str(model), *BASE,
            "--metrics-path", str(tmp_path / f"{name}.jsonl"), *extra]


def test_step1_invariants(tiny_model_dir, replay_dumps, tmp_path, train_cli, metrics_of, single_gpu_metrics):
    """Step 1's invariants; and the same dump in one step per rollout, not the (1, 1, 1) run's two, is stopped by
    --ci-load-grad-norm at its first step, after that rollout's metrics were written."""
    proc = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "m", "--num-steps-per-rollout", "1",
                              "--ci-load-grad-norm", str(single_gpu_metrics[1])))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "grad-norm check failed: actor rollout 0 step 0: grad_norm " in proc.stderr, proc.stderr[-3000:]
    rows = metrics_of(tmp_path / "m.jsonl")
    assert len(rows) == 1  # rollout 1 never ran
    first = rows[0]
    assert first["rollout/log_probs"] == first["rollout/ref_log_probs"]
    assert first["rollout/log_probs_ref_max_abs_diff"] == 0.0 and first["rollout/kl"] == 0.0
    assert first["train/ppo_kl"] == 0.0 and first["train/kl_loss"] == 0.0
    assert math.isfinite(first["train/grad_norm"]) and 0 < first["train/grad_norm"] < 100
    # trainer log-probs of the dumped tokens equal the (HF-computed) rollout log-probs to fp32 tolerance
    assert first["train/train_rollout_logprob_abs_diff"] < 1e-5


TWO_STEPS = ["--num-rollout", "1", "--num-steps-per-rollout", "2"]  # the second step's grad-norm sees the lr


@pytest.fixture(scope="module")
def single_gpu_metrics(tiny_model_dir, replay_dumps, tmp_path_factory, train_cli, metrics_of):
    """The (TP, PP, DP) = (1, 1, 1) replay; it saves every step's grad-norm (--ci-save-grad-norm) for the others."""
    out = tmp_path_factory.mktemp("ref")
    ref = train_cli(args_for(tiny_model_dir, replay_dumps, out, "ref", *TWO_STEPS,
                             "--ci-save-grad-norm", str(out / "grad_norms.json")))
    assert ref.returncode == 0, ref.stderr[-3000:]
    first = metrics_of(out / "ref.jsonl")[0]
    # each optimizer step beside the rollout's record: slime's train/step, the rollout's values their mean
    steps = metrics_of(out / "ref.train_steps.jsonl")
    assert [(x["train/step"], x["rollout_id"]) for x in steps] == [(0, 0), (1, 0)]
    saved = json.loads((out / "grad_norms.json").read_text())["grad_norms"]
    assert [x["train/grad_norm"] for x in steps] == [x["grad_norm"] for x in saved]
    assert steps[0]["train/grad_norm"] == first["train/first_step/grad_norm"] != steps[1]["train/grad_norm"]
    for key in ("train/loss", "train/pg_loss", "train/grad_norm"):
        assert first[key] == pytest.approx((steps[0][key] + steps[1][key]) / 2, rel=1e-12), key
    return first, out / "grad_norms.json"


PACKED = ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "48", "--log-probs-max-tokens-per-gpu", "80")


@pytest.mark.parametrize("tp,pp,gpus,extra", [(2, 1, 2, ()), (1, 2, 2, ()), (1, 1, 2, PACKED)],
                         ids=["tp2", "pp2", "dp2-packed"])
def test_parallelism_invariance(tiny_model_dir, replay_dumps, tmp_path, train_cli, metrics_of, single_gpu_metrics,
                                tp, pp, gpus, extra):
    """Each re-layout passes --ci-load-grad-norm of the (1, 1, 1) run at the float32 default rtol, step by step;
    the DP=2 one also packs its micro-batches by token budget (other budgets for the log-prob passes) against the
    padded reference, so packing and the per-step loss normalisation across DP ranks change nothing."""
    ref, grad_norms = single_gpu_metrics
    proc = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "par", *TWO_STEPS,
                              "--actor-num-gpus-per-node", str(gpus), "--tensor-model-parallel-size", str(tp),
                              "--pipeline-model-parallel-size", str(pp), "--ci-load-grad-norm", str(grad_norms),
                              *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = ref, metrics_of(tmp_path / "par.jsonl")[0]
    if extra:
        assert b["train/first_step/ppo_kl"] == 0.0 and b["rollout/kl"] == 0.0
    for key in ("train/loss", "train/grad_norm", "train/entropy_loss", "rollout/log_probs"):
        assert abs(a[key] - b[key]) <= 1e-4 * max(abs(a[key]), 1e-6), (key, a[key], b[key])


@pytest.fixture(scope="module")
def family_replay(tmp_path_factory, train_cli, metrics_of):
    """``family_replay(arch) -> (model, dumps, (1, 1, 1) metrics, its grad-norm file)`` for a tiny Qwen3 (QK-norm,
    head size 48) or GLM4 (partial interleaved rotary, qkv biases, post-norms, fused gate/up), made once per arch;
    the dumps' log-probs come from HF's forward."""
    from slime_lite.tiny_model import make_tiny_model
    from tests.backends.conftest import make_replay_dumps

    made = {}

    def get(arch: str):
        if arch not in made:
            out = tmp_path_factory.mktemp(arch)
            make_tiny_model(out / "model", arch=arch, warm_start_steps=0, num_layers=2,
                            head_dim=48 if arch == "qwen3" else None)
            dumps = make_replay_dumps(out / "model", out / "dumps", num_rollout=1)
            ref = train_cli(args_for(out / "model", dumps, out, "ref", *TWO_STEPS, "--ci-save-grad-norm",
                                     str(out / "grad_norms.json")))
            assert ref.returncode == 0, ref.stderr[-3000:]
            first = metrics_of(out / "ref.jsonl")[0]
            assert first["train/train_rollout_logprob_abs_diff"] < 1e-5  # Megatron's log-probs are HF's
            made[arch] = out / "model", dumps, first, out / "grad_norms.json"
        return made[arch]

    return get


@pytest.mark.parametrize("arch,tp,pp,extra", [("qwen3", 2, 1, ("--sequence-parallel",)),
                                              ("glm4", 2, 1, ("--sequence-parallel",)), ("glm4", 1, 2, ()),
                                              ("glm4", 1, 1, ())], ids=["qwen3-tp2-sp", "glm4-tp2-sp", "glm4-pp2",
                                                                        "glm4-dp2"])
def test_qwen3_and_glm4_layouts_give_the_single_rank_run(family_replay, tmp_path, train_cli, metrics_of, arch, tp,
                                                         pp, extra):
    """On two ranks, TP=2 with sequence parallelism (the q/k norms' and the post-norms' gradients summed over TP),
    PP=2 and DP=2 pass --ci-load-grad-norm of the (1, 1, 1) run step by step, with its loss and log-probs."""
    model, dumps, ref, grad_norms = family_replay(arch)
    proc = train_cli(args_for(model, dumps, tmp_path, "par", *TWO_STEPS, "--actor-num-gpus-per-node", "2",
                              "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                              "--ci-load-grad-norm", str(grad_norms), *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    b = metrics_of(tmp_path / "par.jsonl")[0]
    for key in ("train/loss", "train/grad_norm", "train/entropy_loss", "rollout/log_probs"):
        assert abs(ref[key] - b[key]) <= 1e-4 * max(abs(ref[key]), 1e-6), (key, ref[key], b[key])


@pytest.fixture(scope="module")
def full_run(tiny_model_dir, replay_dumps, tmp_path_factory, train_cli, metrics_of):
    out = tmp_path_factory.mktemp("full")
    proc = train_cli(args_for(tiny_model_dir, replay_dumps, out, "full"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics_of(out / "full.jsonl")


def strip_perf(rows):
    """Without the wall-clock metrics (durations, and the --async timeline's timestamps): metrics.is_timing_metric."""
    from slime_lite.metrics import is_timing_metric

    return [{k: v for k, v in r.items() if not is_timing_metric(k)} for r in rows]


def test_replay_twice_is_bitwise_identical(tiny_model_dir, replay_dumps, tmp_path, train_cli, metrics_of, full_run):
    proc = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "two"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert strip_perf(full_run) == strip_perf(metrics_of(tmp_path / "two.jsonl"))


def test_resume_matches_uninterrupted(tiny_model_dir, replay_dumps, tmp_path, train_cli, metrics_of, full_run):
    ckpt, norms = tmp_path / "ckpt", tmp_path / "gn.json"
    part = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "part", "--num-rollout", "1", "--save",
                              str(ckpt), "--save-interval", "1", "--ci-save-grad-norm", str(norms)))
    assert part.returncode == 0, part.stderr[-3000:]
    assert (ckpt / "latest").read_text() == "iter_0000000" and (ckpt / "iter_0000000" / "hf" / "model.safetensors").exists()
    # a rollout that fails a check (here the grad-norm regression check) leaves no checkpoint a resume would take
    saved = json.loads(norms.read_text())
    saved["grad_norms"][0]["grad_norm"] *= 2
    norms.write_text(json.dumps(saved))
    failed = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "failed", "--num-rollout", "1", "--save",
                                str(tmp_path / "ckpt2"), "--save-interval", "1", "--ci-load-grad-norm", str(norms)))
    assert failed.returncode == 2 and "grad_norm" in failed.stderr, failed.stderr[-3000:]
    assert not (tmp_path / "ckpt2" / "latest").exists()
    assert [r["rollout_id"] for r in metrics_of(tmp_path / "failed.jsonl")] == [0]  # its metrics are written
    resumed = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "resumed", "--load", str(ckpt)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = metrics_of(tmp_path / "resumed.jsonl")
    assert [r["rollout_id"] for r in rows] == [1]
    assert strip_perf(rows) == strip_perf(full_run[1:])


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--n-samples-per-prompt", "4", "--rollout-batch-size", "2"], "n_samples_per_prompt=2"),
        (["--rollout-batch-size", "2", "--n-samples-per-prompt", "4"], "--n-samples-per-prompt"),
    ],
)
def test_dump_made_with_other_settings_is_refused(tiny_model_dir, replay_dumps, tmp_path, train_cli, extra, needle):
    proc = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "bad", *extra))
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_parallel_sizes_must_divide_model(tiny_model_dir, replay_dumps, tmp_path, train_cli):
    proc = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "bad", "--actor-num-gpus-per-node", "3",
                              "--pipeline-model-parallel-size", "3"))
    assert proc.returncode == 2 and "--pipeline-model-parallel-size" in proc.stderr, proc.stderr[-2000:]


class _RunsCode:
    """A pickle payload that would create ``marker`` when loaded unsafely."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("kind", ["corrupt", "crafted"])
def test_corrupt_or_crafted_checkpoint_is_a_clear_error(tiny_model_dir, replay_dumps, tmp_path, train_cli, kind):
    import torch

    ckpt = tmp_path / "ckpt" / "iter_0000000"
    ckpt.mkdir(parents=True)
    marker = tmp_path / "marker"
    if kind == "corrupt":
        (ckpt / "rank_000.pt").write_bytes(b"not a checkpoint")
    else:
        torch.save({"model": {}, "optimizer": _RunsCode(str(marker)), "rng": {}, "next_rollout_id": 1},
                   ckpt / "rank_000.pt")
    (tmp_path / "ckpt" / "latest").write_text("iter_0000000")
    proc = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "bad", "--load", str(tmp_path / "ckpt")))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"--load {tmp_path / 'ckpt'}: checkpoint {ckpt / 'rank_000.pt'}" in proc.stderr, proc.stderr[-2000:]
    if kind == "corrupt":
        assert "corrupt" in proc.stderr
    else:
        assert "is not a plain-tensor file: it asks to load posix.system" in proc.stderr, proc.stderr[-2000:]
        assert not marker.exists()


def test_non_finite_loss_stops_the_run_before_the_checkpoint(tiny_model_dir, replay_dumps, tmp_path, train_cli):
    """NaN advantages from a buggy advantage hook make the loss NaN: exit 2 naming the rollout, no checkpoint
    saved."""
    ckpt = tmp_path / "ckpt"
    proc = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "nan", "--custom-advantage-function-path",
                              "tests.fakes.nan_hooks.advantage", "--save", str(ckpt), "--save-interval", "1"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "rollout 0: the training loss is not finite from its optimizer step 0 of " in proc.stderr, (
        proc.stderr[-3000:])
    assert "train/loss=nan" in proc.stderr
    assert not (ckpt / "latest").exists()
    steps = [json.loads(line) for line in (tmp_path / "nan.train_steps.jsonl").read_text().splitlines()]
    assert steps and steps[0]["rollout_id"] == 0 and math.isnan(steps[0]["train/loss"])  # logged before the stop


def test_a_dump_with_a_non_finite_rollout_log_prob_is_refused(tiny_model_dir, replay_dumps, tmp_path, train_cli):
    """An engine's NaN log-prob in a dump is named before anything starts (it would train through --use-tis, on a
    masked token too)."""
    import torch

    for rid in (0, 1):
        data = torch.load(replay_dumps.format(rollout_id=rid), weights_only=True)
        data["samples"][3]["rollout_log_probs"][0] = float("nan")
        torch.save(data, tmp_path / f"nan_{rid}.pt")
    proc = train_cli(args_for(tiny_model_dir, str(tmp_path / "nan_{rollout_id}.pt"), tmp_path, "nan", "--use-tis"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "samples[3].rollout_log_probs[0] = nan is not finite" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("estimator", ["ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_estimators_train(tiny_model_dir, replay_dumps, tmp_path, train_cli, metrics_of, estimator):
    proc = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "m", "--advantage-estimator", estimator,
                              "--kl-coef", "0.01", "--kl-loss-coef", "0",  # one KL (slime's rule): in the reward
                              "--num-rollout", "2", "--dump-details", str(tmp_path / "d")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics_of(tmp_path / "m.jsonl")
    assert all(math.isfinite(r["train/grad_norm"]) for r in rows)
    assert rows[0]["rollout/kl"] == 0.0
    from slime_lite.backends.megatron.train_dump import load_train_dump  # --dump-details writes them, as in slime

    train = load_train_dump(str(tmp_path / "d" / "train_data" / "1_0.pt"))
    assert ("values" in train.rows[0]) == (estimator == "ppo") and "entropy" in train.rows[0]
    if estimator == "ppo":
        assert rows[0]["rollout/values"] == 0.0  # value head starts at zero
        assert math.isfinite(rows[0]["train/critic-value_loss"]) and rows[0]["train/critic-value_loss"] > 0
        assert rows[1]["rollout/values"] != 0.0  # the critic learned
    else:  # advantages are whitened over the batch's tokens
        import torch

        adv = torch.tensor([a for s in torch.load(tmp_path / "d" / "train_data" / "0.pt", weights_only=True)["advantages"] for a in s])
        assert abs(float(adv.mean())) < 1e-5 and abs(float(adv.std()) - 1) < 1e-3


def test_slime_dump_without_meta_and_dump_details(tiny_model_dir, replay_dumps, tmp_path, train_cli):
    import torch

    for rid in (0, 1):  # slime's own payload: only rollout_id and samples
        data = torch.load(replay_dumps.format(rollout_id=rid), weights_only=True)
        torch.save({"rollout_id": rid, "samples": data["samples"]}, tmp_path / f"slime_{rid}.pt")
    details = tmp_path / "details"
    argv = args_for(tiny_model_dir, str(tmp_path / "slime_{rollout_id}.pt"), tmp_path, "m", "--dump-details",
                    str(details), "--n-samples-per-prompt", "4", "--rollout-batch-size", "2")  # no meta: not checked
    proc = train_cli(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (details / "args.json").exists()
    train = torch.load(details / "train_data" / "1.pt", weights_only=True)
    samples = torch.load(tmp_path / "slime_1.pt", weights_only=True)["samples"]
    assert len(train["log_probs"]) == len(samples)
    for key in ("ref_log_probs", "rollout_log_probs", "advantages", "returns", "kl"):
        assert [len(x) for x in train[key]] == [s["response_length"] for s in samples], key


def _split_dump(dumps: str, out, split: set[int]) -> str:
    """Rollout 0 of ``dumps`` with the trajectories of ``split`` (sample positions) each trained as two samples, as
    an agent's rewritten history gives them: the first response token alone, then the whole sequence with the rest
    as its response (sharing ``rollout_id``, with the group-normalised reward the rollout manager gives them)."""
    import dataclasses

    import torch

    from slime_lite import rl_math
    from slime_lite.rollout.dumps import load_rollout_dump, save_rollout_dump
    from slime_lite.types import POST_PROCESSED_REWARD

    dump = load_rollout_dump(dumps.format(rollout_id=0))
    n = dump.meta["n_samples_per_prompt"]
    normalized = rl_math.group_normalized("grpo", torch.tensor([s.reward for s in dump.samples], dtype=torch.float64),
                                          n).tolist()
    parts = []
    for i, s in enumerate(dump.samples):
        meta = {**s.metadata, POST_PROCESSED_REWARD: normalized[i]}
        if i not in split:
            parts.append(dataclasses.replace(s, metadata=meta))
            continue
        r = s.response_length
        parts.append(dataclasses.replace(s, tokens=s.tokens[:len(s.tokens) - r + 1], response_length=1, loss_mask=[1],
                                         rollout_log_probs=s.rollout_log_probs[:1], rollout_id=i, metadata=dict(meta)))
        parts.append(dataclasses.replace(s, response_length=r - 1, loss_mask=[1] * (r - 1),
                                         rollout_log_probs=s.rollout_log_probs[1:], rollout_id=i, metadata=dict(meta)))
    for k, s in enumerate(parts):
        s.index = k
    out.mkdir()
    save_rollout_dump(str(out / "dump_0.pt"), 0, parts, dump.meta)
    return str(out / "dump_{rollout_id}.pt")


def test_a_split_trajectory_trains_as_the_whole_one(tiny_model_dir, replay_dumps, tmp_path, train_cli, metrics_of,
                                                    single_gpu_metrics):
    """Trajectories split into two samples each (one in the first step: 5 samples for 4 trajectories, two in the
    second: 6) train as the unsplit rollout: steps of --global-batch-size trajectories, each trajectory one token
    mean over its samples. On DP 2 x PP 2 with --micro-batch-size 2 the steps' micro-batches have 1 or 2 rows (the
    stages exchange their shapes); --ci-load-grad-norm of the unsplit (1, 1, 1) run passes step by step."""
    ref, grad_norms = single_gpu_metrics
    dumps = _split_dump(replay_dumps, tmp_path / "split", {0, 4, 5})
    proc = train_cli(args_for(tiny_model_dir, dumps, tmp_path, "split", *TWO_STEPS, "--actor-num-gpus-per-node", "4",
                              "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                              "--ci-load-grad-norm", str(grad_norms)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    b = metrics_of(tmp_path / "split.jsonl")[0]
    assert b["rollout/samples_per_trajectory"] == 11 / 8
    for key in ("train/loss", "train/grad_norm", "train/entropy_loss", "train/kl_loss", "train/pg_loss"):
        assert abs(ref[key] - b[key]) <= 1e-4 * max(abs(ref[key]), 1e-6), (key, ref[key], b[key])
