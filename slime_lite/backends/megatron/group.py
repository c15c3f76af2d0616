"""Driver-side handle of one train group (actor or critic): N Ray actors forming one Megatron-core job."""

from __future__ import annotations

from typing import Any

from slime_lite.errors import SlimeLiteError


class TrainGroup:
    def __init__(self, args: Any, pg: Any, bundles: list[int], role: str) -> None:
        import ray

        from slime_lite.backends.megatron.actor import TrainActor
        from slime_lite.placement import bundle_options

        self.args, self.role = args, role
        world = len(bundles)
        if world == 0:
            raise SlimeLiteError(f"no GPUs placed for the {role} group")
        share = 0.4 if args.colocate else 1.0
        cls = ray.remote(TrainActor)
        self.workers = [
            cls.options(**bundle_options(pg, b, share)).remote(args, role, rank, world, "127.0.0.1")
            for rank, b in enumerate(bundles)
        ]

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    @staticmethod
    def _one(results: list[Any]) -> Any:
        return next(r for r in results if r is not None)

    def init(self) -> tuple[int, Any]:
        import ray

        # Rank 0 binds the rendezvous port itself (a port chosen here could be taken before it binds).
        port = ray.get(self.workers[0].open_store.remote())
        state = self._all("init", port)[0]
        return state["next_rollout_id"], state["data_state"]

    def train(self, rollout_id: int, samples: list, critic: "TrainGroup | None") -> dict[str, float]:
        import ray

        ref = ray.put(samples)
        values = self._one(critic._all("compute_values", ref)) if critic is not None else None
        metrics, returns = self._one(self._all("train", rollout_id, ref, values))
        if critic is not None:
            metrics.update(self._one(critic._all("train_critic", rollout_id, ref, values, returns)))
        return metrics

    def memory(self) -> list[dict[str, float]]:
        return self._all("memory")

    def offload(self) -> None:
        self._all("offload")

    def onload(self) -> None:
        self._all("onload")

    def save(self, rollout_id: int, data_state: Any) -> None:
        self._all("save", rollout_id, data_state)

    def update_weights(self, urls: list[str], version: int) -> None:
        self._all("push_weights", urls, version)
