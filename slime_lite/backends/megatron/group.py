"""Driver-side handles of the train groups: N Ray workers forming one Megatron-core job, running every call in
lockstep; a call's result is the reporter rank's. ``ActorGroup`` is the policy, ``CriticGroup`` the PPO critic."""

from __future__ import annotations

import importlib
from typing import Any

import ray

from slime_lite.errors import SlimeLiteError
from slime_lite.placement import bundle_options


class _Worker:
    """A train worker as a Ray actor, made without importing its class in the driver (megatron-core and
    transformers take ~6 s of a 2-core machine to import, and the worker process imports them anyway): the worker
    process builds ``module``'s ``name`` and runs each ``call`` on it."""

    def __init__(self, module: str, name: str, *args: Any) -> None:
        self.impl = getattr(importlib.import_module(module), name)(*args)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.impl, method)(*args)

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()


def train_env(args: Any) -> dict[str, Any]:
    """--train-env-vars as Ray actor options: a runtime_env whose env_vars Ray merges over the job's (--debug-env)."""
    env = {str(k): str(v) for k, v in args.train_env_vars.items()}
    return {"runtime_env": {"env_vars": env}} if env else {}


class TrainGroup:
    def __init__(self, args: Any, pg: Any, bundles: list[int], role: str, module: str, name: str) -> None:
        self.args = args
        world = len(bundles)
        if world == 0:
            raise SlimeLiteError(f"no GPUs placed for the {role} group")
        share = 0.4 if args.colocate else 1.0
        cls = ray.remote(type(name, (_Worker,), {}))  # Ray names the process by the class: "(TrainActor pid=...)"
        self.workers = [
            cls.options(**bundle_options(pg, b, share), **train_env(args)).remote(module, name, args, rank, world)
            for rank, b in enumerate(bundles)
        ]

    def _all(self, method: str, *args: Any) -> list[Any]:
        return ray.get([w.call.remote(method, *args) for w in self.workers])

    def _reported(self, method: str, *args: Any) -> Any:
        """Run ``method`` on every rank; the reporter's result (the only one that is not None)."""
        return next(r for r in self._all(method, *args) if r is not None)

    def init(self) -> tuple[int, Any]:
        # Rank 0 binds the rendezvous port itself (a port chosen here could be taken before it binds). The ranks
        # meet at rank 0's node address when they span nodes (--actor-num-nodes above 1), else on the loopback.
        ips = ray.get([w.node_ip.remote() for w in self.workers])
        addr = "127.0.0.1" if len(set(ips)) == 1 else ips[0]
        port = ray.get(self.workers[0].call.remote("open_store", addr))
        state = self._all("init", addr, port)[0]
        return state["next_rollout_id"], state["data_state"]

    def memory(self) -> list[dict[str, float]]:
        return self._all("memory")

    def offload(self) -> None:
        self._all("offload")

    def onload(self) -> None:
        self._all("onload")

    def save(self, rollout_id: int, data_state: Any) -> None:
        self._all("save", rollout_id, data_state)

    def start_profile(self) -> None:
        self._all("start_profile")

    def stop_profile(self, folder: str) -> None:
        """Each worker writes its PyTorch profiler trace into ``folder``."""
        self._all("stop_profile", folder)

    def memory_snapshot(self, folder: str, rollout_id: int) -> None:
        self._all("memory_snapshot", folder, rollout_id)


class ActorGroup(TrainGroup):
    def __init__(self, args: Any, pg: Any, bundles: list[int]) -> None:
        super().__init__(args, pg, bundles, "actor", "slime_lite.backends.megatron.actor", "TrainActor")

    def train(self, rollout_id: int, samples: Any, values: list | None = None) -> tuple[Any, list]:
        """Log-probs, advantages (over the critic's ``values`` refs, when there is a critic) and the policy steps of
        one rollout; returns the reporter's ``TrainResult`` and the refs of the per-sample returns (the critic's
        targets), which stay in Ray's object store."""

        pairs = [w.call.options(num_returns=2).remote("train", rollout_id, samples, values) for w in self.workers]
        result = next(r for r in ray.get([p[0] for p in pairs]) if r is not None)
        return result, [p[1] for p in pairs]

    def update_reference(self) -> None:
        """--ref-update-interval: the reference model takes the actor's current weights on every rank."""
        self._all("update_reference")

    def update_weights(self, urls: list[str], version: int, check: bool = False) -> dict[str, float]:
        """Push the weights to ``urls`` as ``version``; ``check`` runs the weight-equality check even without
        --check-weight-update-equal (an engine restarted by --use-fault-tolerance). Returns the push's parts in
        seconds (``perf/update_weights/*``)."""
        return self._reported("push_weights", urls, version, check)


class CriticGroup(TrainGroup):
    def __init__(self, args: Any, pg: Any, bundles: list[int]) -> None:
        super().__init__(args, pg, bundles, "critic", "slime_lite.backends.megatron.critic", "CriticActor")

    def compute_values(self, samples: Any) -> list:
        """Per-sample response-token values of one rollout, started on every rank: their refs (the actor reads the
        reporter's, not the driver)."""
        return [w.call.remote("compute_values", samples) for w in self.workers]

    def train(self, rollout_id: int, samples: Any, values: list, returns: list) -> Any:
        """The value steps of one rollout, toward the ``returns`` refs; returns the reporter's ``TrainResult``."""
        return self._reported("train", rollout_id, samples, values, returns)
