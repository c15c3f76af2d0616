"""CUDA-graph decode on a GPU (skipped without CUDA): replayed graphs give what eager decode gives, see in-place
weight updates without a new capture, and are kept across memory release and resume (mapped memory, engine/vmm.py),
or dropped and captured again without it."""

from __future__ import annotations

import pytest
import torch

from test_padded_decode import SPECS, assert_same, run_requests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    from slime_lite.engine.scheduler import Scheduler

    made = {}
    for graphs in (True, False, "compile"):
        s = Scheduler(str(tiny_model_dir), device="cuda", dtype="float32", max_running_requests=6,
                      kv_cache_tokens=6 * 160, cuda_graph=bool(graphs), enable_torch_compile=graphs == "compile")
        s.start()
        made[graphs] = s
    yield made
    for s in made.values():
        s.stop()


def test_graph_replay_matches_eager_decode(pair):
    got = run_requests(pair[True], SPECS)
    assert pair[True].decoder.capture and len(pair[True].decoder.graphs) >= 2  # batch and length buckets
    assert_same(got, run_requests(pair[False], SPECS))


@pytest.mark.parametrize("sampling", [{"top_p": 0.9, "top_k": 20}, {"min_new_tokens": 30}])
def test_graph_replay_with_the_general_sampler_matches_eager_decode(pair, sampling):
    assert_same(run_requests(pair[True], SPECS, **sampling), run_requests(pair[False], SPECS, **sampling))


def test_compiled_graphs_match_eager_decode(pair):
    assert pair["compile"].lm.compiled and not pair[True].lm.compiled
    assert_same(run_requests(pair["compile"], SPECS), run_requests(pair[False], SPECS))
    assert pair["compile"].decoder.graphs


def test_in_place_weight_update_reaches_captured_graphs(pair):
    before = run_requests(pair[True], SPECS[:4])
    graphs = dict(pair[True].decoder.graphs)
    gen = torch.Generator().manual_seed(0)
    name = "model.layers.1.mlp.down_proj.weight"
    for s in (pair[True], pair[False]):
        w = s.weights.params[name]
        new = torch.randn(w.shape, generator=gen.manual_seed(0)) * 0.5
        s.call(s.weights.load_named, {name: new}).result(60)
    after = run_requests(pair[True], SPECS[:4])
    assert [o.output_logprobs for o in after] != [o.output_logprobs for o in before]
    assert all(pair[True].decoder.graphs.get(k) is g for k, g in graphs.items())  # no new capture for them
    assert_same(after, run_requests(pair[False], SPECS[:4]))


def test_graphs_survive_a_clear_of_cublas_workspaces(pair):
    # torch.compile's own CUDA graphs clear cuBLAS workspaces at every recording; a graph holding one it did not
    # allocate would then write to freed memory. Here: capture, clear, scribble over freed memory, replay.
    s = pair[True]
    run_requests(s, SPECS)
    assert s.decoder.graphs
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(64)]
    try:
        assert_same(run_requests(s, SPECS), run_requests(pair[False], SPECS))
    finally:
        del junk


def test_release_and_resume_keep_the_graphs_in_mapped_memory(pair, monkeypatch):
    """Released memory goes back to the GPU. The cache and the weights live in mapped buffers (engine/vmm.py): they
    come back at their addresses, so every graph is kept (none dropped, none captured again for a shape seen
    before). With vmm off the graphs go with the memory and are captured again. Either way the engine decodes what
    eager decode does."""
    from slime_lite.engine import vmm

    s = pair[True]
    assert vmm.available(torch.device("cuda"))
    want = run_requests(pair[False], SPECS)
    for round_ in range(2):
        run_requests(s, SPECS)
        graphs, resets = dict(s.decoder.graphs), s.decoder.num_graph_resets
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        s.call(s.release_memory, ["weights", "kv_cache"]).result(60)
        assert torch.cuda.mem_get_info()[0] > free  # given back to the GPU, not only to torch's cache
        s.call(s.resume_memory, ["weights", "kv_cache"]).result(60)
        assert_same(run_requests(s, SPECS), want)
        assert s.decoder.num_graph_resets == resets, round_
        assert all(s.decoder.graphs.get(k) is g for k, g in graphs.items()), round_
    # A cache that must grow after a release maps only its new size (what it held is lost anyway).
    s.call(s.flush_cache).result(60)
    run_requests(s, SPECS[:1])
    s.call(s.release_memory, ["weights", "kv_cache"]).result(60)
    s.call(s.resume_memory, ["weights", "kv_cache"]).result(60)
    held = s.cache.allocated
    assert held[0] < s.cache.slots
    vmm.reset_peak()
    s.call(s.cache.ensure, s.cache.slots, s.cache.max_len).result(60)
    assert s.cache.allocated == (s.cache.slots, s.cache.max_len)
    now, peak = vmm.mapped_bytes()
    assert peak == now, "the old cache was mapped again before the new one"
    longer = [(p, 150 - len(p), seed) for p, _, seed in SPECS[:3]]
    assert_same(run_requests(s, longer, ignore_eos=True), run_requests(pair[False], longer, ignore_eos=True))
    monkeypatch.setattr(vmm, "ENABLED", False)
    s.call(s.flush_cache).result(60)  # the cache is allocated again, by torch
    run_requests(s, SPECS)
    assert s.decoder.graphs
    s.call(s.release_memory, ["kv_cache"]).result(60)
    assert not s.decoder.graphs
    s.call(s.resume_memory, ["kv_cache"]).result(60)
    assert_same(run_requests(s, SPECS), want)
    assert s.decoder.graphs


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_graphs_of_an_engine_on_the_second_gpu(tiny_model_dir, pair):
    from slime_lite.engine.scheduler import Scheduler

    # Against a fresh eager engine on cuda:0 (the fixture's engines may carry another test's weight update).
    made = [Scheduler(str(tiny_model_dir), device=dev, dtype="float32", max_running_requests=6,
                      kv_cache_tokens=6 * 160, cuda_graph=graphs) for dev, graphs in (("cuda:1", None), ("cuda:0", False))]
    for s in made:
        s.start()
    try:
        assert_same(run_requests(made[0], SPECS), run_requests(made[1], SPECS))
        assert made[0].decoder.graphs and made[0].cache.kv.device == torch.device("cuda:1")
    finally:
        for s in made:
            s.stop()


def test_triton_sampler_draws_what_the_eager_passes_draw():
    from slime_lite.engine import block_stats
    from test_sampling import check_triton_sample

    assert block_stats.available(torch.device("cuda")), "Triton should come with CUDA torch"
    check_triton_sample("cuda", (torch.float32, torch.bfloat16))


def test_prefix_cache_hits_under_graph_replay_match_cold_runs(pair):
    """The same requests again: their prompts' K/V come from the prefix cache (idle rows of padded steps must not
    overwrite what free slots hold) and they decode exactly as the cold run did."""
    s = pair[True]
    s.call(s.flush_cache).result(60)
    cold = run_requests(s, SPECS)
    warm = run_requests(s, SPECS)
    assert any(o.cached_tokens for o in warm) and not any(o.cached_tokens for o in cold)
    assert_same(warm, cold)


def test_captured_steps_attend_by_each_rows_own_length(pair, monkeypatch):
    """Captured steps call the own-length attention kernels (engine/decode_attention.py), and still give what eager
    decode gives; with them switched off the step goes back to masked SDPA over the bucket, with the same results."""
    from slime_lite.engine import decode_attention as da

    calls = []
    real = da.decode_attention
    monkeypatch.setattr(da, "decode_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    s = pair[True]
    s.decoder.reset()  # captured again below: a capture runs the step's Python once
    with_kernels = run_requests(s, SPECS)
    assert calls, "a captured step did not use decode_attention"
    assert_same(with_kernels, run_requests(pair[False], SPECS))
    monkeypatch.setattr(da, "ENABLED", False)
    calls.clear()
    s.decoder.reset()
    assert_same(run_requests(s, SPECS), with_kernels)
    assert not calls
    s.decoder.reset()
