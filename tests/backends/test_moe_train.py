"""Mixture-of-Experts in the Megatron trainer (tiny Qwen3-MoE and Qwen2-MoE on CPU, gloo): the Megatron MoE model
computes HF's logits, its weights read back by their on-disk per-expert names, the conversion is exact for every
TP x EP split, and replays under TP (with sequence parallelism), PP, DP and EP give the single-rank run's loss and
grad-norms, a checkpoint saved under EP resumes to the uninterrupted run's next rollout, and the HF export carries
every expert."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from slime_lite.errors import SlimeLiteError
from slime_lite.io import free_port

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """``{arch: checkpoint folder}`` of a 2-layer random tiny Qwen3-MoE and Qwen2-MoE (4 experts, top 2)."""
    from slime_lite.tiny_model import make_tiny_model

    out = {}
    for arch in ("qwen3_moe", "qwen2_moe"):
        out[arch] = tmp_path_factory.mktemp(arch) / "model"
        make_tiny_model(out[arch], arch=arch, warm_start_steps=0, num_layers=2)
    return out


def disk_state(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def single_rank():
    from slime_lite.backends.megatron import parallel

    parallel.init_distributed(1, 1, 0, 1, "127.0.0.1", free_port(), seed=3)
    yield
    parallel.destroy()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_megatron_moe_model_gives_hf_logits_and_weights_back(single_rank, moe_models, arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime_lite.backends.megatron.convert import iter_hf_weights, load_hf_weights
    from slime_lite.backends.megatron.model import build_gpt_model, forward_logits

    path = moe_models[arch]
    cfg = AutoConfig.from_pretrained(path)
    model = build_gpt_model(cfg)
    c = model.config
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (4, 2, 96)
    assert c.moe_router_pre_softmax == (arch == "qwen2_moe")  # norm_topk_prob: Qwen3-MoE True, Qwen2-MoE False
    assert c.moe_shared_expert_gate == (arch == "qwen2_moe")
    load_hf_weights(model, str(path), cfg)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    x = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (forward_logits(model.eval(), x) - hf(x).logits).abs().max().item()
    assert diff < 1e-5, diff
    got, disk = dict(iter_hf_weights(model, cfg)), disk_state(path)
    assert set(got) == set(disk) and "model.layers.1.mlp.experts.3.down_proj.weight" in got
    assert all(torch.equal(got[k], disk[k]) for k in disk)


def test_conversion_round_trips_every_tp_ep_split(moe_models):
    from slime_lite.backends.megatron.convert import hf_to_megatron_shard, megatron_to_hf

    path = moe_models["qwen2_moe"]
    cfg, state = json.loads((path / "config.json").read_text()), disk_state(path)
    for tp, ep in ((1, 2), (2, 2), (2, 4)):
        shards = [[hf_to_megatron_shard(state, cfg, t, tp, 0, 1, ep_rank=e, ep_size=ep)
                   for e in range(ep) for t in range(tp)]]
        assert shards[0][-1]["decoder.layers.0.mlp.router.weight"].shape == (4, 128)
        assert len([n for n in shards[0][0] if ".local_experts." in n]) == 2 * 2 * 4 // ep  # layers x fc1/2 x local
        back = megatron_to_hf(shards, cfg, ep_size=ep)
        assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state), (tp, ep)
    with pytest.raises(SlimeLiteError, match="--expert-model-parallel-size 3 must divide the model's num_experts"):
        hf_to_megatron_shard(state, cfg, 0, 1, 0, 1, ep_rank=0, ep_size=3)


BASE = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--use-kl-loss", "--kl-loss-coef", "0.1",
        "--entropy-coef", "0.01", "--lr", "1e-4", "--seed", "7", "--num-steps-per-rollout", "2"]


@pytest.mark.slow
def test_moe_layouts_give_the_single_rank_run_and_resume_under_ep(moe_models, tmp_path, train_cli, metrics_of):
    """Qwen2-MoE (routed experts and the gated shared expert): (TP, PP, DP, EP) = (2, 1, 1, 1) with sequence
    parallelism, (1, 2, 1, 1), (1, 1, 2, 1) and (1, 1, 2, 2) pass --ci-load-grad-norm of the (1, 1, 1, 1) run at
    every step of rollout 0 with its loss; the EP=2 run's checkpoint resumes into rollout 1 with the uninterrupted
    run's grad-norms, and its HF export holds every expert by its global id."""
    from tests.backends.conftest import make_replay_dumps

    model = moe_models["qwen2_moe"]
    dumps = make_replay_dumps(model, tmp_path / "dumps", num_rollout=2)
    norms = tmp_path / "grad_norms.json"

    def run(name, *extra):
        proc = train_cli(["--load-debug-rollout-data", dumps, "--hf-checkpoint", str(model), *BASE,
                          "--metrics-path", str(tmp_path / f"{name}.jsonl"), *extra])
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        return metrics_of(tmp_path / f"{name}.jsonl")

    ref = run("ref", "--num-rollout", "2", "--ci-save-grad-norm", str(norms))
    assert ref[0]["train/train_rollout_logprob_abs_diff"] < 1e-5  # Megatron MoE log-probs are HF's
    ckpt = tmp_path / "ckpt"
    layouts = {"tp2-sp": ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
               "pp2": ("--pipeline-model-parallel-size", "2"), "dp2": (),
               "dp2-ep2": ("--expert-model-parallel-size", "2", "--save", str(ckpt), "--save-interval", "1")}
    for name, extra in layouts.items():
        got = run(name, "--num-rollout", "1", "--actor-num-gpus-per-node", "2", "--ci-load-grad-norm", str(norms),
                  *extra)[0]
        for key in ("train/loss", "train/grad_norm", "rollout/log_probs"):
            assert abs(ref[0][key] - got[key]) <= 1e-4 * max(abs(ref[0][key]), 1e-6), (name, key)
    exported = disk_state(ckpt / "iter_0000000" / "hf")
    assert set(exported) == set(disk_state(model))
    resumed = run("resumed", "--num-rollout", "2", "--actor-num-gpus-per-node", "2", "--expert-model-parallel-size",
                  "2", "--load", str(ckpt), "--ci-load-grad-norm", str(norms))
    assert [r["rollout_id"] for r in resumed] == [1]
    assert abs(resumed[0]["train/loss"] - ref[1]["train/loss"]) <= 1e-4 * max(abs(ref[1]["train/loss"]), 1e-6)


def _forced_routing(hf, forced: list[torch.Tensor]):
    """Make HF's routers pick ``forced[layer]`` ([tokens, k]) with their own softmax weights of those experts, as
    Megatron's router replay does; returns the hooks' handles."""
    handles = []
    for layer, ids in zip(hf.model.layers, forced):
        gate = layer.mlp.gate

        def forward(hidden, gate=gate, ids=ids):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
            if gate.norm_topk_prob:
                probs = probs / probs.sum(dim=-1, keepdim=True)
            return logits, probs.to(logits.dtype), ids

        gate.forward = forward
        handles.append(gate)
    return handles


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_rollout_routing_replay_routes_the_trainer_to_the_rollouts_experts(moe_models, tmp_path, train_cli,
                                                                           metrics_of, arch):
    """--use-rollout-routing-replay on dumps whose routed experts are not what the trainer would pick (each of HF's
    experts shifted by one) and whose log-probs are HF's under that routing: the trainer's log-probs equal them
    (it routed every token as the rollout said, in forward and backward: the run trains), and the routing mismatch
    is 1 in the first layer; without replay the same log-probs are far off (--get-mismatch-metrics computes them
    too: train/train_rollout_logprob_abs_diff_without_replay)."""
    from transformers import AutoModelForCausalLM

    from slime_lite.rollout.dumps import make_meta, save_rollout_dump
    from slime_lite.tokenizer import load_tokenizer, tokenizer_fingerprint
    from slime_lite.types import Sample, Status

    model = moe_models[arch]
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    tok = load_tokenizer(str(model))
    gen = torch.Generator().manual_seed(0)
    samples, off = [], 0.0
    for gi in range(4):
        ids = tok(f"{gi + 3}+{gi}=", add_special_tokens=False)["input_ids"]
        for j in range(2):
            seq = ids + torch.randint(4, 60, (3 + j,), generator=gen).tolist()
            picked = []
            hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: picked.append(out[2]))
                     for layer in hf.model.layers]
            with torch.no_grad():
                own = torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1)
            for h in hooks:
                h.remove()
            shifted = [(p + 1) % 4 for p in picked]  # 4 experts: never the same set
            saved = {layer: layer.mlp.gate.forward for layer in hf.model.layers}
            _forced_routing(hf, shifted)
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1)
            for layer, fwd in saved.items():
                layer.mlp.gate.forward = fwd
            resp = seq[len(ids):]
            rlp = [lp[len(ids) - 1 + k, t].item() for k, t in enumerate(resp)]
            off = max(off, max(abs(own[len(ids) - 1 + k, t].item() - v) for k, t, v in zip(range(9), resp, rlp)))
            table = torch.stack(shifted, dim=1)[:-1].to(torch.int32)  # [len - 1, layers, k]: SGLang's rows
            samples.append(Sample(group_index=gi, index=len(samples), prompt="p", tokens=seq, response_length=len(resp),
                                  label="0", reward=float(j), loss_mask=[1] * len(resp), rollout_log_probs=rlp,
                                  rollout_routed_experts=table, status=Status.COMPLETED))
    assert off > 1e-3  # the routing matters for these log-probs
    meta = type("A", (), {"n_samples_per_prompt": 2, "rollout_batch_size": 4, "hf_checkpoint": str(model)})
    save_rollout_dump(str(tmp_path / "dump_0.pt"), 0, samples, make_meta(meta, tokenizer_fingerprint(tok)))
    proc = train_cli(["--load-debug-rollout-data", str(tmp_path / "dump_{rollout_id}.pt"), "--hf-checkpoint",
                      str(model), *BASE, "--num-rollout", "1", "--use-rollout-routing-replay", "--metrics-path",
                      str(tmp_path / "m.jsonl"), "--get-mismatch-metrics"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = metrics_of(tmp_path / "m.jsonl")[0]
    assert m["train/train_rollout_logprob_abs_diff"] < 1e-5, m["train/train_rollout_logprob_abs_diff"]
    # layer 0 sees HF's own inputs, so its top-k is HF's: never the shifted set; later layers see the replayed
    # routing's hidden states, where their own top-k may happen to be the rollout's
    assert m["train/routing_mismatch/layer_0"] == 1.0 and m["train/routing_mismatch"] > 0.9
    # the same batch with the trainer's own routing: as far from the rollout as HF's own routing is
    assert m["train/train_rollout_logprob_abs_diff_without_replay"] > 1e-3
    assert m["train/replay_logprob_abs_diff"] == pytest.approx(m["train/train_rollout_logprob_abs_diff_without_replay"],
                                                               abs=1e-5)
    assert 0 < m["train/grad_norm"] < float("inf")
