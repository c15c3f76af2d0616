"""Third-party noise is off by default and back with --log-level debug: Megatron's INFO lines (its per-bucket
parameter lists), Ray's token-auth warning, and the UserWarnings Megatron, Transformer Engine and Apex raise; their
errors and slime-lite's own lines always show."""

from __future__ import annotations

import logging
import warnings

import pytest

from slime_lite.logging_setup import LOG_LEVEL_ENV, quiet_import_warnings, set_level


@pytest.fixture
def restore_levels(monkeypatch):
    names = ["", "megatron", "transformer_engine", "ray._private.authentication"]
    levels = {n: logging.getLogger(n).level for n in names}
    monkeypatch.setenv(LOG_LEVEL_ENV, "INFO")  # set_level changes it; monkeypatch puts it back
    with warnings.catch_warnings():
        yield
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)


def _shown(caplog) -> tuple[list[str], list[str]]:
    caplog.clear()
    logging.getLogger("megatron.core.distributed.param_and_grad_buffer").info("Params for bucket 1 (10 elements)")
    logging.getLogger("megatron.core.distributed.param_and_grad_buffer").error("a Megatron error")
    logging.getLogger("ray._private.authentication.authentication_token_setup").warning("Token authentication is "
                                                                                        "disabled")
    logging.getLogger("slime_lite.train").info("rollout 0 done")
    with warnings.catch_warnings(record=True) as caught:
        for module in ("megatron.core.models.gpt.gpt_layer_specs", "transformer_engine.pytorch", "apex"):
            warnings.warn_explicit("Apex is not installed", UserWarning, "x.py", 1, module=module)
        warnings.warn_explicit("a user's warning", UserWarning, "y.py", 1, module="my_reward")
    return [r.getMessage() for r in caplog.records], [str(w.message) for w in caught]


def test_noise_is_hidden_below_debug_and_shown_at_debug(caplog, restore_levels):
    set_level("INFO")
    lines, caught = _shown(caplog)
    assert lines == ["a Megatron error", "rollout 0 done"]
    assert caught == ["a user's warning"]
    set_level("debug")
    lines, caught = _shown(caplog)
    assert lines == ["Params for bucket 1 (10 elements)", "a Megatron error", "Token authentication is disabled",
                     "rollout 0 done"]
    assert len(caught) == 4


def test_processes_started_by_the_run_follow_its_level(restore_levels, monkeypatch):
    """A Ray worker gets the run's level by environment and hides Megatron's import-time warnings before Megatron
    is imported (the trainer package does it first), or shows them at debug."""
    set_level("debug")
    import os

    assert os.environ[LOG_LEVEL_ENV] == "DEBUG"
    for level, shown in (("INFO", 0), ("DEBUG", 1)):
        monkeypatch.setenv(LOG_LEVEL_ENV, level)
        quiet_import_warnings()
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn_explicit("Apex is not installed", UserWarning, "x.py", 1, module="megatron.core.x")
        assert len(caught) == shown, level
