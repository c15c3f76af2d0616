"""Config variants real checkpoints have, refused or accepted before Ray starts exactly where the trainer or the
embedded engine would refuse them later: sliding windows as transformers resolves them (``use_sliding_window``
alone slides no layer), and RoPE types (the trainer builds default and llama3; the engine all but the
length-dependent ones)."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
from transformers import AutoConfig

from slime_lite.args import parse_args
from slime_lite.errors import SlimeLiteError
from slime_lite.model_families import sliding_window_layers
from slime_lite.preflight import check_model_family


def _variants():
    for model_type, use, window, below in itertools.product(("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"),
                                                            (False, True), (4, None), (0, 1, 2)):
        yield model_type, {"use_sliding_window": use, "sliding_window": window, "max_window_layers": below}


@pytest.mark.parametrize("model_type, fields", list(_variants()))
def test_sliding_window_layers_reads_a_config_as_transformers_resolves_it(model_type, fields) -> None:
    """Against transformers' own config classes (2 layers): a layer slides when its resolved layer type is
    sliding_attention with a window set (Qwen3-MoE, which has no layer types: every layer when the window is
    set). Read from the config object, from config.json's dict as transformers writes it, and without layer_types
    (as older transformers wrote it)."""
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=2, **fields)
    types = getattr(cfg, "layer_types", None)
    slides = bool(cfg.sliding_window) and (types is None or "sliding_attention" in types)
    saved = cfg.to_dict()
    older = {k: v for k, v in saved.items() if k != "layer_types"} | fields
    assert sliding_window_layers(cfg) == sliding_window_layers(saved) == sliding_window_layers(older) == slides


def _model(tiny_model_dir, tmp_path, **fields) -> str:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model, dirs_exist_ok=True)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, **fields}))
    return str(model)


def _check(model: str, tmp_path, *extra: str) -> None:
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    check_model_family(parse_args(["--hf-checkpoint", model, "--prompt-data", str(tmp_path / "p.jsonl"),
                                   "--rm-type", "addition", *extra]))


def test_rope_types_are_refused_before_ray_by_the_side_that_cannot_build_them(tiny_model_dir, tmp_path) -> None:
    """YaRN (Qwen3's and Qwen2.5's long-context setting): the embedded engine serves it, the Megatron trainer does
    not, so a training run is refused before Ray (it used to start Ray and the engines and fail in the train
    worker) and a rollout-only run passes; a length-dependent RoPE is refused for the engine too."""
    theta = json.loads((tiny_model_dir / "config.json").read_text()).get("rope_parameters", {}).get("rope_theta", 1e4)
    yarn = _model(tiny_model_dir, tmp_path, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": theta,
                                                             "original_max_position_embeddings": 64})
    with pytest.raises(SlimeLiteError, match=r"--hf-checkpoint .*config\.json uses rope_type 'yarn'; the Megatron"):
        _check(yarn, tmp_path)
    _check(yarn, tmp_path, "--debug-rollout-only")
    dynamic = _model(tiny_model_dir, tmp_path, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                "rope_theta": theta})
    with pytest.raises(SlimeLiteError, match=r"rope type 'dynamic' \(length-dependent\) .*--rollout-backend sglang"):
        _check(dynamic, tmp_path, "--debug-rollout-only")


def test_a_sliding_window_no_layer_uses_is_served_and_trained(tiny_model_dir, tmp_path) -> None:
    """Qwen2 with use_sliding_window and max_window_layers at the layer count slides no layer (transformers
    attends over everything): accepted by both sides; from layer 0 on, it is refused, naming the reason."""
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    fields = {"use_sliding_window": True, "sliding_window": 4, "layer_types": None}
    _check(_model(tiny_model_dir, tmp_path, **fields, max_window_layers=layers), tmp_path)
    with pytest.raises(SlimeLiteError, match=r"sliding-window attention .*not supported"):
        _check(_model(tiny_model_dir, tmp_path, **fields, max_window_layers=0), tmp_path)
    with pytest.raises(SlimeLiteError, match=r"sliding-window attention is not supported by the embedded engine"):
        _check(_model(tiny_model_dir, tmp_path, **fields, max_window_layers=0), tmp_path, "--debug-rollout-only")


def test_swish_is_silu_and_other_activations_are_refused() -> None:
    """transformers maps hidden_act "swish" to SiLU, the trainer's activation."""
    from slime_lite.model_families import check_trainable

    check_trainable({"model_type": "qwen2", "hidden_act": "swish"}, "config.json")
    with pytest.raises(SlimeLiteError, match=r"config\.json has hidden_act 'gelu'; only 'silu'"):
        check_trainable({"model_type": "qwen2", "hidden_act": "gelu"}, "config.json")
