"""Where a train group's ranks meet: every rank was given 127.0.0.1, so ranks on a second node (--actor-num-nodes 2)
dialled their own loopback and waited out the store's timeout. No Ray: the workers are stand-ins recording calls."""

from __future__ import annotations

from slime_lite.backends.megatron import group


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _FakeWorker:
    def __init__(self, ip: str, calls: list) -> None:
        self.node_ip = _Remote(lambda: ip)
        self.call = _Remote(lambda method, *args: calls.append((ip, method, args)) or (
            4321 if method == "open_store" else {"next_rollout_id": 0, "data_state": None}))


def _init(ips: list[str], monkeypatch) -> list:
    monkeypatch.setattr(group.ray, "get", lambda refs: refs)
    calls: list = []
    g = object.__new__(group.TrainGroup)
    g.workers = [_FakeWorker(ip, calls) for ip in ips]
    assert g.init() == (0, None)
    return calls


def test_ranks_on_one_node_meet_on_the_loopback_and_across_nodes_at_rank_0s_address(monkeypatch):
    calls = _init(["10.0.0.5", "10.0.0.5"], monkeypatch)
    assert calls[0] == ("10.0.0.5", "open_store", ("127.0.0.1",))
    assert [c[2] for c in calls[1:]] == [("127.0.0.1", 4321)] * 2
    calls = _init(["10.0.0.5", "10.0.0.6", "10.0.0.6"], monkeypatch)
    assert calls[0] == ("10.0.0.5", "open_store", ("10.0.0.5",))
    assert [c[2] for c in calls[1:]] == [("10.0.0.5", 4321)] * 3
