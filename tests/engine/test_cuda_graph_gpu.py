"""CUDA-graph decode on a GPU (skipped without CUDA): replayed graphs give what eager decode gives, see in-place
weight updates without a new capture, and are dropped and captured again across memory release and resume."""

from __future__ import annotations

import pytest
import torch

from test_padded_decode import run_requests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPECS = [([1 + (i * 7) % 40 for _ in range(3 + i % 5)], [5, 90, 17, 40, 3, 70, 25][i % 7], 1000 + i)
         for i in range(14)]


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    from slime_lite.engine.scheduler import Scheduler

    made = {}
    for graphs in (True, False):
        s = Scheduler(str(tiny_model_dir), device="cuda", dtype="float32", max_running_requests=6,
                      kv_cache_tokens=6 * 160, cuda_graph=graphs)
        s.start()
        made[graphs] = s
    yield made
    for s in made.values():
        s.stop()


def assert_same(got, want, tol=1e-4):
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        assert max(abs(a - b) for a, b in zip(g.output_logprobs, w.output_logprobs)) < tol


def test_graph_replay_matches_eager_decode(pair):
    got = run_requests(pair[True], SPECS)
    assert pair[True].decoder.capture and len(pair[True].decoder.graphs) >= 2  # batch and length buckets
    assert_same(got, run_requests(pair[False], SPECS))


def test_in_place_weight_update_reaches_captured_graphs(pair):
    before = run_requests(pair[True], SPECS[:4])
    graphs = dict(pair[True].decoder.graphs)
    gen = torch.Generator().manual_seed(0)
    name = "model.layers.1.mlp.down_proj.weight"
    for s in pair.values():
        w = s.weights.params[name]
        new = torch.randn(w.shape, generator=gen.manual_seed(0)) * 0.5
        s.call(s.weights.load_named, {name: new}).result(60)
    after = run_requests(pair[True], SPECS[:4])
    assert [o.output_logprobs for o in after] != [o.output_logprobs for o in before]
    assert all(pair[True].decoder.graphs.get(k) is g for k, g in graphs.items())  # no new capture for them
    assert_same(after, run_requests(pair[False], SPECS[:4]))


def test_release_and_resume_memory_recaptures(pair):
    s = pair[True]
    run_requests(s, SPECS[:3])
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    s.call(s.release_memory, ["weights", "kv_cache"]).result(60)
    assert not s.decoder.graphs and torch.cuda.memory_allocated() < held
    s.call(s.resume_memory, ["weights", "kv_cache"]).result(60)
    assert_same(run_requests(s, SPECS), run_requests(pair[False], SPECS))
    assert s.decoder.graphs
