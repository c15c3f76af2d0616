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
    _, hf = qwen2_moe
    block = hf.model.layers[0].mlp
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
