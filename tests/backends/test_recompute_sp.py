"""Activation recompute and sequence parallelism (issue 12 item 4) change memory, not results: one replayed rollout
trained by a TP=2 Megatron job (two spawned CPU ranks, gloo, float32) with --recompute-granularity full (uniform
and block), selective, and --sequence-parallel (padded rows and packed rows whose length is padded to a multiple
of TP) gives the loss, grad-norm and log-probs of the plain run (measured: equal, or within 1.2e-7); step-1 ppo_kl
and KL stay exactly 0; the critic (its value head gathers the sequence under SP) trains to the same values. Without
the TP sum of the sequence-parallel norm gradients the grad-norm is off by 3e-5, without the critic's gather the
values come out half length: both fail here. The bad combinations are refused before Ray starts, naming the flags."""

from __future__ import annotations

import json

import pytest
import torch

from slime_lite.errors import SlimeLiteError
from slime_lite.io import free_port

RECOMPUTE_FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "2"]
RECOMPUTE_FULL_BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"]
PACKED = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "41"]  # odd budget: packed rows of odd length
CONFIGS = {  # each flag once, paired so that one spawn stays cheap; the SP rows are padded to a multiple of TP
    "plain": [],
    "sequence parallel + full uniform 2": ["--sequence-parallel", *RECOMPUTE_FULL_UNIFORM],
    "full block 3": RECOMPUTE_FULL_BLOCK,
    "packed, sequence parallel + selective": [*PACKED, "--sequence-parallel", "--recompute-granularity", "selective"],
}
CRITIC = ("plain", "sequence parallel + full uniform 2")  # the critic's value head gathers the sequence under SP
CRITIC_KEYS = ("train/critic-value_loss", "train/critic-grad_norm", "values")
KEYS = ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy_loss", "rollout/log_probs")


def _args(model_dir: str, dumps: str, extra: list[str]):
    from slime_lite.args import parse_args

    return parse_args(["--load-debug-rollout-data", dumps, "--hf-checkpoint", model_dir, "--rollout-batch-size", "4",
                       "--n-samples-per-prompt", "2", "--use-kl-loss", "--kl-loss-coef", "0.1", "--entropy-coef",
                       "0.01", "--lr", "1e-4", "--seed", "7", "--tensor-model-parallel-size", "2",
                       "--actor-num-gpus-per-node", "2", *extra])


def _rank(rank: int, port: int, model_dir: str, dumps: str, out: str, common: tuple = ()) -> None:
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from slime_lite.backends.megatron.actor import TrainActor
    from slime_lite.backends.megatron.critic import CriticActor
    from slime_lite.backends.megatron.parallel import destroy
    from slime_lite.rollout.dumps import dump_path, load_rollout_dump

    samples = load_rollout_dump(dump_path(dumps, 0)).samples
    results, store = {}, None
    critic = {f"critic, {name}": extra for name, extra in CONFIGS.items() if name in CRITIC}
    try:
        for name, extra in {**CONFIGS, **critic}.items():  # one process group; Megatron's groups and model per config
            if name in critic:
                worker = CriticActor(_args(model_dir, dumps, [*extra, *common]), rank, 2)
                worker._store = store
                worker.init("127.0.0.1", port)
                old = {i: torch.zeros(s.response_length) for i, s in enumerate(samples)}
                returns = {i: torch.full((s.response_length,), float(s.reward)) for i, s in enumerate(samples)}
                result = worker.train(0, samples, old, returns)  # values of the trained head: not all 0
                values = worker.compute_values(samples)
                results[name] = result and {**result.metrics,
                                            "values": sum(float(v.abs().sum()) for v in values.values())}
                parallel_state.destroy_model_parallel()
                continue
            worker = TrainActor(_args(model_dir, dumps, [*extra, *common]), rank, 2)
            worker._store = store  # None the first time: init opens it; later the process group already exists
            worker.init("127.0.0.1", port)
            store = store or worker._store or True
            cfg = worker.gpt().config
            assert cfg.sequence_parallel == ("--sequence-parallel" in extra), name
            assert cfg.recompute_granularity == (extra[extra.index("--recompute-granularity") + 1]
                                                 if "--recompute-granularity" in extra else None), name
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            reported, _ = worker.train(0, samples, None)  # the reporting rank's (0) result, None elsewhere
            results[name] = reported and reported.metrics
            if reported and torch.cuda.is_available():
                results[name]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            parallel_state.destroy_model_parallel()
    finally:
        destroy()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


@pytest.mark.slow
def test_recompute_and_sequence_parallel_change_nothing_but_memory(tiny_model_dir, replay_dumps, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "metrics.json"
    mp.spawn(_rank, args=(free_port(), str(tiny_model_dir), replay_dumps, str(out)), nprocs=2)
    runs = json.loads(out.read_text())
    critic = [runs.pop(f"critic, {name}") for name in CRITIC]
    assert set(runs) == set(CONFIGS)
    print("critic", {k: (critic[0][k], critic[1][k]) for k in CRITIC_KEYS})
    for key in CRITIC_KEYS:
        assert critic[0][key] > 0 and abs(critic[1][key] / critic[0][key] - 1) <= 1e-6, (key, critic)
    ref = runs["plain"]
    for name, m in runs.items():
        assert m["rollout/kl"] == 0.0 and m["train/first_step/ppo_kl"] == 0.0, name
        rels = {key: abs(m[key] - ref[key]) / max(abs(ref[key]), 1e-12) for key in KEYS}
        print(name, {k: f"{v:.1e}" for k, v in rels.items()})
        assert max(rels.values()) <= 1e-6, (name, rels)
    assert ref["train/grad_norm"] > 0


@pytest.mark.parametrize("extra,named", [
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
    (["--recompute-method", "block", "--recompute-num-layers", "1"], "--recompute-method block does nothing without"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
     "selective .*--recompute-num-layers 1 is for --recompute-granularity full"),
    ([*RECOMPUTE_FULL_UNIFORM[:4], "--recompute-num-layers", "3"], "--recompute-method uniform .* 3 layers.* 4 layers"),
    ([*RECOMPUTE_FULL_BLOCK[:4], "--recompute-num-layers", "5"], "--recompute-num-layers 5 is more than the 4 layers"),
])
def test_bad_recompute_flags_are_refused_naming_them(tiny_model_dir, replay_dumps, extra, named):
    with pytest.raises(SlimeLiteError, match=named):
        _args(str(tiny_model_dir), replay_dumps, extra)


def test_sequence_parallel_is_off_at_tp_1_as_in_megatron(tiny_model_dir, replay_dumps, caplog):
    from slime_lite.args import parse_args
    from slime_lite.backends.megatron.model import memory_overrides

    args = parse_args(["--load-debug-rollout-data", replay_dumps, "--hf-checkpoint", str(tiny_model_dir),
                       "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--sequence-parallel"])
    assert "--sequence-parallel is ignored at --tensor-model-parallel-size 1" in caplog.text
    assert memory_overrides(args)["sequence_parallel"] is False
    assert memory_overrides(_args(str(tiny_model_dir), replay_dumps, ["--sequence-parallel"]))["sequence_parallel"]


def test_packed_row_is_padded_to_a_multiple_of_tp_with_a_segment_of_its_own():
    from slime_lite.backends.megatron.batch import make_packed_micro_batch
    from slime_lite.backends.megatron.loss import response_slices
    from slime_lite.types import Sample

    samples = [Sample(tokens=[5, 6, 7, 8], response_length=2), Sample(tokens=[9, 10, 11], response_length=1)]
    mb = make_packed_micro_batch(samples, [0, 1], multiple=4)
    assert mb.tokens.tolist() == [[5, 6, 7, 8, 9, 10, 11, 0]]
    assert mb.cu_seqlens.tolist() == [0, 4, 7, 8] and mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    per_position = torch.arange(8.0)
    assert [t.tolist() for t in response_slices(per_position, mb.prompt_lengths, mb.response_lengths)] == [
        [1.0, 2.0], [5.0]]  # the padding segment is never read
    assert make_packed_micro_batch(samples, [0, 1]).tokens.shape == (1, 7)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_recompute_and_sequence_parallel_in_bf16_on_two_gpus(tiny_model_dir, replay_dumps, tmp_path):
    """The same four configs on NCCL in bf16: printed spread and peak memory; equal within bf16 tolerance."""
    import torch.multiprocessing as mp

    out = tmp_path / "metrics.json"
    mp.spawn(_rank, args=(free_port(), str(tiny_model_dir), replay_dumps, str(out), ("--bf16",)), nprocs=2)
    runs = json.loads(out.read_text())
    ref = runs["plain"]
    for name in CONFIGS:
        m = runs[name]
        rels = {key: abs(m[key] - ref[key]) / max(abs(ref[key]), 1e-12) for key in ("train/loss", "train/grad_norm")}
        print(f"bf16 {name}: ppo_kl {m['train/first_step/ppo_kl']:.3g} peak {m['peak_gib']:.3f} GiB",
              {k: f"{v:.1e}" for k, v in rels.items()})
        assert abs(m["train/first_step/ppo_kl"]) < 1e-3 and max(rels.values()) < 3e-2, (name, rels)
