"""Every command's --help is for users: every flag has a help text (serve's included), and no text cites internal
documents or code names (SPEC/DESIGN sections, issue numbers, reST literals, module.function names)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import slime_lite
from slime_lite import cli
from slime_lite.engine.serve_cli import build_parser as serve_parser

MODULES = sorted({p.stem for p in Path(slime_lite.__file__).parent.rglob("*.py")} - {"__init__"})
# a code name: module.function of slime_lite (not a file name like config.json, nor a full import path a flag takes)
INTERNAL = re.compile(r"\bSPEC\b|\bDESIGN\b|\bissue \d|``|(?<![\w.'])(?:" + "|".join(MODULES)
                      + r")\.(?!(?:json|jsonl|py|pt)\b)[a-z_]+")


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_help_has_no_internal_references(command, capsys):
    try:
        code = cli.main([command, "--help"])
    except SystemExit as exc:  # argparse's --help
        code = exc.code
    assert code in (0, None)
    text = capsys.readouterr().out
    assert "usage:" in text and not INTERNAL.findall(text), INTERNAL.findall(text)


def test_every_serve_flag_has_help():
    missing = [a.option_strings[0] for a in serve_parser()._actions if a.option_strings and not a.help]
    assert not missing, f"serve flags without help: {missing}"
