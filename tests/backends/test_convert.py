"""backends/megatron/convert.py: HF <-> Megatron weights as pure functions over state dicts (no process group)."""

from __future__ import annotations

import re

import pytest
import torch

from slime_lite.backends.megatron.convert import hf_to_megatron_shard, megatron_to_hf
from slime_lite.errors import SlimeLiteError

torch.set_num_threads(1)

LAYOUTS = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)]  # (tp, pp) with tp * pp in {1, 2, 4}


def hf_config(kind: str):
    from transformers import Glm4Config, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96)
    if kind == "qwen2_untied_gqa_bias":  # vocab 101: not divisible by TP 2/4, so the vocab gets padded
        return Qwen2Config(vocab_size=101, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
                           **common)
    if kind == "llama_tied_mha":
        return LlamaConfig(vocab_size=96, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                           **common)
    if kind == "llama_tied_gqa":
        return LlamaConfig(vocab_size=100, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
                           **common)
    if kind == "qwen3_qknorm_headdim":
        return Qwen3Config(vocab_size=100, num_attention_heads=8, num_key_value_heads=4, head_dim=12,
                           tie_word_embeddings=False, **common)
    if kind == "glm4_postnorm_fused_mlp":  # qkv bias, post norms, gate_up_proj; vocab 101 padded for TP
        return Glm4Config(vocab_size=101, num_attention_heads=8, num_key_value_heads=4, head_dim=16, pad_token_id=0,
                          tie_word_embeddings=False, **common)
    if kind == "qwen2_4heads_2groups":
        return Qwen2Config(vocab_size=101, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                           **common)
    raise ValueError(kind)


KINDS = ["qwen2_untied_gqa_bias", "llama_tied_mha", "llama_tied_gqa", "qwen3_qknorm_headdim", "glm4_postnorm_fused_mlp"]


def hf_state(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """A real HF model's state dict (names as in a checkpoint: no lm_head when tied), every value random."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


@pytest.fixture(scope="module", params=KINDS)
def arch(request):
    cfg = hf_config(request.param)
    return cfg, hf_state(cfg)


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_round_trip_hf_megatron_hf_is_bitwise_identical(arch, tp, pp):
    cfg, state = arch
    shards = [[hf_to_megatron_shard(state, cfg, t, tp, p, pp) for t in range(tp)] for p in range(pp)]
    back = megatron_to_hf(shards, cfg)
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert back[name].shape == tensor.shape and torch.equal(back[name], tensor), name


def test_round_trip_also_accepts_the_config_json_dict(arch):
    cfg, state = arch
    as_dict = cfg.to_dict()
    shards = [[hf_to_megatron_shard(state, as_dict, t, 2, p, 2) for t in range(2)] for p in range(2)]
    back = megatron_to_hf(shards, as_dict)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_fused_qkv_holds_each_tp_ranks_query_groups_in_megatron_order():
    cfg = hf_config("qwen2_4heads_2groups")  # head_dim 16
    state = hf_state(cfg)
    hd = 16
    pre = "model.layers.0.self_attn."
    for proj, n in (("q", 4), ("k", 2), ("v", 2)):  # every row of head h of proj holds the value code(proj, h)
        code = {"q": 0, "k": 10, "v": 20}[proj]
        state[pre + f"{proj}_proj.weight"] = torch.arange(n).repeat_interleave(hd)[:, None].float().expand(-1, 64) + code
        state[pre + f"{proj}_proj.bias"] = torch.arange(n).repeat_interleave(hd).float() + code
    for rank, want in enumerate(([0, 1, 10, 20], [2, 3, 11, 21])):  # [q heads of the group, k, v] per group
        shard = hf_to_megatron_shard(state, cfg, rank, 2, 0, 1)
        w = shard["decoder.layers.0.self_attention.linear_qkv.weight"]
        b = shard["decoder.layers.0.self_attention.linear_qkv.bias"]
        assert w.shape == (4 * hd, 64)
        assert w[::hd, 0].tolist() == want and b[::hd].tolist() == want


def test_fc1_is_gate_then_up_per_rank_and_row_parallel_splits_the_input_dim():
    cfg = hf_config("llama_tied_gqa")
    state = hf_state(cfg)
    pre = "model.layers.1.mlp."
    shard = hf_to_megatron_shard(state, cfg, 1, 2, 0, 1)
    fc1 = shard["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:48], state[pre + "gate_proj.weight"][48:]) and torch.equal(fc1[48:], state[pre + "up_proj.weight"][48:])
    assert torch.equal(shard["decoder.layers.1.mlp.linear_fc2.weight"], state[pre + "down_proj.weight"][:, 48:])
    o = state["model.layers.1.self_attn.o_proj.weight"]  # 8 heads of 8: rank 1 reads heads 4..7
    assert torch.equal(shard["decoder.layers.1.self_attention.linear_proj.weight"], o[:, 32:])
    norm = state["model.layers.1.input_layernorm.weight"]
    assert torch.equal(shard["decoder.layers.1.input_layernorm.weight"], norm)


def test_glm4_fused_gate_up_is_split_per_rank_and_its_post_norms_copied():
    cfg = hf_config("glm4_postnorm_fused_mlp")  # intermediate 96: 48 rows of gate and of up per TP rank
    state = hf_state(cfg)
    pre = "model.layers.2."
    gate_up = state[pre + "mlp.gate_up_proj.weight"]
    shard = hf_to_megatron_shard(state, cfg, 1, 2, 1, 2)  # TP rank 1 of PP stage 1: HF layer 2 is local layer 0
    fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:48], gate_up[48:96]) and torch.equal(fc1[48:], gate_up[144:])
    for norm in ("post_self_attn_layernorm", "post_mlp_layernorm"):
        assert torch.equal(shard[f"decoder.layers.0.{norm}.weight"], state[pre + f"{norm}.weight"])
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in shard


def test_vocab_is_padded_with_zero_rows_to_a_multiple_of_tp():
    cfg = hf_config("qwen2_untied_gqa_bias")  # vocab 101
    state = hf_state(cfg)
    ranks = [hf_to_megatron_shard(state, cfg, t, 4, 0, 1) for t in range(4)]
    for name, hf_name in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                          ("output_layer.weight", "lm_head.weight")):
        assert [r[name].shape[0] for r in ranks] == [26, 26, 26, 26]
        full = torch.cat([r[name] for r in ranks])
        assert torch.equal(full[:101], state[hf_name]) and not full[101:].any()


def test_pipeline_stages_hold_their_layers_with_local_ids():
    cfg = hf_config("llama_tied_gqa")
    state = hf_state(cfg)
    first = hf_to_megatron_shard(state, cfg, 0, 1, 0, 2)
    last = hf_to_megatron_shard(state, cfg, 0, 1, 1, 2)
    assert "embedding.word_embeddings.weight" in first and "decoder.final_layernorm.weight" not in first
    assert "output_layer.weight" not in first and "embedding.word_embeddings.weight" not in last
    assert {int(k.split(".")[2]) for k in last if k.startswith("decoder.layers.")} == {0, 1}
    assert torch.equal(last["decoder.layers.0.mlp.linear_fc2.weight"], state["model.layers.2.mlp.down_proj.weight"])
    # tied embeddings: the last stage's output layer is a copy of the embedding
    assert torch.equal(last["output_layer.weight"], state["model.embed_tokens.weight"])
    assert "output_layer.weight" not in hf_to_megatron_shard(state, cfg, 0, 1, 0, 1)  # PP=1: shares the embedding


@pytest.mark.parametrize("tp,pp,flag,what", [
    (3, 1, "--tensor-model-parallel-size 3", "num_attention_heads (4)"),
    (4, 1, "--tensor-model-parallel-size 4", "num_key_value_heads (2)"),
    (1, 3, "--pipeline-model-parallel-size 3", "num_hidden_layers (4)"),
])
def test_parallel_sizes_that_do_not_divide_the_model_name_the_flag(tp, pp, flag, what):
    cfg = hf_config("qwen2_4heads_2groups")
    with pytest.raises(SlimeLiteError) as e:
        hf_to_megatron_shard(hf_state(cfg), cfg, 0, tp, 0, pp)
    assert flag in str(e.value) and what in str(e.value)


def test_unsupported_architecture_is_a_user_error():
    cfg = hf_config("llama_tied_gqa").to_dict() | {"model_type": "gpt2"}
    with pytest.raises(SlimeLiteError, match="model_type 'gpt2'"):
        hf_to_megatron_shard({}, cfg, 0, 1, 0, 1)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe"])
def test_attention_bias_with_an_o_proj_bias_is_refused(model_type):
    """These families' attention_bias also gives o_proj a bias, which Megatron's linear_proj lacks: loading would
    drop it silently (the trainer's log-probs would not be the model's)."""
    from transformers import AutoConfig

    from slime_lite.backends.megatron.model import hf_arch

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16) if model_type == "qwen3_moe" else {}
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, **moe)
    with pytest.raises(SlimeLiteError, match="attention_bias"):
        hf_arch(AutoConfig.for_model(model_type, attention_bias=True, **sizes))
    assert hf_arch(AutoConfig.for_model(model_type, attention_bias=False, **sizes)).qkv_bias is False


@pytest.mark.parametrize("key, change, problem", [
    ("model.layers.1.self_attn.k_proj.weight", None, "the weight {key} is missing"),
    ("model.layers.1.self_attn.k_proj.weight", lambda t: t[:16], r"{key} has shape \(16, 64\), but config.json "
     r"\(hidden_size 64, num_attention_heads 8, num_key_value_heads 4, head_dim 8\) implies \(32, 64\)"),
    ("model.layers.0.self_attn.q_proj.bias", lambda t: t[:32], r"{key} has shape \(32,\)"),
    ("model.layers.0.mlp.up_proj.weight", lambda t: t[:, :32], r"{key} has shape \(96, 32\)"),
    ("model.embed_tokens.weight", lambda t: t[:100], r"{key} has shape \(100, 64\), but config.json \(vocab_size 101"),
    ("lm_head.weight", lambda t: torch.cat([t, t[:1]]), r"{key} has shape \(102, 64\), but config.json "
     r"\(vocab_size 101"),
], ids=["missing", "k_rows", "q_bias", "up_columns", "short_embedding", "long_lm_head"])
def test_a_missing_or_misshapen_hf_weight_is_named_with_the_checkpoint_folder(tmp_path, key, change, problem):
    """Not a KeyError / reshape error naming nothing, nor a short vocabulary zero-padded in silence."""
    from safetensors.torch import save_file

    from slime_lite.backends.megatron.convert import _SafetensorsDir

    cfg = hf_config("qwen2_untied_gqa_bias")  # vocab 101, 8 heads of 8, 4 KV heads
    state = hf_state(cfg)
    if change is None:
        del state[key]
    else:
        state[key] = change(state[key]).contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    where = re.escape(f"--hf-checkpoint {tmp_path}: ")
    with pytest.raises(SlimeLiteError, match=where + problem.format(key=re.escape(key))):
        hf_to_megatron_shard(_SafetensorsDir(str(tmp_path)), cfg, 0, 2, 0, 1)
