"""User hooks given as dotted paths (``module.function``), as slime's ``--*-path`` flags name them: loading them, and
the read-only ``args`` they are called with."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Callable

from slime_lite.errors import SlimeLiteError


def load_function(path: str, flag: str) -> Callable[..., Any]:
    """Import ``module.function`` (module importable from the working directory or PYTHONPATH).

    ``flag`` is the command-line flag that named the hook, used in the error message.
    """
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise SlimeLiteError(f"{flag} {path!r}: expected a dotted path 'module.function', e.g. 'my_rm.reward'.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SlimeLiteError(
            f"{flag} {path!r}: cannot import module {module_name!r} ({exc}). "
            "Put it in the working directory or on PYTHONPATH."
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise SlimeLiteError(f"{flag} {path!r}: module {module_name!r} has no function {attr!r}.")
    return fn


DEFAULT_ROLLOUT_FUNCTION = "slime_lite.rollout.functions.generate_rollout"  # --rollout-function-path's default

# what each hook flag calls its function with (slime's signatures): (shown, positional arguments, keywords)
SIGNATURES = {
    "--rollout-function-path": ("generate_rollout(args, rollout_id, data_source, evaluation=False)", 3,
                                ("evaluation",)),
    "--eval-function-path": ("generate_rollout(args, rollout_id, data_source, evaluation=False)", 3,
                             ("evaluation",)),
    "--custom-generate-function-path": ("async generate(args, sample, sampling_params) -> Sample or [Sample, ...]",
                                        3, ()),
    "--custom-rm-path": ("reward(args, sample) -> float or dict", 2, ()),
    "--dynamic-sampling-filter-path": ("keep(args, samples) -> bool", 2, ()),
    "--rollout-sample-filter-path": ("filter(args, samples) -> None", 2, ()),
    "--rollout-all-samples-process-path": ("process(args, all_samples, data_source) -> None", 3, ()),
    "--custom-reward-post-process-path": ("post_process(args, samples) -> (raw_rewards, rewards)", 2, ()),
    "--custom-rollout-log-function-path": ("log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, "
                                           "rollout_time) -> bool", 5, ()),
    "--custom-eval-rollout-log-function-path": ("log_eval_rollout_data(rollout_id, args, data, extra_metrics) -> "
                                                "bool", 4, ()),
    # the trainer's (backends/megatron/train_hooks.py)
    "--custom-advantage-function-path": ("advantage(args, rollout_data) -> None", 2, ()),
    "--custom-loss-function-path": ("loss(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)", 4, ()),
    "--custom-pg-loss-reducer-function-path": ("get_pg_loss_reducer(total_lengths, response_lengths, loss_masks, "
                                               "calculate_per_token_loss) -> reducer", 4, ()),
}
# the hooks the trainer calls: in a replay too (--debug-train-only), never with --debug-rollout-only
TRAIN_HOOKS = ("--custom-advantage-function-path", "--custom-loss-function-path",
               "--custom-pg-loss-reducer-function-path")
# the hooks a replay (--load-debug-rollout-data) calls too: the rollout manager's, on the loaded samples
REPLAY_HOOKS = ("--custom-reward-post-process-path", "--custom-rollout-log-function-path")


def load_hook(path: str, flag: str) -> Callable[..., Any]:
    """``load_function``, then the function's signature against what ``flag`` calls it with: a SlimeLiteError
    naming the flag, the module and the signature expected."""
    fn = load_function(path, flag)
    shown, positional, keywords = SIGNATURES[flag]
    try:
        sig = inspect.signature(fn)
        sig.bind(*([None] * positional), **{k: None for k in keywords})
    except (TypeError, ValueError) as exc:
        raise SlimeLiteError(
            f"{flag} {path!r}: {fn.__module__}.{getattr(fn, '__name__', path)}{_shown(fn)} cannot be called as "
            f"{shown} ({exc}). Give it that signature.") from None
    return fn


def _shown(fn: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


async def call_maybe_async(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a hook that may be a plain function or a coroutine function."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


class HookArgs:
    """The ``args`` a user hook is called with (slime's hooks take the run's args): every flag, read-only, plus what
    slime's hooks read that is not a flag: ``sglang_router_ip`` / ``sglang_router_port`` (where /generate goes: the
    router, else the first engine; they follow a restarted engine) and ``engine_client``, slime_lite's async client
    over every engine (``await args.engine_client.generate(body)``: retries, fails over, follows restarts)."""

    def __init__(self, flags: Any, engine_client: Any = None) -> None:
        object.__setattr__(self, "_flags", flags)
        object.__setattr__(self, "engine_client", engine_client)

    def _address(self) -> tuple[str, int | None]:
        if self.engine_client is None:
            return "", None
        host, _, port = self.engine_client.urls[0].rsplit("/", 1)[-1].partition(":")
        return host, int(port) if port else None

    @property
    def sglang_router_ip(self) -> str:
        return self._address()[0]

    @property
    def sglang_router_port(self) -> int | None:
        return self._address()[1]

    def __getattr__(self, name: str) -> Any:
        if name == "_flags":  # not yet set (a copy being built)
            raise AttributeError(name)
        return getattr(self._flags, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a hook's args are read-only (tried to set {name!r}); keep a hook's own state in the "
                             "sample's metadata or in the hook's module")
