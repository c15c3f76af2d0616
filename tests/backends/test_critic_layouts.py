"""The PPO critic of a model with tied embeddings (Qwen2.5-0.5B's layout) trains under pipeline parallelism: its
value head replaces the tied output layer, so no stage may still all-reduce the embedding's gradient with the last
stage (the first stage did, and waited for the last one forever). Two spawned CPU ranks (gloo, float32): PP=2 gives
the value loss and grad-norm of DP=2 (the single-rank run's)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from slime_lite.io import free_port

pytestmark = pytest.mark.slow

LAYOUTS = {"pp2": ["--pipeline-model-parallel-size", "2"], "dp2": []}


def _rank(rank: int, port: int, model_dir: str, dumps: str, out: str) -> None:
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from slime_lite.args import parse_args
    from slime_lite.backends.megatron.critic import CriticActor
    from slime_lite.backends.megatron.parallel import destroy
    from slime_lite.rollout.dumps import dump_path, load_rollout_dump

    samples = load_rollout_dump(dump_path(dumps, 0)).samples
    old = {i: torch.zeros(s.response_length) for i, s in enumerate(samples)}
    returns = {i: torch.full((s.response_length,), float(s.reward)) for i, s in enumerate(samples)}
    results, store = {}, None
    try:
        for name, extra in LAYOUTS.items():  # one process group; Megatron's groups and the model per layout
            args = parse_args(["--load-debug-rollout-data", dumps, "--hf-checkpoint", model_dir,
                               "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--advantage-estimator",
                               "ppo", "--lr", "1e-4", "--actor-num-gpus-per-node", "2", *extra])
            worker = CriticActor(args, rank, 2)
            worker._store = store
            worker.init("127.0.0.1", port)
            store = store or worker._store or True
            result = worker.train(0, samples, old, returns)
            results[name] = result and result.metrics
            parallel_state.destroy_model_parallel()
    finally:
        destroy()
    with open(f"{out}.{rank}", "w") as f:  # the reporter is the last stage: rank 1 under PP=2, rank 0 under DP=2
        json.dump(results, f)


def test_critic_of_a_tied_model_trains_under_pipeline_parallelism(tmp_path):
    import torch.multiprocessing as mp

    from slime_lite.tiny_model import make_tiny_model
    from tests.backends.conftest import make_replay_dumps

    make_tiny_model(tmp_path / "model", warm_start_steps=0, tie_word_embeddings=True, num_layers=2)
    dumps = make_replay_dumps(tmp_path / "model", tmp_path / "dumps", num_rollout=1)
    out = tmp_path / "metrics.json"
    ctx = mp.spawn(_rank, args=(free_port(), str(tmp_path / "model"), dumps, str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline, "the critic's train step hung (a collective only one stage joined)"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    ranks = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    runs = {name: next(r[name] for r in ranks if r[name]) for name in LAYOUTS}
    for key in ("train/critic-value_loss", "train/critic-grad_norm"):
        assert runs["pp2"][key] > 0 and runs["pp2"][key] == pytest.approx(runs["dp2"][key], rel=1e-5), (key, runs)
