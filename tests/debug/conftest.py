"""Small hand-built rollout dumps for the debug tools' tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slime_lite.rollout.dumps import dump_path, save_rollout_dump
from slime_lite.types import Sample, Status


def make_samples(n_groups: int = 2, group_size: int = 2) -> list[Sample]:
    """Prompt 'add a b' with response 'a+b' as text; reward 1.0 for every sample, one truncated sample."""
    samples = []
    for g in range(n_groups):
        for j in range(group_size):
            i = g * group_size + j
            response = f"answer-{i}"
            samples.append(Sample(
                group_index=g, index=i, prompt=f"question-{g}", tokens=[10 + g, 11, 12] + [20 + i, 21, 22],
                response=response, response_length=3, label=response, reward=1.0, loss_mask=[1, 1, 1],
                weight_versions=["1"], rollout_log_probs=[-0.1, -0.2, -0.3 - i],
                status=Status.TRUNCATED if i == 1 else Status.COMPLETED,
                metadata={"sampling_params": {"temperature": 1.0, "sampling_seed": 100 + i}, "prompt_index": g},
            ))
    return samples


@pytest.fixture
def dump_template(tmp_path: Path) -> str:
    """Train dumps for ids 0 and 1, an eval dump for id 0; returns the template."""
    template = str(tmp_path / "rollout_{rollout_id}.pt")
    meta = {"n_samples_per_prompt": 2, "rollout_batch_size": 2, "model_path": "/models/tiny"}
    save_rollout_dump(dump_path(template, 0), 0, make_samples(), meta=meta)
    save_rollout_dump(dump_path(template, 1), 1, make_samples(1, 2), meta=meta)
    save_rollout_dump(dump_path(template, 0, evaluation=True), 0, make_samples(1, 1), meta=meta)
    return template


@pytest.fixture
def slime_dump(tmp_path: Path) -> str:
    """A dump as slime writes it: no meta or format_version, a sample with an unknown key and missing fields."""
    path = tmp_path / "slime_{rollout_id}.pt"
    item = {"index": 0, "prompt": "slime-prompt", "tokens": [1, 2, 3, 4], "response": "slime-response",
            "response_length": 2, "reward": 0.5, "status": "completed", "label": "42",
            "brand_new_field": [1, 2]}
    torch.save({"rollout_id": 5, "samples": [item]}, str(path).format(rollout_id=5))
    return str(path)


@pytest.fixture
def samples_factory():
    return make_samples
