"""Decode steps over padded, fixed-shape batches, replayed from CUDA graphs on CUDA (``--disable-cuda-graph``: off).

A decode step of the eager engine launches ~30 small kernels per layer from Python; on a GPU the host, not the GPU,
sets the pace. Here a step runs with fixed shapes so that, as SGLang's CUDA-graph runner does, one graph per shape
is captured on first use and replayed after, a few microseconds of host time per step.

A step over ``n`` running slots runs ``B`` rows, ``B`` the smallest batch bucket of at least ``n``: row ``i < n``
decodes the request in the ``i``-th running slot (the slot of each row is a step input, read on the device), so
the batch shrinks with the number of running requests however scattered their slots are (a rollout's tail). The
step reads the first ``L`` cache positions, ``L`` the smallest length bucket above the longest position, or the
cache's allocated length where that is shorter and holds every position (on CUDA
with Triton each row reads only its own prefix: ``decode_attention``). Idle rows decode token 0 at position 0 of
the cache's scratch slot, which no request holds: what free slots hold stays for the prefix cache. Every tensor a
step touches (the static inputs and output, the KV cache, the weights, the rotary table) keeps its address while
graphs live: weight updates copy into the parameters in place and need no new capture; on CUDA the cache and the
weights live in mapped buffers (``vmm``), so memory release and resume give their memory back and bring it again at
the same addresses, and the graphs are kept. When the cache or the weight storage is replaced (the cache grows to a
larger size, a cache flush, or a release without mapped buffers), the graphs are dropped and captured again on use
(a capture costs about one eager step). Admission allocates what its requests can reach (prompt plus
max_new_tokens), so a step whose length bucket passes that reads the allocated length instead of growing the cache
mid-rollout. While graphs live, the cache is kept when the engine goes idle instead of being freed, so it grows to
what the workload needs and no further.

Hugging Face's static cache does not fit here: it holds one position for the whole batch (continuous batching has a
position per request); and compiling the whole step per (batch, length) shape would cost tens of seconds per shape.
``torch.cuda.CUDAGraph`` over the engine's own step needs no compiler; ``--enable-torch-compile`` adds one compile,
with dynamic shapes, of the layer pieces around attention.

Its per-row inputs are the named fields of ``StepInputs``. The step samples its rows too (``sample_rows``, two
Triton kernels on CUDA) and copies the drawn tokens into a pinned host buffer without waiting.
``run(..., chain=True)`` launches a step whose input tokens are the previous step's draws, still on the device, so
the scheduler's ``DecodePipeline`` launches step n+1 before it reads step n's tokens and its Python bookkeeping
overlaps the GPU's work.

On CPU there is nothing to capture; ``cuda_graph=True`` there runs the same padded steps eagerly (tests use it).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import astuple, dataclass, fields
from typing import Any

import numpy as np
import torch

from slime_lite.engine.kv_cache import KVCache
from slime_lite.engine.model import CausalLM
from slime_lite.engine.sampling import sample_rows
from slime_lite.offload import clear_cublas_workspaces  # process-wide: every thread's, stream's and device's
from slime_lite.triton_build import triton_kernels

logger = logging.getLogger(__name__)

MIN_LEN_BUCKET = 64


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to 64, multiples of 32 up to 256, of 64 after; ``max_bs`` last."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, 257, 32)) + list(range(320, max_bs + 1, 64))
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


def length_buckets(max_len: int) -> list[int]:
    """Powers of two from ``MIN_LEN_BUCKET``, with ``max_len`` last."""
    sizes, n = [], MIN_LEN_BUCKET
    while n < max_len:
        sizes.append(n)
        n *= 2
    return sizes + [max_len]


def _ceil(buckets: list[int], n: int) -> int:
    return buckets[bisect.bisect_left(buckets, n)]


@dataclass
class StepInputs:
    """Per-row inputs of a padded step: lists in the order of the step's slots for ``PaddedDecoder.run``; inside the
    step, device rows (float64, one per field) of the buffer they travel in (one copy to the device per step).
    A new per-row input (a sampling parameter) is a field here with its idle-row value in ``IDLE``, set where the
    scheduler's pipeline builds the inputs and read by name in ``PaddedDecoder._step``."""

    token: Any  # the token decoded (a chained step decodes the previous step's draw instead)
    position: Any
    temperature: Any  # 1 for greedy rows
    uniform: Any  # ``sampling.uniforms`` of the row's seed and step (any value when the draws are not used)
    greedy: Any


IDLE = StepInputs(token=0, position=0, temperature=1.0, uniform=0.0, greedy=True)  # token 0 at position 0, greedy
_FIELDS = [f.name for f in fields(StepInputs)]
# The buffer's rows: the fields of ``StepInputs`` in order, then the ``chained`` flag (``run(chain=True)``) and the
# row's slot (the cache's scratch slot for idle rows, set by ``run``).
_IDLE_COLUMN = np.array([float(v) for v in astuple(IDLE)] + [0.0, 0.0])[:, None]
_SLOT = len(_IDLE_COLUMN) - 1
# On CUDA with Triton a step's first kernel reads its rows of the buffer (the token, or the chained draw), converts
# them to integers and gathers the token embeddings; the sampler writes the draws straight into the output buffer.
# Off (benchmarks compare): torch's conversions, gather and copies, about ten small kernels more per step.
FUSED_EDGES = True


@triton_kernels
def _rows_kernel(triton, tl):
    @triton.jit
    def step_rows(inputs, width, prev, weight, weight_row, hidden, tokens, positions, slots, n, TOKEN: tl.constexpr,
                  POSITION: tl.constexpr, CHAINED: tl.constexpr, SLOT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        part = tl.program_id(1)
        chained = tl.load(inputs + CHAINED * width + row)
        token = tl.where(chained > 0, tl.load(prev + row), tl.load(inputs + TOKEN * width + row)).to(tl.int64)
        if part == 0:
            tl.store(tokens + row, token)
            tl.store(positions + row, tl.load(inputs + POSITION * width + row).to(tl.int64))
            tl.store(slots + row, tl.load(inputs + SLOT * width + row).to(tl.int64))
        cols = part * BLOCK + tl.arange(0, BLOCK)
        live = cols < n
        tl.store(hidden + row.to(tl.int64) * n + cols, tl.load(weight + token * weight_row + cols, mask=live),
                 mask=live)

    return step_rows


def _step_rows(inputs: torch.Tensor, bs: int, prev: torch.Tensor, weight: torch.Tensor):
    """The first ``bs`` rows' tokens (the chained ones: ``prev``), positions and slots as int64, and their
    embeddings ``[bs, 1, hidden]``, in one kernel."""
    dev, n = inputs.device, weight.shape[1]
    tokens, positions, slots = torch.empty(3, bs, dtype=torch.int64, device=dev)
    hidden = torch.empty(bs, 1, n, dtype=weight.dtype, device=dev)
    block = min(1024, 1 << (n - 1).bit_length())
    with torch.cuda.device(dev if inputs.is_cuda else -1):  # -1: the Triton interpreter (tests)
        _rows_kernel()[(bs, -(-n // block))](
            inputs, inputs.stride(0), prev, weight, weight.stride(0), hidden, tokens, positions, slots, n,
            TOKEN=_FIELDS.index("token"), POSITION=_FIELDS.index("position"), CHAINED=_SLOT - 1, SLOT=_SLOT,
            BLOCK=block)
    return tokens, positions, slots, hidden


@dataclass
class Ticket:
    """A launched step's results: a host buffer the device copies them into, the event after that copy (CUDA),
    and the slots of its rows (rows ``0..len(slots)-1``)."""

    host: torch.Tensor
    done: "torch.cuda.Event | None"
    slots: list[int]


class PaddedDecoder:
    """Fixed-shape decode steps for up to ``max_bs`` running slots, with the common sampler inside the step."""

    def __init__(self, lm: CausalLM, cache: KVCache, max_bs: int, capture: bool) -> None:
        self.lm, self.cache, self.capture = lm, cache, capture
        self.max_bs = max_bs
        self.bs_buckets = batch_buckets(max_bs)
        self.len_buckets = length_buckets(cache.max_len)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._storage: tuple | None = None
        self._inputs = self._out = self._sampled = None
        self._rows, self._flip, self._done = 0, 0, [None, None]
        self._pool = None
        self.capture_seconds = 0.0  # all captures so far (warm-up included), and how many: /get_server_info
        self.num_captures = 0
        self.num_graph_resets = 0  # graphs dropped by ``run`` (on CUDA all are captured again); not a release

    def compile(self) -> None:
        """``torch.compile`` the layer pieces of captured steps (fuses their norm, rotary and activation kernels),
        with dynamic shapes; compiling happens at the first step's warm-up, outside the capture. The sampler is not
        compiled: inductor's code for its reductions over the vocabulary took 2.4 ms at batch 256 on an H200,
        against 0.8 ms eager (bench/bench_sampler.py); on CUDA a Triton kernel does that pass (``block_stats``)."""
        self.lm.enable_compile()

    def reset(self) -> None:
        """Drop the graphs and the device buffers they use (before the cache or the weights' storage is freed)."""
        self.graphs.clear()
        self._inputs = self._out = self._sampled = self._prev = None
        self._pool = None
        self._storage = None

    def _storage_key(self) -> tuple:
        # Shapes too: a new allocation can reuse a freed block's address with another layout.
        return (tuple(self.cache.kv.shape), self.cache.kv.data_ptr(), self.lm.storage_version)

    def _step(self, bs: int, kv_len: int) -> None:
        *rows, chained, slot = self._inputs[:, :bs]
        x = StepInputs(*rows)
        # Chained rows take the token the last step drew, still on the device (``run`` copies it to ``_prev``
        # outside the graph: the step stays the same when run twice, as warm-up and capture do).
        edges = FUSED_EDGES and self._inputs.is_cuda and _rows_kernel() is not None
        if edges:
            tokens, positions, slots, hidden = _step_rows(self._inputs, bs, self._prev, self.lm.embed.weight)
        else:
            tokens = torch.where(chained > 0, self._prev[:bs], x.token).long()
            positions, slots, hidden = x.position.long(), slot.long(), None
        hidden = self.lm.decode(tokens, positions, slots, self.cache, kv_len, graphed=True, embedded=hidden)
        self.lm.logits(hidden, out=self._out[:bs])
        if edges or not self._inputs.is_cuda:
            sample_rows(self._out[:bs], x.temperature, x.uniform, x.greedy, out=self._sampled)
        else:
            for row, value in zip(self._sampled, sample_rows(self._out[:bs], x.temperature, x.uniform, x.greedy > 0)):
                row[:bs].copy_(value)

    def _buffers(self, dev: torch.device) -> None:
        self._inputs = torch.zeros(len(_IDLE_COLUMN), self.max_bs, dtype=torch.float64, device=dev)
        self._out = torch.empty(self.max_bs, self.lm.vocab_size, dtype=self.lm.dtype, device=dev)
        self._sampled = torch.zeros(2, self.max_bs, dtype=torch.float64, device=dev)
        self._prev = torch.zeros(self.max_bs, dtype=torch.float64, device=dev)
        # Two host buffers each way (pinned on CUDA): a step is staged while the one before is still running.
        pin = dev.type == "cuda"
        self._host_in = [torch.zeros(self._inputs.shape, dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        self._host_out = [torch.zeros(self._sampled.shape, dtype=torch.float64, pin_memory=pin) for _ in range(2)]

    def run(self, slots: list[int], inputs: StepInputs, chain: bool = False) -> Ticket:
        """Launch one decode step for the running slots (``slots`` sorted, at most ``max_bs`` of them; ``inputs`` one
        value per slot) and its sampling as ``sample_rows`` does: one host-to-device copy in, one device-to-host copy
        out, and no wait for this step (only for the step two runs back, whose host buffers this one reuses; a new
        capture syncs). ``chain``: the step decodes the tokens the previous ``run`` drew for the same ``slots``
        (``inputs.token`` is ignored), so it can be launched before that step's results are read. Read the results
        with ``sampled(ticket)``, or the logits (general sampler) with ``logits()`` before the next ``run``."""
        n = len(slots)
        bs = _ceil(self.bs_buckets, n)
        top = max(inputs.position) + 1
        kv_len = _ceil(self.len_buckets, top)
        have = self.cache.allocated[1]
        if top <= have < kv_len:  # admission allocated the requests' whole need: read that, do not grow to the bucket
            kv_len = have
        dev = self.lm.device
        if chain and self._sampled is None:
            raise RuntimeError("chain=True needs a previous run")
        drawn = self._sampled[0].clone() if chain else None  # kept across a reset of the buffers below
        self.cache.ensure(slots[-1] + 1, kv_len)  # grows only to what steps use; a new allocation: new captures
        key = self._storage_key()
        if key != self._storage:
            self.num_graph_resets += self._storage is not None  # a KV-cache growth or new weight storage mid-serving
            self.reset()
            self._storage = key
        if self._inputs is None:
            self._buffers(dev)
        self._flip ^= 1
        if self._done[self._flip] is not None:
            self._done[self._flip].synchronize()  # the step that last used these host buffers has copied them
        host = self._host_in[self._flip].numpy()
        host[:, n:bs] = _IDLE_COLUMN
        host[_SLOT, n:bs] = self.cache.scratch
        host[:, :n] = [getattr(inputs, name) for name in _FIELDS] + [[float(chain)] * n, slots]
        # Whole buffers both ways: a copy of a non-contiguous slice is staged through a temporary, which is not safe
        # while the copy is in flight.
        self._inputs.copy_(self._host_in[self._flip], non_blocking=True)
        if chain:
            self._prev.copy_(drawn)
        if not self.capture:
            self._step(bs, kv_len)
        else:
            graph = self.graphs.get((bs, kv_len))
            if graph is None:
                graph = self._capture(bs, kv_len)  # warm-up and capture also compute this step
            graph.replay()
        out = self._host_out[self._flip]
        out.copy_(self._sampled, non_blocking=True)
        done = None
        if dev.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self._done[self._flip] = done
        self._rows = n
        return Ticket(out, done, slots)

    def sampled(self, ticket: Ticket) -> tuple[list[int], list[float]]:
        """Tokens and log-probs a ``run`` drew for its slots, in order (waits for that step only)."""
        if ticket.done is not None:
            ticket.done.synchronize()
        tokens, logprobs = ticket.host.numpy()[:, : len(ticket.slots)].tolist()
        return [int(t) for t in tokens], logprobs

    def logits(self) -> torch.Tensor:
        """Float32 logits of the last ``run``'s slots."""
        return self._out[: self._rows].float()

    def _capture(self, bs: int, kv_len: int) -> torch.cuda.CUDAGraph:
        start = time.perf_counter()
        dev = self.lm.device
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # warm-up (lazy library init) off the capture; writes what replay writes
            self._step(bs, kv_len)
        torch.cuda.current_stream(dev).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # cuBLAS keeps a workspace per (handle, stream), made at the warm-up above, outside the graph's pool; a graph
        # captured with it breaks when anything in the process clears those workspaces (torch.compile's CUDA graphs
        # do, at every recording: on an H200 the engine then died with an illegal memory access). Cleared here, the
        # capture makes its own workspace in the graph's pool; cleared after, no eager call is handed that memory.
        clear_cublas_workspaces()
        # Our own capture stream, on the engine's device (torch's default one is per process, on the first device).
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            self._step(bs, kv_len)
        clear_cublas_workspaces()
        self.graphs[(bs, kv_len)] = graph
        took = time.perf_counter() - start
        self.capture_seconds += took
        self.num_captures += 1
        logger.info("captured a decode CUDA graph for batch %d x %d positions in %.0f ms (%d graphs)", bs, kv_len,
                    took * 1000, len(self.graphs))
        return graph
