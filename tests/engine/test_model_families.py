"""The embedded engine serves Qwen3 (QK-norm, a head size that is not hidden / heads), GLM4 (partial interleaved
rotary, q/k/v biases, post-attention and post-MLP norms, fused gate/up), Qwen3-MoE (routed experts, renormalised
top-k weights) and Qwen2-MoE (routed experts and a gated shared expert): its log-probs equal the HF model's own
forward in float32, through prefill, the prefix cache's extend, eager decode and the padded decode steps that are
CUDA graphs on a GPU (eagerly on CPU; the captured ones and the fused kernels in the gpu-marked test below)."""

from __future__ import annotations

import json

import pytest
import torch

from test_padded_decode import run_requests

# id: (family, make_tiny_model's sizes, config.json fields set after); Qwen3's head: 48 of 128 / 4. The variants
# real checkpoints have: one K/V head of 24 dims, GLM4's rotary over a quarter of each head
ARCHS = {"qwen3": ("qwen3", {"head_dim": 48}, {}), "glm4": ("glm4", {}, {}), "qwen3_moe": ("qwen3_moe", {}, {}),
         "qwen2_moe": ("qwen2_moe", {}, {}), "qwen3_kv1_head24": ("qwen3", {"head_dim": 24, "num_kv_heads": 1}, {}),
         "glm4_rotary_quarter": ("glm4", {}, {"partial_rotary_factor": 0.25})}
TOL = 1e-4  # float32; a layer feature the engine left out moves the log-probs by far more (the guard below)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def family_model(request, tmp_path_factory):
    """(arch, folder, HF model): a tiny random model of the family, its weights (norms too) perturbed so that
    every part of the layer changes the log-probs."""
    from transformers import AutoModelForCausalLM

    from slime_lite.tiny_model import make_tiny_model

    arch, sizes, fields = ARCHS[request.param]
    out = tmp_path_factory.mktemp(f"tiny_{request.param}")
    make_tiny_model(out, arch=arch, warm_start_steps=0, num_layers=2, **sizes)
    if fields:
        cfg = json.loads((out / "config.json").read_text())
        rope = {**cfg.get("rope_parameters", {}), **fields} if "rope_parameters" in cfg else None
        (out / "config.json").write_text(json.dumps({**cfg, **fields} | ({"rope_parameters": rope} if rope else {})))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    hf.save_pretrained(str(out))
    return arch, out, hf.eval()


def hf_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def worst_diff(hf, outs, prompts) -> float:
    return max((torch.tensor(o.output_logprobs) - hf_logprobs(hf, p, o.output_ids)).abs().max().item()
               for o, p in zip(outs, prompts))


PROMPTS = [[3, 9, 27, 4, 11], [5, 6, 7], [8, 1, 2, 30, 31, 32, 33]]


@pytest.mark.parametrize("padded", [False, True], ids=["eager_decode", "padded_steps"])
def test_engine_log_probs_equal_the_hf_forward(family_model, padded):
    from slime_lite.engine.scheduler import Scheduler

    arch, path, hf = family_model
    s = Scheduler(str(path), device="cpu", max_running_requests=4, kv_cache_tokens=4 * 160, cuda_graph=padded)
    s.start()
    try:
        assert (s.decoder is not None) == padded
        assert s.lm.head_dim == hf.config.head_dim and (s.lm.layers[0].qk_norm is not None) == (arch.startswith("qwen3"))
        outs = run_requests(s, [(p, 40, 7 + i) for i, p in enumerate(PROMPTS)])
        assert sum(len(o.output_ids) for o in outs) > 30  # (a drawn end-of-text token ends a request early)
        assert worst_diff(hf, outs, PROMPTS) < TOL
        # a prompt that starts like an earlier one: its prefix's K/V from the cache, the rest by the extend path
        longer = PROMPTS[0] + outs[0].output_ids[:10] + [12, 13]
        (out,) = run_requests(s, [(longer, 20, 99)])
        assert out.cached_tokens >= len(PROMPTS[0])
        assert worst_diff(hf, [out], [longer]) < TOL
    finally:
        s.stop()


def test_a_missing_family_feature_would_move_the_log_probs_past_the_tolerance(family_model):
    """The guard of the tolerance: the HF model without QK-norm (Qwen3), without its post-norms (GLM4), with the
    top-k weights not renormalised (Qwen3-MoE) or without the shared expert (Qwen2-MoE)."""
    import copy

    arch, _, hf = family_model
    plain = copy.deepcopy(hf)
    for layer in plain.model.layers:
        if arch == "qwen3":
            layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()
        elif arch == "glm4":
            layer.post_self_attn_layernorm = layer.post_mlp_layernorm = torch.nn.Identity()
        elif arch == "qwen3_moe":
            layer.mlp.gate.norm_topk_prob = False
        else:
            torch.nn.init.zeros_(layer.mlp.shared_expert.down_proj.weight)
    output = list(range(10, 40))
    assert (hf_logprobs(hf, PROMPTS[0], output) - hf_logprobs(plain, PROMPTS[0], output)).abs().max() > 100 * TOL


def test_an_architecture_the_engine_cannot_serve_names_it_and_the_way_out(tiny_model_dir, tmp_path):
    import shutil

    from slime_lite.engine.model import load_hf_model
    from slime_lite.errors import SlimeLiteError

    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg | {"model_type": "mistral",
                                                                  "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(SlimeLiteError, match=r"architecture MistralForCausalLM .*Qwen3ForCausalLM.*Glm4ForCausalLM.*"
                                             r"--rollout-backend sglang"):
        load_hf_model(str(tmp_path / "m"), "auto", torch.device("cpu"))



def test_a_checkpoint_missing_a_weight_is_refused_not_initialised_at_random(tiny_model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from slime_lite.engine.model import load_hf_model
    from slime_lite.errors import SlimeLiteError

    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    state = load_file(folder / "model.safetensors")
    for key in ("model.layers.1.input_layernorm.weight", "lm_head.weight"):
        save_file({k: v for k, v in state.items() if k != key}, folder / "model.safetensors")
        with pytest.raises(SlimeLiteError, match=rf"--model-path {folder}: the checkpoint lacks 1 weight.*{key}"):
            load_hf_model(str(folder), "auto", torch.device("cpu"))
    cfg = json.loads((folder / "config.json").read_text())  # tied: lm_head is the embedding, never on disk
    (folder / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": True}))
    model = load_hf_model(str(folder), "auto", torch.device("cpu"))
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile_layers", [False, True], ids=["fused_kernels", "torch_compile"])
def test_captured_decode_steps_equal_eager_decode_and_the_hf_forward_on_a_gpu(family_model, compile_layers):
    """On CUDA: decode steps captured as CUDA graphs, with the fused norm/rotary/MLP kernels (QK-norm, interleaved
    partial rotary, post-norms) or the compiled layer pieces, give the eager engine's greedy tokens, and the HF
    forward's log-probs (float32) for greedy and sampled tokens alike.

    Sampled token ids are not compared between the two paths: their log-probs differ by ~1e-6 (different kernels),
    and a uniform draw that falls that close to the boundary between two tokens' cumulative probabilities picks
    either. On an H200 the tiny Qwen2-MoE hit such a draw: one row's 12th sampled token was 41 captured and 42
    eager (HF log-probs -6.57 and -5.42), after 11 tokens whose log-probs agreed to 2.2e-6, both rows within 2.5e-5
    of HF; with greedy decoding all rows were equal."""
    from slime_lite.engine import fused_layer
    from slime_lite.engine.scheduler import Scheduler

    _, path, hf = family_model
    made = {}
    for graphs in (True, False):
        s = Scheduler(str(path), device="cuda", dtype="float32", max_running_requests=4, kv_cache_tokens=4 * 160,
                      cuda_graph=graphs, enable_torch_compile=graphs and compile_layers)
        s.start()
        made[graphs] = s
    try:
        assert fused_layer.usable(made[True].lm.embed.weight)
        specs = [(p, 70, 7 + i) for i, p in enumerate(PROMPTS)]  # past the first length bucket (64)
        got, want = (run_requests(made[g], specs, temperature=0.0) for g in (True, False))
        assert made[True].decoder.graphs and made[True].lm.compiled == compile_layers
        for g, w in zip(got, want):
            assert g.output_ids == w.output_ids
            assert max(abs(a - b) for a, b in zip(g.output_logprobs, w.output_logprobs)) < TOL
        assert worst_diff(hf, got, PROMPTS) < TOL
        sampled = run_requests(made[True], specs)
        assert sum(len(o.output_ids) for o in sampled) > 30  # (a drawn end-of-text token ends a request early)
        assert worst_diff(hf, sampled, PROMPTS) < TOL
    finally:
        for s in made.values():
            s.stop()
