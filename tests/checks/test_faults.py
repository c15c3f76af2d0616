"""debug/faults.py: each injected fault changes only what its real bug would change."""

from __future__ import annotations

from slime_lite.checks import faults


def test_the_temperature_fault_changes_rollouts_only():
    assert faults.sampling_temperature("engine-temperature", 0.8, evaluation=False) == 0.8 * 1.5
    assert faults.sampling_temperature("engine-temperature", 0.8, evaluation=True) == 0.8
    assert faults.sampling_temperature(None, 0.8, evaluation=False) == 0.8


def test_the_pp_fault_renames_a_later_stages_layers_by_their_local_ids():
    stage1 = {"model.layers.2.mlp.up_proj.weight": 1, "model.layers.3.mlp.up_proj.weight": 2, "model.norm.weight": 3}
    sent = faults.sent_stage_weights("swap-pp-layers", stage1, pp_rank=1)
    assert sent == {"model.layers.0.mlp.up_proj.weight": 1, "model.layers.1.mlp.up_proj.weight": 2,
                    "model.norm.weight": 3}
    assert faults.sent_stage_weights("swap-pp-layers", stage1, pp_rank=0) is stage1
    assert faults.sent_stage_weights(None, stage1, pp_rank=1) is stage1
    assert faults.breaks_sent_weights("swap-pp-layers") and not faults.breaks_sent_weights("skip-weight-push")


def test_only_the_push_fault_skips_the_push_and_every_fault_is_a_flag_choice():
    from slime_lite.args import build_parser

    assert faults.skips_weight_push("skip-weight-push") and not faults.skips_weight_push(None)
    action = next(a for a in build_parser()._actions if "--debug-inject-fault" in a.option_strings)
    assert tuple(action.choices) == tuple(faults.FAULTS)
