"""The trainer's TP layout against config.json, before Ray starts: every size TP splits (heads, KV heads, the MLP's
columns) must divide by it; otherwise Megatron's model builder refuses it only inside the Ray workers. The sizes
themselves must be positive (read_config), or they fail later as a ZeroDivisionError."""

from __future__ import annotations

import json

import pytest

from slime_lite.args import parse_args
from slime_lite.errors import SlimeLiteError


def test_a_tp_size_not_dividing_the_mlp_is_refused_before_ray_starts(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    cfg = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 151}
    (model / "config.json").write_text(json.dumps(cfg))
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "addition",
            "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"]
    with pytest.raises(SlimeLiteError, match=r"--tensor-model-parallel-size 2 must divide the model's "
                                             r"intermediate_size \(151\)"):
        parse_args(argv)
    (model / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 152}))
    assert parse_args(argv).tensor_model_parallel_size == 2


def test_config_sizes_must_be_positive_except_an_moe_configs_intermediate_size(tmp_path):
    from slime_lite.model_families import read_config

    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 64, "head_dim": 16}
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size",
                "max_position_embeddings", "head_dim"):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, key: 0}))
        with pytest.raises(SlimeLiteError, match=rf"config.json: {key} is 0; it must be a positive integer"):
            read_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 0}))  # MoE: no dense MLP
    assert read_config(str(tmp_path))["intermediate_size"] == 0
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": -1}))
    with pytest.raises(SlimeLiteError, match=r"intermediate_size is -1; it must be a non-negative integer"):
        read_config(str(tmp_path))
