"""engine/moe.py and the engine's weights of an MoE model: the fixed-shape experts of captured decode steps (both
ways: gathered per choice, dense over experts) compute what HF's experts module does, and weights load, read back
and checksum by the on-disk per-expert names as well as by the fused in-memory ones."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from slime_lite.engine import moe


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from slime_lite.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp("qwen2_moe")
    make_tiny_model(out, arch="qwen2_moe", warm_start_steps=0, num_layers=2, num_experts=8)
    return out, AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()


@pytest.mark.parametrize("rows", [1, 3, 16], ids=["gathered", "gathered-3", "dense"])  # 8 experts, top 2
def test_fixed_shape_experts_equal_hf_sparse_moe_block(qwen2_moe, rows):
    import copy

    _, hf = qwen2_moe
    block = copy.deepcopy(hf.model.layers[0].mlp)  # its router changed below: the model stays the checkpoint's
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hf.config.hidden_size, generator=g)
    with torch.no_grad():
        block.gate.weight.normal_(generator=g)  # a router that spreads tokens over the experts
        want = block(x[None])[0]
        eager, ids = moe.moe_mlp(block, x)
        fixed, fixed_ids = moe.moe_mlp(block, x, fixed=True)
    assert ids.shape == (rows, 2) and torch.equal(ids, fixed_ids)
    assert (eager - want).abs().max() < 1e-6 and (fixed - want).abs().max() < 1e-5


def test_weights_load_and_checksum_by_per_expert_and_fused_names(qwen2_moe):
    from slime_lite.engine.weights import Weights

    path, hf = qwen2_moe
    w = Weights(hf)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        disk = set(f.keys())
    assert set(w.checksums()) == disk  # what a trainer pushes and checks: every expert by its global id
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    new = torch.randn(w.params[name].shape)
    assert w.load_named({name: new}) == 1
    fused = hf.model.layers[1].mlp.experts.gate_up_proj
    inter = fused.shape[1] // 2
    assert torch.equal(fused[5, inter:], new) and w.get_by_name(name, 2) == new[:2].tolist()
    before = w.checksums([name])
    w.load_named({"model.layers.1.mlp.experts.gate_up_proj": torch.zeros_like(fused)})
    assert fused.abs().sum() == 0 and w.checksums([name]) != before
    assert w.load_from_disk(str(path)) == len(disk)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert torch.equal(fused[5, inter:], f.get_tensor(name))


def hf_routes(hf, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), layers, top_k]``: the experts HF's routers pick for each position (sorted)."""
    picked = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: picked.append(out[2]))
             for layer in hf.model.layers]
    try:
        with torch.no_grad():
            hf(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(picked, dim=1).sort(dim=-1).values


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("device,padded", [("cpu", False), ("cpu", True), pytest.param("cuda", True, marks=_CUDA)],
                         ids=["eager_decode", "padded_steps", "cuda_graphs"])
def test_engine_returns_the_experts_hf_routes_every_position_to(qwen2_moe, device, padded):
    """--enable-return-routed-experts: a finished request carries, for every position that went through the model
    (prompt and output but the last token), each MoE layer's top-k experts, HF's own; from
    routed_experts_start_len on; and a prompt whose prefix came from the prefix cache gets the prefix's too. On a
    GPU the decode steps are captured CUDA graphs writing the experts (float32)."""
    from slime_lite.engine.request import Request
    from slime_lite.engine.sampling import SamplingParams
    from slime_lite.engine.scheduler import Scheduler

    path, hf = qwen2_moe
    s = Scheduler(str(path), device=device, dtype="float32", max_running_requests=4, kv_cache_tokens=4 * 96,
                  cuda_graph=padded, enable_return_routed_experts=True)
    s.start()
    try:
        def run(prompts, start=0):
            import threading

            outs, done = {}, threading.Semaphore(0)
            for i, p in enumerate(prompts):
                req = Request(rid=f"r{i}{start}", input_ids=p, params=SamplingParams.from_dict(
                    {"max_new_tokens": 12, "temperature": 1.0}), seed=i, return_routed_experts=True,
                    routed_experts_start_len=start, on_output=lambda o, i=i: (outs.__setitem__(i, o), done.release()))
                s.prepare(req)
                s.submit(req)
            for _ in prompts:
                assert done.acquire(timeout=120)
            return [outs[i] for i in range(len(prompts))]

        prompts = [[3, 9, 27, 4, 11], [5, 6, 7], [8, 1, 2, 30, 31, 32, 33]]
        outs = run(prompts)
        for p, o in zip(prompts, outs):
            seq = p + o.output_ids
            assert o.routed_experts.shape == (len(seq) - 1, 2, 2) and o.routed_experts.dtype == torch.int32
            assert torch.equal(o.routed_experts.sort(dim=-1).values.long(), hf_routes(hf, seq[:-1]))
        longer = prompts[0] + outs[0].output_ids[:6] + [12]
        (o,) = run([longer], start=2)
        assert o.cached_tokens >= len(prompts[0])
        seq = longer + o.output_ids
        assert torch.equal(o.routed_experts.sort(dim=-1).values.long(), hf_routes(hf, seq[:-1])[2:])
    finally:
        s.stop()


def test_routed_experts_have_a_row_per_layer_when_some_layers_are_dense(qwen2_moe, tmp_path):
    """An MoE checkpoint with dense layers among the sparse ones (``mlp_only_layers``): the table has a row for every
    layer, by its number, as SGLang's (``[positions, num_hidden_layers, top_k]``, a dense layer's row 0) and as the
    trainer reads it; the sparse layers' rows are HF's routes (they were packed, so a reshape by the layer count
    failed)."""
    import shutil
    import threading

    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    from slime_lite.engine.request import Request
    from slime_lite.engine.sampling import SamplingParams
    from slime_lite.engine.scheduler import Scheduler

    path, _ = qwen2_moe
    for f in path.iterdir():  # the tokenizer
        if f.name.startswith("tokenizer") or f.name.endswith("_map.json"):
            shutil.copy(f, tmp_path / f.name)
    cfg = Qwen2MoeConfig(vocab_size=_vocab(path), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
                         max_position_embeddings=256, architectures=["Qwen2MoeForCausalLM"])
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(str(tmp_path))
    s = Scheduler(str(tmp_path), device="cpu", dtype="float32", max_running_requests=2, kv_cache_tokens=2 * 64,
                  enable_return_routed_experts=True)
    s.start()
    try:
        got, done = [], threading.Event()
        req = Request(rid="r", input_ids=[3, 9, 27, 4, 11], params=SamplingParams.from_dict({"max_new_tokens": 6}),
                      seed=0, return_routed_experts=True, on_output=lambda o: (got.append(o), done.set()))
        s.prepare(req)
        s.submit(req)
        assert done.wait(120) and got[-1].finish_reason is not None
        out = got[-1]
        seq = req.input_ids + out.output_ids
        assert out.routed_experts.shape == (len(seq) - 1, 3, 2)
        assert not out.routed_experts[:, 1].any()  # the dense layer
        sparse = [hf.model.layers[0], hf.model.layers[2]]
        picked = []
        hooks = [ly.mlp.gate.register_forward_hook(lambda m, i, o: picked.append(o[2])) for ly in sparse]
        with torch.no_grad():
            hf(torch.tensor([seq[:-1]]))
        for h in hooks:
            h.remove()
        want = torch.stack(picked, dim=1).sort(dim=-1).values
        assert torch.equal(out.routed_experts[:, [0, 2]].sort(dim=-1).values.long(), want)
    finally:
        s.stop()


def _vocab(path) -> int:
    import json

    return json.loads((path / "config.json").read_text())["vocab_size"]
