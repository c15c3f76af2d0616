"""Real SGLang engines: one ``python -m sglang.launch_server`` process per engine, and optionally SGLang's router.

``SGLangServer(args, rank).start()`` runs inside the engine's Ray actor: it picks a free port, gives the process the
GPUs of the engine's placement-group bundles (CUDA_VISIBLE_DEVICES), logs to a file, waits for ``/health`` and
returns the URL; a server that exits or never becomes healthy is an EngineError with its exit code and log tail.
``stop()`` kills the server's whole process group. ``check_sglang_args(args)`` runs at flag-validation time (before
Ray starts) and imports SGLang only when it is installed. Nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime_lite.config import EngineConfig
from slime_lite.engine_client import API_KEY_ENV, API_KEY_FILE_ENV, api_key, request_json
from slime_lite.errors import EngineError, SlimeLiteError
from slime_lite.io import free_port, http_url, is_loopback
from slime_lite.placement import plan_layout

log = logging.getLogger(__name__)

ROUTER_MODULE = "sglang_router.launch_router"
# The SGLang release the launcher, its flag checks and the weight wire format target (the one place it is pinned:
# scripts/setup.sh installs it for the tests' SGLang oracle, tests/sglang_oracle.py).
SGLANG_VERSION = "0.5.23"
INSTALL_HINT = f'pip install "sglang[all]=={SGLANG_VERSION}"'
# flags the launcher sets itself, with the slime-lite flag that controls each
OWNED_FLAGS = {
    "--model-path": "--hf-checkpoint", "--model": "--hf-checkpoint", "--host": "(chosen by slime-lite)",
    "--port": "(a free port, chosen by slime-lite)", "--tp-size": "--rollout-num-gpus-per-engine",
    "--tp": "--rollout-num-gpus-per-engine", "--api-key": f"{API_KEY_ENV} (or {API_KEY_FILE_ENV})",
}
# with --lora-rank, the LoRA flags the launcher sets too (each push loads the adapters by name; none at start)
LORA_FLAGS = {"--enable-lora": "--lora-rank", "--max-lora-rank": "--lora-rank",
              "--lora-target-modules": "--lora-target-modules", "--lora-paths": "(each push loads the adapters)"}
START_TIMEOUT_S = float(os.environ.get("SLIME_LITE_ENGINE_START_TIMEOUT", "1200"))
STOP_GRACE_S = 15.0
LOG_TAIL_LINES = 40


def _user_flag(flag: str) -> str:
    """``--name`` as the user typed it: ``--sglang-name``."""
    return "--sglang-" + flag[2:] if flag.startswith("--") else flag


def _flag_names(sglang_args: list[str]) -> list[str]:
    return [a.partition("=")[0] for a in sglang_args if a.startswith("--")]


def _module_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# ---- validation (called from validate_args, before Ray) ------------------------------------------------------
def check_sglang_args(cfg: EngineConfig) -> None:
    """SGLang backend flags: SGLang installed (else the install hint), passthrough flags accepted by SGLang's own
    parser, no flag the launcher owns, the router installed when asked for. A no-op for the embedded backend."""
    router = cfg.use_sglang_router
    if cfg.rollout_backend != "sglang":
        if router:
            raise SlimeLiteError("--use-sglang-router puts SGLang's router in front of SGLang engines: it needs "
                                 "--rollout-backend sglang.")
        return
    if cfg.rollout_external_engine_addrs:
        if router:
            raise SlimeLiteError(
                "--use-sglang-router starts a router over the engines this job starts, and with "
                "--rollout-external-engine-addrs none are started: run the router yourself and pass its address.")
        given = sorted({_user_flag(f) for f in _flag_names(list(cfg.sglang_args))})
        if given:  # (slime's scripts keep their SGLANG_ARGS when pointed at engines started elsewhere)
            log.warning("%s change nothing with --rollout-external-engine-addrs: those engines were started "
                        "elsewhere, with their own flags", ", ".join(given))
        return
    sglang_args = list(cfg.sglang_args)
    owned = {**OWNED_FLAGS, **(LORA_FLAGS if cfg.lora_rank is not None else {})}
    for flag in _flag_names(sglang_args):
        if flag in owned:
            raise SlimeLiteError(f"{_user_flag(flag)}: slime-lite sets {flag} of each SGLang server itself from "
                                 f"{owned[flag]}; drop {_user_flag(flag)}.")
    if cfg.sglang_server_module.split(".")[0] == "sglang":
        if not _module_found("sglang"):
            raise SlimeLiteError(
                f"--rollout-backend sglang needs SGLang, which is not installed in this Python ({sys.executable}). "
                f"Install it on every GPU node ({INSTALL_HINT}, or use the docker image in docker/), or use "
                "--rollout-backend embedded.")
        served = validate_with_sglang_parser(cfg.hf_checkpoint, sglang_args, cfg.lora_rank is not None)
        pp, dp = (getattr(served, "pp_size", 1) or 1), (getattr(served, "dp_size", 1) or 1)
        if cfg.lora_rank is not None and dp > 1:
            raise SlimeLiteError("--lora-rank with --sglang-dp-size above 1: SGLang loads adapters at run time only "
                                 "without its data parallelism; use more engines (--rollout-num-gpus) instead.")
        loaded = getattr(served, "max_loaded_loras", None)
        if cfg.lora_rank is not None and loaded is not None and loaded < 2:
            raise SlimeLiteError(f"--sglang-max-loaded-loras {loaded} with --lora-rank: each weight push loads the new "
                                 "adapter before it unloads the one running requests still use, so SGLang must hold "
                                 "two (it refuses the second load at the first push); give 2 or more, or drop it.")
        if pp > 1 or (dp > 1 and not getattr(served, "enable_dp_attention", False)):
            # each server sees its --rollout-num-gpus-per-engine GPUs and gets them as --tp-size; SGLang places
            # tp x pp ranks per data-parallel replica (dp replicas without --enable-dp-attention)
            n = cfg.rollout_num_gpus_per_engine
            raise SlimeLiteError(
                f"--sglang-pp-size {pp} / --sglang-dp-size {dp}: each SGLang server gets --rollout-num-gpus-per-engine "
                f"{n} GPUs and slime-lite makes them its --tp-size, so SGLang would place its ranks on "
                f"{n * pp * (1 if getattr(served, 'enable_dp_attention', False) else dp)} GPUs of {n}: drop them "
                "and use more engines (--rollout-num-gpus) or more GPUs per engine (data parallelism inside an "
                "engine: --sglang-dp-size with --sglang-enable-dp-attention).")
        # attention data parallelism splits the server's tp ranks into equal groups (SGLang asserts it at start)
        n, attn_dp = cfg.rollout_num_gpus_per_engine, getattr(served, "attn_dp_size", 1) or 1
        given = f"--sglang-attn-dp-size {attn_dp}"
        if attn_dp > 1 and dp > 1:  # SGLang refuses it at start
            raise SlimeLiteError(f"--sglang-dp-size {dp} with {given}: SGLang does not combine data-parallel replicas "
                                 "with attention data parallelism; drop --sglang-dp-size (and "
                                 "--sglang-enable-dp-attention, its older spelling).")
        if attn_dp == 1 and getattr(served, "enable_dp_attention", False):  # the older spelling of the same
            attn_dp, given = dp, f"--sglang-dp-size {dp} with --sglang-enable-dp-attention"
        if n % attn_dp:
            raise SlimeLiteError(
                f"{given}: SGLang splits each server's --tp-size (slime-lite's --rollout-num-gpus-per-engine {n}) "
                f"into {attn_dp} attention data-parallel groups, and {attn_dp} does not divide {n}: make "
                f"--rollout-num-gpus-per-engine a multiple of {attn_dp}, or the attention data-parallel size a "
                f"divisor of {n}.")
    if router and not _module_found("sglang_router"):
        raise SlimeLiteError("--use-sglang-router needs SGLang's router, which is not installed: "
                             "pip install sglang-router (or drop --use-sglang-router: slime-lite balances the "
                             "engines itself).")


def _raising_parser():
    """An argparse parser whose errors raise SlimeLiteError instead of printing usage and exiting. Prefix matching
    stays on, as in SGLang's own launch parser (``--tp`` means ``--tp-size``; an ambiguous prefix is an error)."""

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):
            raise SlimeLiteError(f"SGLang rejects the --sglang-* flags: {message} (each --sglang-<name> is passed to "
                                 "SGLang as --<name>; see python -m sglang.launch_server --help).")

    return Parser(prog="sglang.launch_server", add_help=False)


# ServerArgs fields the launcher sets itself (build_command), with the slime-lite flag that controls each
OWNED_DESTS = {"model_path": "--hf-checkpoint", "host": "(chosen by slime-lite)",
               "port": "(a free port, chosen by slime-lite)", "tp_size": "--rollout-num-gpus-per-engine",
               "api_key": f"{API_KEY_ENV} or {API_KEY_FILE_ENV} (given to servers off loopback, sent with every "
                          "request)"}
LORA_DESTS = {"enable_lora": "--lora-rank", "max_lora_rank": "--lora-rank",
              "lora_target_modules": "--lora-target-modules", "lora_paths": "(each push loads the adapters)"}
UNSET = "\0slime-lite:unset"  # a value no flag gives: what a parse leaves at UNSET, the passthrough did not set


def validate_with_sglang_parser(model_path: str, sglang_args: list[str], lora: bool = False) -> argparse.Namespace:
    """Parse the passthrough flags with SGLang's own ``ServerArgs.add_cli_args`` (the flag set of the installed
    release, never a copied list): unknown or ambiguous flags, bad values and any flag that sets a field the
    launcher owns (``OWNED_DESTS``, with ``lora`` also ``LORA_DESTS``), whatever its value and however it is spelt
    (a prefix such as ``--sglang-po``, an alias such as ``--sglang-tensor-parallel-size``), are errors. Returns
    what SGLang parsed."""
    try:
        from sglang.srt.server_args import ServerArgs  # only reached when SGLang is installed
    except ImportError as exc:
        raise SlimeLiteError(
            f"--rollout-backend sglang: SGLang is installed in this Python ({sys.executable}) but its "
            f"sglang.srt.server_args does not import ({exc}); the --sglang-* flags are checked with it before "
            f"anything starts. Install SGLang with its dependencies ({INSTALL_HINT}) where slime-lite train runs."
        ) from None

    parser = _raising_parser()
    ServerArgs.add_cli_args(parser)
    parsed, unknown = parser.parse_known_args(["--model-path", str(model_path), *sglang_args])
    if unknown:
        names = [_user_flag(u) for u in unknown if u.startswith("-")] or unknown
        raise SlimeLiteError(f"SGLang does not know {' '.join(names)}: every --sglang-<name> must be a flag of "
                             "python -m sglang.launch_server (as --<name>). Check the spelling against your "
                             "SGLang version's --help.")
    # the owned fields start at UNSET (argparse then leaves their defaults out): one the passthrough sets changes
    owned = {**OWNED_DESTS, **(LORA_DESTS if lora else {})}
    unset = argparse.Namespace(**dict.fromkeys(owned, UNSET))
    seen = parser.parse_known_args(["--model-path", UNSET, *sglang_args], unset)[0]
    for dest, controlled_by in owned.items():
        if getattr(seen, dest) != UNSET:
            flag = "--sglang-" + dest.replace("_", "-")
            raise SlimeLiteError(f"{flag} (or a prefix or alias of it) sets SGLang's {dest}, which slime-lite sets "
                                 f"for each server itself from {controlled_by}; drop that flag.")
    return parsed


# ---- command line ------------------------------------------------------------------------------------------
# Runs the server module with --api-key taken from the environment: the key reaches SGLang's argument parser
# without being on any command line (/proc/PID/cmdline shows the argv given to exec, not sys.argv after this).
KEYED_LAUNCH = ("import os, runpy, sys; key = os.environ.pop('SLIME_LITE_ENGINE_API_KEY'); "
                "os.environ.pop('SLIME_LITE_ENGINE_API_KEY_FILE', None); module = sys.argv[1]; "
                "sys.argv = [module] + sys.argv[2:] + ['--api-key', key]; "
                "runpy.run_module(module, run_name='__main__', alter_sys=True)")


def keyed_command(cmd: list[str]) -> list[str]:
    """``cmd`` (``python -m MODULE ARGS``) run so that the server gets ``--api-key`` from the environment."""
    assert cmd[1] == "-m", cmd
    return [cmd[0], "-c", KEYED_LAUNCH, cmd[2], *cmd[3:]]


def build_command(cfg: EngineConfig, rank: int, port: int, host: str = "127.0.0.1") -> list[str]:
    """The engine's command line: model, address, TP size, per-engine seed, memory saver under colocate or
    --offload-rollout (and with LoRA a CPU copy of the weights it releases), then every passthrough flag in the
    order given (so a passthrough --random-seed overrides ours)."""
    cmd = [
        sys.executable, "-m", cfg.sglang_server_module,
        "--model-path", str(cfg.hf_checkpoint),
        "--host", host,
        "--port", str(port),
        "--tp-size", str(cfg.rollout_num_gpus_per_engine),
        "--random-seed", str(cfg.rollout_seed + rank),
    ]
    releases = cfg.colocate or cfg.offload_rollout  # the driver releases the engine's memory between rollouts
    if releases:  # (without the memory saver SGLang's release and resume do nothing)
        cmd.append("--enable-memory-saver")
    if cfg.use_rollout_routing_replay:  # the experts of every token, in each response's meta_info
        cmd.append("--enable-return-routed-experts")
    if cfg.lora_rank is not None:  # adapters loaded by name at each push (weight_push.push_lora_to_sglang)
        # here, not at the top: the rollout side imports this module and must not import backends.megatron
        from slime_lite.backends.megatron.lora_config import sglang_target_modules
        cmd += ["--enable-lora", "--max-lora-rank", str(cfg.lora_rank),
                "--lora-target-modules", *sglang_target_modules(cfg.lora_target_modules)]
        if releases:  # the pushes send adapters only: the released base weights must come back from a copy
            cmd.append("--enable-weights-cpu-backup")
    cmd += [str(a) for a in cfg.sglang_args]
    return cmd


def engine_host() -> str:
    """127.0.0.1 on one node; this node's IP when the Ray cluster has several (the rollout may run elsewhere).
    SLIME_LITE_ENGINE_HOST overrides both."""
    if os.environ.get("SLIME_LITE_ENGINE_HOST"):
        return os.environ["SLIME_LITE_ENGINE_HOST"].strip("[]")  # an IPv6 address without its URL brackets
    try:
        import ray

        if ray.is_initialized() and sum(1 for n in ray.nodes() if n.get("Alive")) > 1:
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray, or the GCS is gone: local is the only sane answer
        pass
    return "127.0.0.1"


def engine_gpu_ids(args: Any, rank: int) -> list[int] | None:
    """The GPU ids Ray assigned to this engine's bundles (all on one node), or None outside Ray / without GPUs.

    The engine actor holds the first of its ``--rollout-num-gpus-per-engine`` bundles (its whole GPU when the engines
    have GPUs of their own); the others are asked with a tiny probe task each (a bundle's GPU id is fixed by Ray)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    own = [int(g) for g in ray.get_gpu_ids()]
    per = int(args.rollout_num_gpus_per_engine)
    if not own or per == 1:
        return own or None
    pg = get_current_placement_group()
    if pg is None:
        return own
    bundles = plan_layout(args).rollout[rank * per:(rank + 1) * per]

    @ray.remote(num_cpus=0, num_gpus=0.01)
    def probe() -> tuple[str, list[int]]:
        return ray.get_runtime_context().get_node_id(), [int(g) for g in ray.get_gpu_ids()]

    try:
        found = ray.get([
            probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=b)).remote()
            for b in bundles[1:]
        ], timeout=120)
    except ray.exceptions.GetTimeoutError:
        raise EngineError(f"engine {rank}: the GPUs of its bundles {bundles[1:]} were not given within 120 s "
                          f"(--rollout-num-gpus-per-engine {per}): another process holds them whole.") from None
    found = [(ray.get_runtime_context().get_node_id(), own)] + found
    if len({node for node, _ in found}) > 1:
        raise EngineError(f"engine {rank}: its {per} GPUs (bundles {bundles}) are on different nodes; a tensor-"
                          "parallel SGLang engine needs them on one node. Use a --rollout-num-gpus-per-engine that "
                          "divides the GPUs per node.")
    return [g for _, ids in found for g in ids]


# ---- processes -------------------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launching process dies (Linux), so no server outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def log_dir() -> str:
    """Where engine logs go: SLIME_LITE_ENGINE_LOG_DIR (set by ima-bisect), else a temp folder."""
    path = os.environ.get("SLIME_LITE_ENGINE_LOG_DIR") or os.path.join(tempfile.gettempdir(), "slime_lite_engines")
    os.makedirs(path, exist_ok=True)
    return path


class _ManagedProcess:
    """A server process in its own process group: start, wait healthy, stop the whole group."""

    what = "server"

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.log_path: str | None = None
        self.command: list[str] = []
        self._log_file = None

    def _launch(self, cmd: list[str], env: dict[str, str], log_name: str, timeout: float) -> str:
        self.command = cmd
        self.log_path = os.path.join(log_dir(), log_name)
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log_file.flush()
        log.info("starting %s: %s (log %s)", self.what, " ".join(cmd), self.log_path)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                self.stop()
                raise EngineError(f"{self.what} exited with code {code} before it was healthy at {self.url}.\n"
                                  f"command: {' '.join(cmd)}\nlog {self.log_path}, last lines:\n"
                                  f"{log_tail(self.log_path)}")
            try:
                request_json(self.url, "/health", timeout=5)
                log.info("%s healthy at %s (pid %d)", self.what, self.url, self.proc.pid)
                return self.url
            except EngineError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"{self.what} at {self.url} was not healthy after {timeout:.0f}s and was killed "
                                  f"(SLIME_LITE_ENGINE_START_TIMEOUT raises the limit).\ncommand: {' '.join(cmd)}\n"
                                  f"log {self.log_path}, last lines:\n{log_tail(self.log_path)}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after a grace period; safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None:
            for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
                try:  # the group, so children that outlive the leader go too
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


class SGLangServer(_ManagedProcess):
    """One SGLang engine process. ``start()`` returns its URL; ``stop()`` leaves no process behind."""

    def __init__(self, args: Any, rank: int, *, gpu_ids: list[int] | None = None,
                 start_timeout: float | None = None) -> None:
        super().__init__()
        self.args, self.rank = args, rank
        self.config = EngineConfig.from_args(args)
        self.gpu_ids = gpu_ids
        self.start_timeout = START_TIMEOUT_S if start_timeout is None else start_timeout
        self.what = f"SGLang engine {rank}"

    def start(self) -> str:
        host = engine_host()
        port = free_port(host)
        self.url = http_url(host, port)
        env = dict(os.environ)
        gpus = self.gpu_ids if self.gpu_ids is not None else engine_gpu_ids(self.args, self.rank)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        cmd, env = with_api_key(build_command(self.config, self.rank, port, host), env, host, self.what)
        return self._launch(cmd, env, f"sglang_engine{self.rank}_{port}.log", self.start_timeout)


def with_api_key(cmd: list[str], env: dict[str, str], host: str, what: str) -> tuple[list[str], dict[str, str]]:
    """A server reachable from other hosts (``host`` not loopback) gets the run's API key through its environment
    (``keyed_command``), never on its command line; without a key it is refused before launch."""
    if is_loopback(host):
        return cmd, env

    key = api_key()
    if not key:
        raise EngineError(f"{what} would listen on {host} (not loopback) without an API key: set {API_KEY_ENV} or "
                          f"{API_KEY_FILE_ENV} (slime-lite train sets one)")
    return keyed_command(cmd), {**env, API_KEY_ENV: key}


def build_router_command(worker_urls: list[str], port: int, host: str = "127.0.0.1",
                         module: str = ROUTER_MODULE) -> list[str]:
    return [sys.executable, "-m", module, "--worker-urls", *worker_urls, "--host", host, "--port", str(port)]


class SGLangRouter(_ManagedProcess):
    """SGLang's router in front of the engines; the rollout sends /generate to ``start()``'s URL.
    Weight updates still go to each engine's own URL. Off loopback it gets the run's API key as the engines do
    (sglang_router's ``--api-key``: the key it sends to the workers, and in newer releases also the one its
    clients must send)."""

    what = "SGLang router"

    def __init__(self, worker_urls: list[str], *, module: str = ROUTER_MODULE, start_timeout: float = 120.0) -> None:
        super().__init__()
        self.worker_urls = list(worker_urls)
        self.module = module
        self.start_timeout = start_timeout

    def start(self) -> str:
        if self.module == ROUTER_MODULE and not _module_found("sglang_router"):
            raise SlimeLiteError("--use-sglang-router needs SGLang's router: pip install sglang-router.")
        host = engine_host()
        port = free_port(host)
        self.url = http_url(host, port)
        cmd, env = with_api_key(build_router_command(self.worker_urls, port, host, self.module), dict(os.environ),
                                host, self.what)
        return self._launch(cmd, env, f"sglang_router_{port}.log", self.start_timeout)
