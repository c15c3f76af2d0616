"""Process groups for one Megatron-core job: torch.distributed (gloo on CPU, NCCL on CUDA) + Megatron's TP/PP/DP groups.

Every train worker calls `init_distributed(...)` once before building its model and `destroy()` when done.
Data parallelism is what is left: dp = world_size // (tp * pp).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from slime_lite.errors import SlimeLiteError

logger = logging.getLogger(__name__)


def init_distributed(
    tp: int,
    pp: int,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    seed: int = 1234,
    timeout_s: float = 1800.0,
    store: Any = None,
    ep: int = 1,
    etp: int | None = None,
) -> None:
    """Join the job's process group, create Megatron's model-parallel groups and seed every RNG Megatron uses.

    ``store``: a rendezvous ``TCPStore`` to join through (see ``open_store``) instead of ``master_addr:master_port``.
    ``ep`` / ``etp``: the expert-parallel and expert-tensor-parallel sizes of an MoE model (etp defaults to tp).
    """

    from slime_lite.backends.megatron import cpu_compat  # patches Megatron: applied when the groups are made

    if tp < 1 or pp < 1 or world_size % (tp * pp) != 0:
        raise SlimeLiteError(
            f"--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size ({pp}) must divide the number "
            f"of training GPUs ({world_size}); pick sizes whose product divides it."
        )
    cuda = torch.cuda.is_available()
    cpu_compat.apply()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        where = {"store": store} if store is not None else {"init_method": f"tcp://{master_addr}:{master_port}"}
        dist.init_process_group(backend=backend or ("nccl" if cuda else "gloo"), rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **where)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    # Same seed on every rank: the CPU generator drives weight init (use_cpu_initialization) and must agree across TP.
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    logger.info(
        "rank %d/%d: tp=%d pp=%d dp=%d (tp_rank=%d pp_rank=%d dp_rank=%d) backend=%s",
        rank, world_size, tp, pp, world_size // (tp * pp),
        parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(), dist.get_backend(),
    )


def open_store(master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float = 1800.0) -> Any:
    """The job's rendezvous store. Rank 0 serves it; ``master_port`` 0 lets the OS pick a free port as it binds
    (read it back from ``.port``), so no other process can take the port between choosing and binding it."""

    return dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def destroy() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
