"""Where each process goes: a pure layout table per mode, then the Ray placement group made from it.

On a machine without GPUs every "GPU" is one logical slot (the Ray custom resource ``slot``), so the same flags
give the same tables.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime_lite import driver_watch
from slime_lite.config import TrainSideConfig
from slime_lite.engine_client import API_KEY_ENV, api_key
from slime_lite.errors import SlimeLiteError
from slime_lite.logging_setup import LOG_LEVEL_ENV

log = logging.getLogger(__name__)
RAY_START_FAILURE = "timed out during startup"  # in the error of Ray's start-up timeout


@dataclass
class Layout:
    num_bundles: int
    actor: list[int] = field(default_factory=list)
    critic: list[int] = field(default_factory=list)
    rollout: list[int] = field(default_factory=list)  # one bundle per engine GPU, engines take consecutive runs


def plan_layout(args: Any) -> Layout:
    """The bundle indices of each group for the run's mode."""
    actor_n = args.actor_num_nodes * args.actor_num_gpus_per_node
    critic_n = args.critic_num_nodes * args.critic_num_gpus_per_node if TrainSideConfig.from_args(args).has_critic \
        else 0
    external = bool(args.rollout_external_engine_addrs)
    rollout_n = 0 if (args.debug_train_only or external) else args.rollout_num_gpus
    if args.debug_rollout_only:
        return Layout(rollout_n, rollout=list(range(rollout_n)))
    if args.colocate:
        n = max(actor_n, critic_n, rollout_n)
        return Layout(n, list(range(actor_n)), list(range(critic_n)), list(range(rollout_n)))
    per, node = args.rollout_num_gpus_per_engine, args.num_gpus_per_node
    if rollout_n and node and (actor_n + critic_n) % per:  # the engines' bundles follow the trainer's
        raise SlimeLiteError(
            f"the engines' GPUs start after the trainer's {actor_n + critic_n} (--actor-num-nodes x "
            f"--actor-num-gpus-per-node{', and the critic' if critic_n else ''}), which --rollout-num-gpus-per-engine "
            f"{per} does not divide, so an engine would span two nodes of --num-gpus-per-node {node}: give the "
            f"trainer a multiple of {per} GPUs, or --colocate.")
    return Layout(
        actor_n + critic_n + rollout_n,
        list(range(actor_n)),
        list(range(actor_n, actor_n + critic_n)),
        list(range(actor_n + critic_n, actor_n + critic_n + rollout_n)),
    )


def gpu_resource() -> str:
    """``GPU`` when the Ray cluster has GPUs (a job submitted from a node without one, e.g. a CPU-only head node,
    still places on the GPU nodes), and before Ray starts when CUDA is visible here; else the logical ``slot``
    resource (a CPU machine)."""
    if ray.is_initialized():
        return "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "slot"
    import torch  # torch: the driver asks only here

    return "GPU" if torch.cuda.is_available() else "slot"


def init_ray(args: Any, num_slots: int) -> None:
    """Join the cluster named by RAY_ADDRESS (ray job submit) or start a local one sized for this run."""

    if ray.is_initialized():
        return
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p)}}
    env["env_vars"][LOG_LEVEL_ENV] = args.log_level  # third-party noise follows --log-level in every process
    env["env_vars"].update(kv.split("=", 1) for kv in args.debug_env)  # --debug-env
    # engines on non-loopback addresses require this run's API key; every Ray process gets it by environment

    os.environ[API_KEY_ENV] = api_key() or secrets.token_urlsafe(32)
    env["env_vars"][API_KEY_ENV] = os.environ[API_KEY_ENV]
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", runtime_env=env, log_to_driver=True)  # the job's actors share the driver's fate
        return
    driver_watch.start()  # a local cluster is this driver's: it goes when the driver goes, even on kill -9
    resources = {} if gpu_resource() == "GPU" else {"slot": float(max(num_slots, 1))}
    for attempt in (1, 2):
        try:
            # address="local": a new cluster, never one that `ray start` left (or its stale file in /tmp/ray names)
            ray.init(address="local", num_cpus=max(8, 2 * num_slots + 2), resources=resources,
                     include_dashboard=False, runtime_env=env, logging_level="WARNING")
            return
        except Exception as exc:  # Ray's own start-up timeout (its raylet did not register within 30 s)
            if attempt == 2 or RAY_START_FAILURE not in str(exc):
                raise
            log.warning("Ray did not start (%s): the host may be overloaded; starting it once more", exc)
            ray.shutdown()  # what the first start left running goes with this driver (the driver watch)


def create_placement_group(layout: Layout, timeout: float = 120.0):
    """A PACK placement group of ``layout.num_bundles`` one-GPU (or one-slot) bundles; None when empty."""

    if layout.num_bundles == 0:
        return None
    res = gpu_resource()
    pg = placement_group([{"CPU": 1, res: 1} for _ in range(layout.num_bundles)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        raise SlimeLiteError(
            f"Ray could not place {layout.num_bundles} {res} bundles within {timeout:.0f}s; the cluster has "
            f"{ray.cluster_resources().get(res, 0):g}. Lower the GPU counts in the flags or add nodes."
        )
    return pg


def bundle_options(pg: Any, bundle: int, share: float = 1.0) -> dict[str, Any]:
    """Ray actor options for a process on ``bundle``; ``share`` < 1 lets colocated processes share it."""

    res = gpu_resource()
    opts: dict[str, Any] = {
        "num_cpus": share,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle
        ),
    }
    if res == "GPU":
        opts["num_gpus"] = share
    else:
        opts["resources"] = {"slot": share}
    return opts
