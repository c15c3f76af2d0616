"""Padded fixed-shape decode steps (what the engine replays as CUDA graphs on a GPU), run eagerly on CPU: they must
give the same tokens and log-probs as the engine's dynamic decode, under continuous batching with holes in the slots.
The CUDA-graph capture itself needs a GPU: tests/engine/test_cuda_graph_gpu.py (marked gpu)."""

from __future__ import annotations

import threading

import pytest

from slime_lite.engine.cuda_graph import batch_buckets, length_buckets


def test_buckets_cover_every_size_and_end_at_the_maximum():
    bs = batch_buckets(100)
    assert bs[:4] == [1, 2, 4, 8] and bs[-1] == 100 and bs == sorted(set(bs))
    assert all(any(b >= n for b in bs) for n in range(1, 101))
    assert batch_buckets(1) == [1] and batch_buckets(256)[-3:] == [192, 224, 256]
    assert length_buckets(1000) == [64, 128, 256, 512, 1000]
    assert length_buckets(64) == [64] and length_buckets(10) == [10]


def run_requests(scheduler, specs: list[tuple[list[int], int, int]], **sampling) -> list:
    """Submit ``(prompt, max_new_tokens, seed)`` requests at once; return their outputs in order. A
    ``min_new_tokens`` over a request's max_new_tokens is lowered to it (SGLang refuses more)."""
    from slime_lite.engine.sampling import SamplingParams
    from slime_lite.engine.request import Request

    outs: dict[int, object] = {}
    done = threading.Semaphore(0)
    for i, (prompt, max_new, seed) in enumerate(specs):
        sp = {"max_new_tokens": max_new, "temperature": 1.0, **sampling}
        sp["min_new_tokens"] = min(sp.get("min_new_tokens", 0), max_new)
        params = SamplingParams.from_dict(sp)
        req = Request(rid=f"r{i}", input_ids=prompt, params=params, seed=seed,
                      on_output=lambda o, i=i: (outs.__setitem__(i, o), done.release()))
        scheduler.prepare(req)
        scheduler.submit(req)
    for _ in specs:
        assert done.acquire(timeout=120)
    return [outs[i] for i in range(len(specs))]


SPECS = [([1 + (i * 7) % 40 for _ in range(3 + i % 5)], [5, 90, 17, 40, 3, 70, 25][i % 7], 1000 + i)
         for i in range(14)]


@pytest.fixture(scope="module")
def schedulers(tiny_model_dir):
    from slime_lite.engine.scheduler import Scheduler

    made = {}
    for mode in (False, True, "compile"):
        s = Scheduler(str(tiny_model_dir), device="cpu", max_running_requests=6, kv_cache_tokens=6 * 160,
                      cuda_graph=bool(mode), enable_torch_compile=mode == "compile")
        s.start()
        made[mode] = s
    yield made
    for s in made.values():
        s.stop()


def test_padded_decode_matches_dynamic_decode_under_continuous_batching(schedulers):
    # 14 requests through 6 slots: varied prompt and output lengths, so slots free up out of order (holes) and
    # positions differ within a step; outputs long enough to cross a length bucket (64).
    specs = SPECS
    padded = schedulers[True]
    assert padded.decoder is not None and schedulers[False].decoder is None
    calls, chained = [], []
    real_run = padded.decoder.run
    padded.decoder.run = lambda slots, *a, **kw: (calls.append(list(slots)), chained.append(kw.get("chain")),
                                                   real_run(slots, *a, **kw))[2]
    try:
        got = run_requests(padded, specs)
    finally:
        del padded.decoder.run
    want = run_requests(schedulers[False], specs)
    assert any(s != list(range(len(s))) for s in calls), "no step ran with holes in the slots"
    assert sum(len(s) for s in calls) > 200
    # Most steps were launched before the previous step's tokens were read (chained on the device), and requests
    # finished between (stop tokens, lengths) and joined (holes refilled) all the same.
    assert sum(bool(c) for c in chained) > len(calls) / 2
    for g, w in zip(got, want):
        assert g.finish_reason == w.finish_reason
        assert g.output_ids == w.output_ids
        assert max(abs(a - b) for a, b in zip(g.output_logprobs, w.output_logprobs)) < 1e-4


def test_steps_have_a_row_per_running_request_and_idle_rows_write_only_the_scratch_slot(schedulers):
    """A padded step runs as many rows as the batch bucket of its running requests (not of their highest slot, which
    stays high in a rollout's tail): row i decodes the i-th running slot. Idle rows decode in the cache's scratch
    slot at position 0, so a step writes the K/V of its live rows' (slot, position) and nothing in free slots (the
    prefix cache keeps them); the outputs stay those of dynamic decode."""
    padded = schedulers[True]
    steps = []
    real_run, real_decode = padded.decoder.run, padded.lm.decode

    def decode(tokens, positions, slots, cache, *a, **kw):
        before = cache.kv.clone()
        out = real_decode(tokens, positions, slots, cache, *a, **kw)
        changed = (cache.kv != before).any(-1).any(2).nonzero()  # [layer, slot, position] entries written
        steps[-1].append((positions.tolist(), slots.tolist(), cache.scratch, {tuple(x) for x in changed.tolist()}))
        return out

    padded.decoder.run = lambda slots, *a, **kw: (steps.append([list(slots)]), real_run(slots, *a, **kw))[1]
    padded.lm.decode = decode
    try:
        got = run_requests(padded, SPECS)
    finally:
        del padded.decoder.run, padded.lm.decode
    assert_same(got, run_requests(schedulers[False], SPECS))
    compacted = idle = 0
    for running, (positions, slots, scratch, changed) in (step for step in steps if len(step) == 2):
        n = len(running)
        assert scratch > running[-1], (scratch, running)  # past every slot a request can hold in this cache
        assert slots[:n] == running and slots[n:] == [scratch] * (len(slots) - n), (running, slots)
        assert all(p == 0 for p in positions[n:]), positions
        allowed = {(s, p) for s, p in zip(slots, positions)}
        assert {(s, p) for _, s, p in changed} <= allowed, (running, positions, changed)
        compacted += running[-1] + 1 > len(slots)
        idle += len(slots) > n
    assert compacted and idle, "no step ran with fewer rows than its highest slot, or with idle rows"


def test_abort_and_calls_between_chained_steps_leave_the_other_requests_exact(schedulers):
    # An abort and a call() arrive while a chained step is in flight: the aborted request drops its extra token,
    # the call runs with no step in flight, and every other request's tokens are those of dynamic decode.
    padded = schedulers[True]
    calls = []
    real_run = padded.decoder.run

    def run(slots, *a, **kw):
        calls.append(kw.get("chain"))
        if len(calls) >= 20 and kw.get("chain") and "call" not in calls:  # a chained step: one more in flight
            padded.abort("r3")
            padded.call(lambda: calls.append("call")).result  # queued; runs between two steps
        return real_run(slots, *a, **kw)

    padded.decoder.run = run
    try:
        got = run_requests(padded, SPECS)
    finally:
        del padded.decoder.run
    want = run_requests(schedulers[False], SPECS)
    assert "call" in calls
    assert got[3].finish_reason["type"] == "abort" and len(got[3].output_ids) < len(want[3].output_ids)
    assert_same(got[:3] + got[4:], want[:3] + want[4:])


def test_a_step_run_twice_gives_the_same_tokens(schedulers):
    # On CUDA a new shape's step runs twice in a row (warm-up, then the capture's first replay): a chained step must
    # read its input tokens from a copy the step itself does not overwrite. Emulated here by running every step twice.
    padded = schedulers[True]
    real_step = padded.decoder._step
    padded.decoder._step = lambda bs, kv_len: (real_step(bs, kv_len), real_step(bs, kv_len))
    try:
        got = run_requests(padded, SPECS)
    finally:
        del padded.decoder._step
    assert_same(got, run_requests(schedulers[False], SPECS))


def assert_same(got, want, tol=1e-4):
    for g, w in zip(got, want):
        assert g.finish_reason == w.finish_reason
        assert g.output_ids == w.output_ids
        assert max(abs(a - b) for a, b in zip(g.output_logprobs, w.output_logprobs)) < tol


@pytest.mark.parametrize("sampling", [{"top_p": 0.9, "top_k": 20}, {"min_new_tokens": 30, "temperature": 0.8}],
                         ids=["truncated", "min_new_tokens"])
def test_padded_decode_with_the_general_sampler_matches_dynamic_decode(schedulers, sampling):
    # Truncation and banned tokens are not in the sampler captured with the step: the general one runs on its logits.
    assert_same(run_requests(schedulers[True], SPECS[:8], **sampling),
                run_requests(schedulers[False], SPECS[:8], **sampling))


def test_compiled_layers_match_dynamic_decode(schedulers):
    compiled = schedulers["compile"]
    assert compiled.lm.compiled and not schedulers[True].lm.compiled
    assert_same(run_requests(compiled, SPECS), run_requests(schedulers[False], SPECS))


def test_padded_decode_log_probs_equal_a_full_hf_forward(schedulers, hf_model):
    import torch

    prompt = [3, 9, 27, 4]
    (out,) = run_requests(schedulers[True], [(prompt, 80, 7)])
    ids = torch.tensor([prompt + out.output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    ref = logp.gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
    assert (torch.tensor(out.output_logprobs) - ref).abs().max() < 1e-5


def test_padded_decode_grows_the_cache_only_to_the_buckets_it_uses(tiny_model_dir):
    from slime_lite.engine.scheduler import Scheduler

    s = Scheduler(str(tiny_model_dir), device="cpu", max_running_requests=32, kv_cache_tokens=32 * 1024,
                  cuda_graph=True)
    s.start()
    try:
        keys = []
        real_reset = s.decoder.reset
        s.decoder.reset = lambda: (keys.append(s.cache.allocated), real_reset())[1]
        run_requests(s, [([1, 2, 3], 20, i) for i in range(3)])
        s.call(s.flush_cache).result(30)  # the prefix cache keeps it allocated until flushed
        assert s.cache.allocated == (0, 0)  # freed when idle and flushed: no graphs hold it on CPU
        assert keys and max(keys) <= (4, 128)  # 3 slots, 23 positions: bucket 4 x 64, allocated in 128s
        out = run_requests(s, [([1, 2, 3], 200, 9)], ignore_eos=True)[0]  # crosses length buckets: regrows
        assert len(out.output_ids) == 200 and max(k[1] for k in keys) == 256
        # the /get_server_info step_stats counters (perf/rollout/engine_*): more slots than allocated while the
        # decoder holds a layout is a reset (on CUDA every graph is captured again)
        resets = s.decoder.num_graph_resets
        run_requests(s, [([1, 2, 3], 4, i) for i in range(8)])
        assert s.decoder.num_graph_resets > resets and s.num_decode_steps >= 200 and s.busy_seconds > 0
        # Admission allocates a request's whole need (3 + 299 positions: 384); steps past bucket 256 read those 384
        # instead of growing the cache to bucket 512 (a growth drops every captured graph on CUDA).
        s.call(s.flush_cache).result(30)
        keys.clear()
        out = run_requests(s, [([1, 2, 3], 300, 9)], ignore_eos=True)[0]
        assert len(out.output_ids) == 300 and [k[1] for k in keys] == [384]
    finally:
        s.stop()


def _step_rows_on_cpu() -> None:
    """Run by ``test_the_step_rows_kernel_in_the_triton_interpreter`` with TRITON_INTERPRET=1."""
    import torch

    from slime_lite.engine import cuda_graph

    width, bs, vocab = 12, 5, 50
    gen = torch.Generator().manual_seed(0)
    inputs = torch.zeros(len(cuda_graph._IDLE_COLUMN), width, dtype=torch.float64)
    inputs[0] = torch.randint(0, vocab, (width,), generator=gen).double()  # tokens
    inputs[1] = torch.arange(width).double() * 3  # positions
    inputs[cuda_graph._SLOT - 1, :bs] = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0])  # chained rows
    inputs[cuda_graph._SLOT] = torch.arange(width).double() + 7
    prev = torch.randint(0, vocab, (width,), generator=gen).double()
    for hidden in (40, 1500):  # one block per row; two blocks, the last one partial
        weight = torch.randn(vocab, hidden + 3, generator=gen)[:, :hidden]  # rows with a stride of their own
        tokens, positions, slots, h = cuda_graph._step_rows(inputs, bs, prev, weight)
        want = torch.where(inputs[cuda_graph._SLOT - 1, :bs] > 0, prev[:bs], inputs[0, :bs]).long()
        assert torch.equal(tokens, want) and tokens.dtype == torch.int64
        assert torch.equal(positions, inputs[1, :bs].long())
        assert torch.equal(slots, inputs[cuda_graph._SLOT, :bs].long())
        assert torch.equal(h, weight[want][:, None]) and h.shape == (bs, 1, hidden)


def test_the_step_rows_kernel_in_the_triton_interpreter():
    """A captured step's first kernel (CUDA): each row's token (the previous draw where the row is chained), position
    and slot as int64, and the token's embedding, as the torch ops it replaces give them."""
    from tests.triton_interpreter import run_interpreted

    run_interpreted("tests.engine.test_padded_decode:_step_rows_on_cpu")
