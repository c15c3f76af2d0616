"""Shared fixtures: a tiny random-init model checkpoint, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

import slime_lite  # noqa: F401  (first: it sets MKL's reproducibility mode before any matrix product)
from tests.slices import slice_of


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Hugging Face Qwen2 checkpoint folder (char-level tokenizer, random init, ~1M params)."""
    from slime_lite.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp("tiny_model")
    make_tiny_model(out, warm_start_steps=0)
    return out


# ---- slices of a test run (scripts/test-gpu.sh --slice K/N): deterministic, balanced by recorded durations
DURATIONS = Path(__file__).with_name("gpu_durations.json")  # {node id: seconds}, from a --record-durations run


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slice", default=None, metavar="K/N",
                     help="run the K-th of N parts of the selected tests: the same split every time, balanced by "
                          f"the durations in {DURATIONS.name} (longest first, each to the lightest part)")
    parser.addoption("--record-durations", default=None, metavar="PATH",
                     help="write each test's seconds (setup + call + teardown) to PATH as JSON (for --slice)")


# the CPU suite's files by their seconds (summed from a --record-durations run of scripts/test.sh): the heaviest go
# first, so the two xdist workers (each taking whole files) end together instead of one waiting on a late long file
FILE_SECONDS = Path(__file__).with_name("cpu_file_seconds.json")  # {test file: seconds}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    spec = config.getoption("--slice")
    if not spec:
        if FILE_SECONDS.exists():
            import json

            seconds = json.loads(FILE_SECONDS.read_text())
            items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))  # stable: files stay whole
        return
    try:
        k, n = (int(x) for x in spec.split("/"))
        assert 1 <= k <= n
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"--slice {spec}: expected K/N with 1 <= K <= N, e.g. --slice 2/3") from None
    import json

    durations = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    parts = slice_of([item.nodeid for item in items], durations, n)
    keep = [item for item in items if parts[item.nodeid] == k - 1]
    config.hook.pytest_deselected(items=[item for item in items if parts[item.nodeid] != k - 1])
    items[:] = keep


_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--record-durations")
    if path and not hasattr(session.config, "workerinput"):  # under xdist the controller has every test's report
        import json

        Path(path).write_text(json.dumps({k: round(v, 2) for k, v in sorted(_SECONDS.items())}, indent=1) + "\n")
