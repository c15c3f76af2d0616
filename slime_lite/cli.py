"""``slime-lite <subcommand>``: dispatches to each module's ``main(argv)``; user errors print without a traceback."""

from __future__ import annotations

import importlib
import sys

from slime_lite import __version__
from slime_lite.errors import run_main
from slime_lite.logging_setup import setup_logging

COMMANDS = {
    "train": ("slime_lite.train", "run the RL driver (GRPO/PPO/REINFORCE++; debug modes)"),
    "doctor": ("slime_lite.debug.doctor", "run the precision-alignment checklist on a short job"),
    "serve": ("slime_lite.engine.serve_cli", "start one embedded SGLang-compatible engine"),
    "display-rollouts": ("slime_lite.debug.display", "show dumped rollouts and their metrics"),
    "replay-reward": ("slime_lite.debug.replay_reward", "recompute rewards of a dump and report differences"),
    "send-to-engine": ("slime_lite.debug.send_to_engine", "resend dumped prompts to an engine and compare"),
    "diff-rollouts": ("slime_lite.debug.diff", "compare two dumps sample by sample"),
    "explain": ("slime_lite.debug.explain", "one sample token by token: rollout vs train log-probs (terminal, HTML page)"),
    "compare-runs": ("slime_lite.debug.compare_runs", "which metrics of two runs differ, and from which step"),
    "ima-bisect": ("slime_lite.debug.ima_bisect", "triage an SGLang illegal memory access over CUDA graph/spec/DeepEP"),
    "make-tiny-model": ("slime_lite.tiny_model", "build the tiny warm-started HF model"),
    "make-data": ("slime_lite.tasks", "write task prompt/label JSONL (train and eval)"),
    "plot-metrics": ("slime_lite.plot", "plot reward and eval curves of a --metrics-path file to PNG"),
}


def _usage() -> str:
    lines = ["usage: slime-lite <command> [flags]   (slime-lite <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name:<18} {desc}" for name, (_, desc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}.\n\n{_usage()}", file=sys.stderr)
        return 2
    setup_logging()
    module = importlib.import_module(COMMANDS[name][0])
    return run_main(module.main, rest)


if __name__ == "__main__":
    raise SystemExit(main())
