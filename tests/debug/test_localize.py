"""localize.py: the first layer where two forwards of the same tokens part (HF vs HF, HF vs Megatron)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from slime_lite.debug.localize import fit_temperature, localize, localize_sample, response_log_probs
from slime_lite.types import Sample

torch.set_num_threads(1)
TOKENS = [20, 21, 22, 30, 40, 11, 12, 50, 60, 13]


def perturbed_copy(src: Path, dst: Path, layer: int, what: str = "mlp.down_proj.weight", scale: float = 0.5) -> Path:
    """A copy of the checkpoint with noise added to one layer's weight."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    name = f"model.layers.{layer}.{what}"
    g = torch.Generator().manual_seed(0)
    state[name] = state[name] + scale * torch.randn(state[name].shape, generator=g)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def layer2_broken(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("perturbed") / "m", layer=2)


def test_hf_and_megatron_agree_on_the_same_checkpoint(tiny_model_dir):
    loc = localize(str(tiny_model_dir), "megatron", TOKENS)
    assert loc.first_divergent is None, loc.summary()
    names = [d.name for d in loc.layers]
    assert names[0] == "embedding" and names[-2:] == ["final_norm", "logits"] and "layer 0" in names
    assert max(d.rel_diff for d in loc.layers) < 1e-5
    assert "agree at every layer" in loc.summary()


def test_a_perturbed_layer_is_named_between_two_hf_copies(tiny_model_dir, layer2_broken):
    loc = localize(str(tiny_model_dir), str(layer2_broken), TOKENS)
    assert loc.first_divergent == "layer 2", loc.summary()
    before = {d.name: d.rel_diff for d in loc.layers}
    assert before["embedding"] == 0.0 and before["layer 1"] == 0.0
    assert "first part at layer 2" in loc.summary()


def test_a_perturbed_layer_is_named_between_hf_and_megatron(tiny_model_dir, layer2_broken):
    loc = localize(str(tiny_model_dir), f"megatron:{layer2_broken}", TOKENS)
    assert loc.first_divergent == "layer 2", loc.summary()
    assert "Megatron" in loc.side_b


def test_a_lower_precision_side_parts_at_the_embedding_and_says_dtype(tiny_model_dir):
    loc = localize(str(tiny_model_dir), "megatron", TOKENS, dtype_a="bfloat16")
    assert loc.first_divergent == "embedding"
    assert "dtype cast" in loc.summary() and "bfloat16" in loc.summary()


def test_fit_temperature_recovers_the_sampling_temperature():
    logits = torch.randn(len(TOKENS), 80, generator=torch.Generator().manual_seed(1))
    rollout = response_log_probs(logits, TOKENS, 4, temperature=1.5).tolist()
    t, err = fit_temperature(logits, TOKENS, 4, rollout)
    assert t == pytest.approx(1.5) and err < 1e-9


def test_localize_sample_names_a_temperature_mismatch(tiny_model_dir):
    from slime_lite.debug.localize import hf_states

    logits = hf_states(str(tiny_model_dir), TOKENS)["logits"]
    rollout = response_log_probs(logits, TOKENS, 6, temperature=1.5).tolist()
    sample = Sample(tokens=TOKENS, response_length=4, rollout_log_probs=rollout)
    loc = localize_sample(sample, str(tiny_model_dir), temperature=1.0)
    assert loc.first_divergent is None
    assert loc.extra["fitted_temperature"] == pytest.approx(1.5)
    assert "temperature 1.5" in loc.summary() and "temperature mismatch" in loc.summary()


def test_first_mismatch_picks_the_first_sample_past_the_threshold():
    from slime_lite.debug.localize import first_mismatch

    samples = [Sample(response_length=2, rollout_log_probs=r) for r in ([-1.0, -2.0], [-1.0, -2.5], [-3.0, -2.0])]
    train = [[-1.0, -2.0 + 1e-6], [-1.0, -2.0], [-1.0, -2.0]]
    assert first_mismatch(samples, train, 1e-3) == 1
    assert first_mismatch(samples[:1], train[:1], 1e-3) is None


def test_both_sides_in_bf16_are_held_to_the_bf16_tolerance_and_a_broken_layer_still_shows(tiny_model_dir,
                                                                                        layer2_broken):
    """Two healthy bf16 forwards part by bf16 rounding at every layer; the bf16 tolerance (calibrated on an H200)
    passes them and still names a layer that is really broken. A side in float32 keeps the tight float32 bound."""
    from slime_lite.debug.localize import LAYER_TOL, layer_tol

    healthy = localize(str(tiny_model_dir), "megatron", TOKENS, dtype_a="bfloat16", dtype_b="bfloat16")
    assert healthy.tol == LAYER_TOL["bfloat16"] and healthy.first_divergent is None, healthy.summary()
    assert max(d.rel_diff for d in healthy.layers) > LAYER_TOL["float32"]  # bf16 rounding is really there
    broken = localize(str(tiny_model_dir), f"megatron:{layer2_broken}", TOKENS, dtype_a="bfloat16",
                      dtype_b="bfloat16")
    assert broken.first_divergent == "layer 2", broken.summary()
    assert layer_tol("bfloat16", "float32") == LAYER_TOL["float32"]


def test_a_bf16_temperature_mismatch_is_still_named_with_the_bf16_logprob_bound(tiny_model_dir):
    """The engine side in bf16 (its rollout log-probs at 2.5x the temperature: this small model's logits are flat,
    so a smaller change stays under the bf16 bound), the trainer in bf16: the fit and the note use the run's
    log-prob bound, not the float32 one."""
    from slime_lite.debug.localize import hf_states

    logits = hf_states(str(tiny_model_dir), TOKENS, "bfloat16")["logits"]
    sample = Sample(tokens=TOKENS, response_length=4,
                    rollout_log_probs=response_log_probs(logits, TOKENS, 6, temperature=2.5).tolist())
    loc = localize_sample(sample, str(tiny_model_dir), engine_dtype="bfloat16", trainer_dtype="bfloat16",
                          temperature=1.0, logprob_tol=5e-2)
    assert loc.extra["rollout_vs_hf_logprob_mean_diff"] > 5e-2
    assert loc.first_divergent is None and loc.extra["fitted_temperature"] == pytest.approx(2.5)
    assert "temperature mismatch" in loc.summary()
