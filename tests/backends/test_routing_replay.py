"""--use-routing-replay (slime's R2) on a tiny Qwen3-MoE, one rank on CPU, no Ray: the trainer records its routing
in the old-policy log-prob pass and replays it in the training passes, so the first step's ratio is exactly 1 with
the same experts, and later steps keep the old policy's experts where the updated routers would pick others."""

from __future__ import annotations

import pytest
import torch

from slime_lite.args import parse_args, parser_defaults
from slime_lite.errors import SlimeLiteError
from slime_lite.io import free_port

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from slime_lite.tiny_model import make_tiny_model

    path = tmp_path_factory.mktemp("qwen3_moe") / "model"
    make_tiny_model(path, arch="qwen3_moe", warm_start_steps=0, num_layers=2)
    return path


def _samples() -> list:
    from slime_lite.types import Sample, Status

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        resp = 3 + i
        out.append(Sample(group_index=i // 4, index=i, tokens=torch.randint(1, 60, (6 + resp,), generator=g).tolist(),
                          response_length=resp, loss_mask=[1] * resp, reward=float(i % 2), status=Status.COMPLETED))
    return out


def _train(model, replay: bool, **flags) -> list[dict]:
    """Rollout 0 in one optimizer step (padded micro-batches), then rollout 1 in four steps at a high learning rate
    (packed micro-batches)."""
    from slime_lite.backends.megatron.actor import TrainActor
    from slime_lite.backends.megatron.parallel import destroy

    args = parser_defaults(hf_checkpoint=str(model), rollout_batch_size=2, n_samples_per_prompt=4,
                           global_batch_size=8, micro_batch_size=2, lr=0.05, seed=1, use_routing_replay=replay,
                           **flags)
    w = TrainActor(args, 0, 1)
    w.init("127.0.0.1", free_port())
    try:
        out = [w.train(0, _samples(), None)[0].metrics]
        w.args.global_batch_size = 2
        w.args.use_dynamic_batch_size, w.args.max_tokens_per_gpu, w.args.log_probs_max_tokens_per_gpu = True, 40, 64
        out.append(w.train(1, _samples(), None)[0].metrics)
    finally:
        destroy()
    return out


def test_routing_replay_gives_the_first_step_the_old_experts_and_holds_them_after_updates(moe_model):
    on, off = _train(moe_model, True), _train(moe_model, False)
    assert on[0]["train/ppo_kl"] == 0.0 and on[0]["train/pg_clipfrac"] == 0.0  # ratio exactly 1
    assert on[0]["train/routing_replay_mismatch"] == 0.0  # the training pass routed every token as the old policy did
    assert on[0]["train/loss"] == off[0]["train/loss"]  # same weights, same experts: replay changes nothing yet
    # after updates the routers would send some tokens elsewhere; replay keeps the old policy's experts, so the
    # later steps' losses differ from the run that routes freely
    assert on[1]["train/routing_replay_mismatch"] > 0 and {"train/routing_replay_mismatch/layer_0",
                                                           "train/routing_replay_mismatch/layer_1"} <= set(on[1])
    assert on[1]["train/loss"] != off[1]["train/loss"]
    assert "train/routing_replay_mismatch" not in off[1] and "train/routing_mismatch" not in on[1]


def test_expert_load_and_router_losses_are_logged_every_rollout(moe_model):
    m = _train(moe_model, False, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    for r in m:  # 4 experts, top 2: max/mean is 1 (balanced) to 2 (every token on the same two)
        assert 1.0 <= r["train/moe/expert_load_max_over_mean"] <= 2.0
        assert {f"train/moe/expert_load_max_over_mean/layer_{i}" for i in (0, 1)} <= set(r)
        assert r["train/moe/load_balancing_loss"] > 0 and r["train/moe/z_loss"] > 0
    assert m[0]["train/moe/z_loss"] != m[1]["train/moe/z_loss"]  # this rollout's, not an accumulation


def test_routing_replay_on_a_dense_model_is_refused_before_ray(tiny_model_dir):
    with pytest.raises(SlimeLiteError, match=r"--use-routing-replay: the model \(qwen2\) has no experts to route; "
                                             r"drop --use-routing-replay \(--hf-checkpoint .* is a dense model\)"):
        parse_args(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tiny_model_dir / "config.json"),
                    "--rm-type", "addition", "--use-routing-replay"])


def test_rollout_routing_replay_of_a_dump_without_routed_experts_is_refused_before_ray(moe_model, tmp_path):
    from slime_lite.preflight import preflight
    from tests.backends.conftest import make_replay_dumps

    dumps = make_replay_dumps(moe_model, tmp_path / "dumps", num_rollout=1)
    args = parse_args(["--hf-checkpoint", str(moe_model), "--load-debug-rollout-data", dumps, "--rollout-batch-size",
                       "4", "--n-samples-per-prompt", "2", "--num-rollout", "1", "--use-rollout-routing-replay"])
    with pytest.raises(SlimeLiteError, match=r"--use-rollout-routing-replay: .*dump_0.pt: sample 0 \(and 7 more\) has "
                                             r"no rollout_routed_experts.*or use --use-routing-replay"):
        preflight(args)
def test_rollout_routing_replay_of_a_dump_of_another_model_is_refused_before_ray(moe_model, tmp_path):
    """A dump whose routed-experts tables do not fit the model (another layer count, top-k or expert count) is
    refused naming the file and the sample, not found inside a train step (a reshape error, or wrong experts)."""
    import json
    import math

    from slime_lite.model_families import num_experts
    from slime_lite.preflight import preflight
    from slime_lite.rollout.dumps import load_rollout_dump, save_rollout_dump
    from tests.backends.conftest import make_replay_dumps

    cfg = json.loads((moe_model / "config.json").read_text())
    layers, top_k, experts = cfg["num_hidden_layers"], cfg["num_experts_per_tok"], num_experts(cfg)
    dumps = make_replay_dumps(moe_model, tmp_path / "dumps", num_rollout=1)
    path = dumps.format(rollout_id=0)
    dump = load_rollout_dump(path)
    args = parse_args(["--hf-checkpoint", str(moe_model), "--load-debug-rollout-data", dumps, "--rollout-batch-size",
                       "4", "--n-samples-per-prompt", "2", "--num-rollout", "1", "--use-rollout-routing-replay"])

    def routed(rows_less: int = 0, layer_count: int = layers, top: int = experts - 1) -> None:
        for s in dump.samples:
            shape = (len(s.tokens) - 1 - rows_less, layer_count, top_k)
            s.rollout_routed_experts = (torch.arange(math.prod(shape)) % (top + 1)).to(torch.int32).reshape(shape)
        save_rollout_dump(path, 0, dump.samples, dump.meta)

    routed()
    preflight(args)
    for bad, problem in (({"layer_count": layers + 1}, r"has \d+ expert ids, expected \d+ \(\(len\(tokens\) - 1\) "
                                                       rf"x {layers} layers x top-{top_k} of --hf-checkpoint\)"),
                         ({"rows_less": 1}, r"has \d+ expert ids, expected \d+ .*"),
                         ({"top": experts}, rf"holds expert ids outside 0..{experts - 1} \(the model's num_experts\)")):
        routed(**bad)
        with pytest.raises(SlimeLiteError, match=r"--use-rollout-routing-replay: .*dump_0.pt: sample \d+: "
                                                 r"rollout_routed_experts " + problem + ": the dump was made with "
                                                 "another model"):
            preflight(args)




def test_router_losses_leave_padding_out(moe_model):
    """The load-balancing and z losses count a sample's tokens only: one sample per micro-batch, padded to the
    longest (--micro-batch-size 1) or packed alone (--use-dynamic-batch-size), gives the same losses and gradient
    (padding was routed and entered both losses, and through them the gradient of every weight)."""
    from slime_lite.backends.megatron.actor import TrainActor
    from slime_lite.backends.megatron.parallel import destroy

    samples = _samples()
    longest = max(len(s.tokens) for s in samples)
    out = []
    for packed in (False, True):
        args = parser_defaults(hf_checkpoint=str(moe_model), rollout_batch_size=2, n_samples_per_prompt=4,
                               global_batch_size=8, micro_batch_size=1, lr=1e-4, seed=1, moe_aux_loss_coeff=0.1,
                               moe_z_loss_coeff=0.01, use_dynamic_batch_size=packed,
                               max_tokens_per_gpu=longest if packed else None)
        w = TrainActor(args, 0, 1)
        w.init("127.0.0.1", free_port())
        try:
            out.append(w.train(0, _samples(), None)[0].metrics)
        finally:
            destroy()
    for key in ("train/grad_norm", "train/moe/load_balancing_loss", "train/moe/z_loss", "train/loss"):
        assert out[0][key] == pytest.approx(out[1][key], rel=1e-5), key
