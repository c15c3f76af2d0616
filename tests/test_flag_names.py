"""Every --flag named in the package's strings (help, errors, docstrings) exists: slime-lite's, a subcommand's, or
another program's the module names on purpose."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
from pathlib import Path

import pytest

from slime_lite.args import build_parser

PKG = Path(__file__).resolve().parents[1] / "slime_lite"

FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?![\w-])")
# flags of other programs the package names, by module: SGLang's server/router (set by the launcher), pip's
EXTERNAL = {
    "slime_lite.backends.sglang.launcher": {"--model-path", "--model", "--host", "--port", "--tp-size", "--tp",
                                            "--random-seed", "--enable-memory-saver", "--worker-urls", "--api-key",
                                            "--enable-return-routed-experts",
                                            # SGLang's LoRA flags (tests/backends/test_sglang_lora.py parses them
                                            # with SGLang's own parser)
                                            "--enable-lora", "--max-lora-rank", "--lora-paths",
                                            "--enable-weights-cpu-backup"},
    "slime_lite.backends.megatron.lora_config": {"--enable-lora"},  # SGLang's, named in an error
    "slime_lite.backends.megatron.routing": {"--enable-return-routed-experts"},  # SGLang's, named in an error
    "slime_lite.backends.megatron.model": {"--no-build-isolation"},
    "slime_lite.rollout.calc_task": {"--task"},  # make-tiny-model's, which warm-starts on the task's transcripts
}
PLACEHOLDERS = {"--name", "--f"}  # "--<name>"-style placeholders in docstrings
TOP_LEVEL = {"--version", "--help"}  # slime-lite's own (cli.py)


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def subcommand_flags(monkeypatch) -> dict[str, set[str]]:
    """Each ``slime-lite <command>``'s flags by module, taken from the parser its main() builds."""
    from slime_lite.cli import COMMANDS

    def grab(self, *args, **kwargs):
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", grab)
    flags = {}
    for module, _ in COMMANDS.values():
        with pytest.raises(_Captured) as info:
            importlib.import_module(module).main([])
        flags[module] = set(info.value.parser._option_string_actions)
    return flags


def test_every_flag_named_in_the_package_exists(monkeypatch):
    train = set(build_parser()._option_string_actions)
    subs = subcommand_flags(monkeypatch)
    serve = subs["slime_lite.engine.serve_cli"]
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        module = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        known = train | subs.get(module, set()) | EXTERNAL.get(module, set()) | PLACEHOLDERS | TOP_LEVEL
        if module.startswith("slime_lite.engine.") or module == "slime_lite.rollout.engines":
            known |= serve  # the embedded engine's messages name its `slime-lite serve` flags (engines.py maps them)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for m in FLAG.finditer(node.value):
                    flag = m.group(0)
                    if flag not in known and not flag.startswith("--sglang-"):  # --sglang-*: passed to SGLang
                        bad.append(f"{path.relative_to(PKG)}:{node.lineno}: {flag}")
    assert not bad, "strings name flags that do not exist:\n" + "\n".join(bad)


def test_the_engines_serve_flags_map_to_train_flags(monkeypatch):
    """An embedded engine started by `train` says its errors in train's flags: each serve flag its messages name that
    train spells otherwise is mapped to a train flag that exists."""
    from slime_lite.rollout.engines import _SERVE_TO_TRAIN

    serve = subcommand_flags(monkeypatch)["slime_lite.engine.serve_cli"]
    train = set(build_parser()._option_string_actions)
    assert set(_SERVE_TO_TRAIN) <= serve and set(_SERVE_TO_TRAIN.values()) <= train
    # what the engine's start-up errors name (scheduler.py): each is a train flag, or mapped to one
    for flag in ("--device", "--dtype", "--kv-cache-tokens", "--max-running-requests", "--enable-torch-compile"):
        assert flag in train or flag in _SERVE_TO_TRAIN, flag
