"""--lora-* flags: bad values, names that match no layer, and flags LoRA cannot work with are refused by
parse_args (before Ray starts), naming the flag and the valid choice."""

from __future__ import annotations

import json

import pytest

from slime_lite.args import parse_args
from slime_lite.backends.megatron.lora_config import resolve_targets
from slime_lite.errors import SlimeLiteError


@pytest.fixture()
def base(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "num_hidden_layers": 4}))
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "addition"]


@pytest.mark.parametrize("extra,said", [
    (["--lora-rank", "0"], "--lora-rank 0 must be a positive integer"),
    (["--lora-rank", "-4"], "--lora-rank -4 must be a positive integer"),
    (["--lora-rank", "8", "--lora-alpha", "0"], "--lora-alpha 0.0 must be a finite number > 0"),
    (["--lora-rank", "8", "--lora-dropout", "1.5"], "--lora-dropout 1.5 must be in [0, 1)"),
    (["--lora-alpha", "16"], "--lora-alpha needs --lora-rank R"),
    (["--lora-target-modules", "o_proj"], "--lora-target-modules needs --lora-rank R"),
    (["--lora-rank", "8", "--lora-target-modules", "q_proj,foo"],
     "'foo' matches no layer of this model; valid names: all-linear, q_proj, k_proj, v_proj, linear_qkv, o_proj"),
    (["--lora-rank", "8", "--lora-target-modules", "gate_up_proj"], "'gate_up_proj' matches no layer"),
    (["--lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"],
     "q_proj, v_proj is part of Megatron's fused linear_qkv (q_proj, k_proj, v_proj), which has one adapter"),
    (["--lora-rank", "8", "--ref-load", "{model}"], "--lora-rank cannot be used with --ref-load: the reference"),
    (["--lora-rank", "8", "--sequence-parallel"], "--lora-rank cannot be used with --sequence-parallel"),
    (["--lora-rank", "8", "--transformer-impl", "transformer_engine"], "--lora-rank needs --transformer-impl local"),
    (["--lora-rank", "8", "--rollout-backend", "sglang", "--rollout-external-engine-addrs", "127.0.0.1:1"],
     "--lora-rank with --rollout-external-engine-addrs"),
    (["--lora-rank", "8", "--lora-adapter-path", "{model}"], "no adapter_config.json"),
])
def test_bad_lora_flags_are_refused_before_anything_starts(base, extra, said):
    extra = [x.replace("{model}", base[1]) for x in extra]
    with pytest.raises(SlimeLiteError) as info:
        parse_args(base + extra)
    assert said in str(info.value)


def test_a_mixture_of_experts_model_is_refused(base):
    config = json.loads(open(base[1] + "/config.json").read())
    with open(base[1] + "/config.json", "w") as f:
        json.dump({**config, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 64, "intermediate_size": 128}, f)
    with pytest.raises(SlimeLiteError, match="qwen3_moe is a mixture-of-experts model"):
        parse_args(base + ["--lora-rank", "8"])


def test_adapter_folder_of_another_rank_or_alpha_is_refused(base, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    for extra, said in ((["--lora-rank", "8"], "has rank r=4; give --lora-rank 4"),
                        (["--lora-rank", "4"], "was trained with lora_alpha 8; give --lora-alpha 8")):
        with pytest.raises(SlimeLiteError, match=said):
            parse_args(base + extra + ["--lora-adapter-path", str(folder)])


@pytest.mark.parametrize("extra,said", [
    ({"alpha_pattern": {"o_proj": 32}}, "alpha_pattern={'o_proj': 32}"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern={'q_proj': 8}"),
    ({"bias": "lora_only"}, "bias='lora_only'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head']"),
])
def test_adapter_folder_that_peft_would_apply_more_of_is_refused(base, tmp_path, extra, said):
    """Per-module ranks/alphas, trained biases or whole modules: slime-lite would load another model than PEFT."""
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                            "rank_pattern": {}, "bias": "none", **extra}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(SlimeLiteError) as info:
        parse_args(base + ["--lora-rank", "4", "--lora-alpha", "8", "--lora-adapter-path", str(folder)])
    assert said in str(info.value) and "only plain LoRA adapters" in str(info.value)


def test_target_names_map_to_megatron_linears():
    assert resolve_targets(["all-linear"], False) == ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                      "mlp.linear_fc1", "mlp.linear_fc2")
    assert resolve_targets(["q_proj,k_proj,v_proj", "down_proj"], False) == ("self_attention.linear_qkv",
                                                                             "mlp.linear_fc2")
    assert resolve_targets(["linear_fc1"], True) == ("mlp.linear_fc1",)
    assert resolve_targets(["gate_up_proj", "o_proj"], True) == ("self_attention.linear_proj", "mlp.linear_fc1")
    with pytest.raises(SlimeLiteError, match="'gate_proj' matches no layer"):
        resolve_targets(["gate_proj"], True)  # GLM4 fuses them in HF too: gate_up_proj


@pytest.mark.parametrize("key", ["base_model.model.model.embed_tokens.lora_embedding_A",  # PEFT's embedding LoRA
                                 "base_model.model.model.embed_tokens.base_layer.weight",
                                 "base_model.model.lm_head.weight",  # modules_to_save
                                 "base_model.model.lm_head.lora_A.weight"])  # a linear LoRA here cannot adapt
def test_adapter_tensors_other_than_lora_pairs_of_adaptable_linears_are_refused(base, tmp_path, key):
    """PEFT would apply them: skipping them would run another model than the adapter's."""
    import torch
    from safetensors.torch import save_file

    from slime_lite.backends.megatron import peft_format
    from slime_lite.backends.megatron.lora_config import GLM4_FC1, LINEARS

    assert set(peft_format.MODULES) == {m for _, modules in LINEARS.values() for m in modules} | set(GLM4_FC1)
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    o_proj = [f"model.layers.{i}.self_attn.o_proj" for i in range(4)]
    good = {f"base_model.model.{m}.lora_{p}.weight": torch.zeros(4, 8) if p == "A" else torch.zeros(8, 4)
            for m in o_proj for p in "AB"}
    save_file(good, str(folder / "adapter_model.safetensors"))
    argv = base + ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "o_proj",
                   "--lora-adapter-path", str(folder)]
    parse_args(argv)
    assert list(peft_format.read(str(folder))) == [m + ".weight" for m in o_proj]
    save_file({**good, key: torch.zeros(4, 8)}, str(folder / "adapter_model.safetensors"))
    said = f"--lora-adapter-path {folder}: adapter_model.safetensors holds {key}, which PEFT would apply but " \
           "this run cannot: LoRA here adapts only the linears q_proj, k_proj, v_proj, o_proj, gate_proj"
    for load in (lambda: parse_args(argv), lambda: peft_format.read(str(folder))):
        with pytest.raises(SlimeLiteError) as info:
            load()
        assert said in str(info.value)


def _peft_adapter(model_dir, folder, targets, **config):
    """An adapter saved by the peft library itself (its own init: each module its own lora_A)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    peft.get_peft_model(model, peft.LoraConfig(target_modules=targets, **config)).save_pretrained(str(folder))
    return str(folder)


def _on_tiny(base, model_dir, *extra):
    return [base[0], str(model_dir), *base[2:], "--lora-rank", "8", "--lora-alpha", "8", *extra]


@pytest.mark.parametrize("targets, flags, said", [
    (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj"], "adapts q_proj, v_proj without k_proj, but Megatron "
     "fuses q_proj, k_proj, v_proj into one linear_qkv with one adapter. It cannot be loaded under any"),
    (["q_proj", "k_proj", "v_proj"], ["q_proj", "k_proj", "v_proj"], "k_proj.weight, model.layers.0.self_attn."
     "v_proj.weight have different lora_A (PEFT initializes each on its own), but Megatron's fused linear_qkv"),
    (["o_proj", "down_proj"], ["all-linear"], "adapts o_proj, down_proj, and this run's --lora-target-modules "
     "all-linear adapt q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: give --lora-target-modules "
     "o_proj down_proj."),
])
def test_adapter_tensors_the_worker_would_refuse_are_refused_before_ray(base, tiny_model_dir, tmp_path, targets,
                                                                         flags, said):
    """The tensors, not only the config: fused parts without their siblings or with their own lora_A cannot be
    loaded under any flags (and the message says so); other modules than the run's get followable advice."""
    folder = _peft_adapter(tiny_model_dir, tmp_path / "adapter", targets)
    argv = _on_tiny(base, tiny_model_dir, "--lora-adapter-path", folder)
    with pytest.raises(SlimeLiteError) as info:
        parse_args(argv + ["--lora-target-modules", *flags])
    assert f"--lora-adapter-path {folder}" in str(info.value) and said in str(info.value)
    if flags == ["all-linear"]:  # the advice works
        parse_args(argv + ["--lora-target-modules", "o_proj", "down_proj"])


@pytest.mark.parametrize("key, value", [("alora_invocation_tokens", [7, 8]), ("use_bdlora", {"nblocks": 2}),
                                        ("kasa_config", {"k": 1}), ("arrow_config", {"top_k": 3}),
                                        ("monteclora_config", {"n": 2}), ("use_qalora", True),
                                        ("init_lora_weights", "pissa"), ("a_future_variant", 1)])
def test_lora_variants_are_refused_and_peft_defaults_accepted(base, tiny_model_dir, tmp_path, key, value):
    """PEFT computes another model than plain LoRA for them: every adapter_config.json key that is not known to be
    neutral is refused when set; what a default LoraConfig saves (every key of peft's) is accepted."""
    folder = _peft_adapter(tiny_model_dir, tmp_path / "adapter", ["o_proj", "down_proj"], task_type="CAUSAL_LM")
    argv = _on_tiny(base, tiny_model_dir, "--lora-target-modules", "o_proj", "down_proj", "--lora-adapter-path", folder)
    parse_args(argv)
    config = json.loads(open(folder + "/adapter_config.json").read())
    with open(folder + "/adapter_config.json", "w") as f:
        json.dump({**config, key: value}, f)
    with pytest.raises(SlimeLiteError) as info:
        parse_args(argv)
    assert f"sets {key}={value!r} in adapter_config.json; only plain LoRA adapters" in str(info.value)


def test_an_adapter_saved_as_alora_is_refused(base, tiny_model_dir, tmp_path):
    folder = _peft_adapter(tiny_model_dir, tmp_path / "adapter", ["o_proj", "down_proj"], task_type="CAUSAL_LM",
                           alora_invocation_tokens=[7, 8])
    with pytest.raises(SlimeLiteError, match=r"sets alora_invocation_tokens=\[7, 8\]"):
        parse_args(_on_tiny(base, tiny_model_dir, "--lora-target-modules", "o_proj", "down_proj",
                            "--lora-adapter-path", folder))


@pytest.mark.parametrize("damage", ["truncated", "empty", "text"])
def test_an_unreadable_adapter_file_is_refused_naming_it(base, tmp_path, damage):
    import torch
    from safetensors.torch import save_file

    from slime_lite.backends.megatron import peft_format

    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    file = folder / "adapter_model.safetensors"
    save_file({f"base_model.model.model.layers.{i}.self_attn.o_proj.lora_{p}.weight": torch.zeros(4, 4)
               for i in range(4) for p in "AB"}, str(file))
    raw = file.read_bytes()
    file.write_bytes({"truncated": raw[: len(raw) // 2], "empty": b"", "text": b"not a safetensors file\n"}[damage])
    said = f"--lora-adapter-path {folder}: adapter_model.safetensors cannot be read"
    for load in (lambda: parse_args(base + ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules",
                                            "o_proj", "--lora-adapter-path", str(folder)]),
                 lambda: peft_format.read(str(folder))):
        with pytest.raises(SlimeLiteError) as info:
            load()
        assert said in str(info.value)
