"""Run megatron-core 0.16.1 on a machine without CUDA (CPU tensors, gloo process groups).

`apply()` is where slime_lite patches Megatron for CPU (the one other patch, on every device, is attention.py's
`install_packed_rope`: RoPE of packed rows). It does nothing when CUDA is available and is idempotent.
What it changes, and only inside Megatron:

1. The modules listed in `_MODULES_ON_CPU` see a stand-in for their global name `torch`: identical to torch except
   that `torch.cuda.current_device()` is "cpu", CUDA streams/events are no-ops, and tensor factories given
   `device="cuda"` build on the CPU. No other module (transformers, the engine, user code) is affected.
2. Four Megatron functions call CUDA-only Tensor methods (`.cuda()`, `.type() == "torch.cuda.FloatTensor"`); they run
   with those methods answering as if the CPU tensor were on CUDA, for the duration of the call only.
3. The MoE dispatchers' all-to-all gets its split sizes as lists of ints (on CPU they stay tensors or arrays, which
   gloo's all_to_all_single does not take).
4. Megatron's RNG tracker is created in its inference flavour (fork() is a no-op), because the training flavour saves
   and restores CUDA generator states; activation recompute's save/restore of the CUDA generator state does nothing.
   Seed the CPU generator with `torch.manual_seed` (parallel.py does).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from typing import Any, Callable

import torch
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.optimizer import optimizer as mcore_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer.moe import token_dispatcher

logger = logging.getLogger(__name__)

_applied = False
_answering_as_cuda = False

# Each module, and why its `torch` is swapped (one line each).
_MODULES_ON_CPU = {
    "megatron.core.utils": "GlobalMemoryBuffer (attention scores) allocates on torch.cuda.current_device()",
    "megatron.core.transformer.utils": 'the default causal mask is built with device="cuda"',
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "inv_freq is moved to torch.cuda.current_device()",
    "megatron.core.tensor_parallel.layers": "TP all-gather buffers and GPU-side init use torch.cuda.current_device()",
    "megatron.core.tensor_parallel.mappings": "TP gather/scatter buffers are allocated on torch.cuda.current_device()",
    "megatron.core.tensor_parallel.utils": "1-D split/gather buffers are allocated on torch.cuda.current_device()",
    "megatron.core.pipeline_parallel.schedules": 'total_num_tokens is created with device="cuda" in every schedule',
    "megatron.core.pipeline_parallel.p2p_communication": "PP shape/receive buffers use torch.cuda.current_device()",
    "megatron.core.distributed.param_and_grad_buffer": "grad buffers are allocated on torch.cuda.current_device()",
    "megatron.core.distributed.distributed_data_parallel": "DDP creates a CUDA communication stream",
    "megatron.core.optimizer.optimizer": 'found_inf / scale tensors are created with device="cuda"',
    "megatron.core.optimizer.clip_grads": 'grad-norm accumulators are created with device="cuda"',
    "megatron.core.optimizer.distrib_optimizer": "distributed optimizer buffers use torch.cuda.current_device()",
    "megatron.core.transformer.moe.token_dispatcher": "the MoE dispatchers create CUDA streams and events",
    "megatron.core.transformer.moe.router": "the router's expert bias / load counters live on the current device",
    "megatron.core.transformer.moe.moe_utils": "routing maps and aux-loss tensors are created on the current device",
}


class _Noop:
    """CPU stand-in for a CUDA stream or event: every method call does nothing and returns another stand-in (the
    MoE dispatcher synchronizes on the event its stream's ``record_event()`` returns)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., "_Noop"]:
        return lambda *args, **kwargs: _Noop()


class _CudaOnCpu:
    """`torch.cuda` as the patched Megatron modules see it on a CPU machine."""

    Stream = _Noop
    Event = _Noop

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def current_stream(device: Any = None) -> _Noop:
        return _Noop()

    default_stream = current_stream

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"


def _factory_on_cpu(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "empty_like", "zeros_like", "ones_like")


class _TorchOnCpu:
    """`torch` as the patched Megatron modules see it: CUDA device requests land on the CPU."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


for _name in _FACTORIES:
    setattr(_TorchOnCpu, _name, staticmethod(_factory_on_cpu(getattr(torch, _name))))

_TORCH_ON_CPU = _TorchOnCpu()


@contextlib.contextmanager
def _tensors_answer_as_cuda():
    """While active, CPU tensors report CUDA type names and `.cuda()` leaves them where they are (reentrant)."""
    global _answering_as_cuda
    if _answering_as_cuda:
        yield
        return
    orig_type, orig_cuda = torch.Tensor.type, torch.Tensor.cuda

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = orig_type(self, *args, **kwargs)
        if not args and not kwargs and self.device.type == "cpu":
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    torch.Tensor.type, torch.Tensor.cuda = type_, cuda
    _answering_as_cuda = True
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = orig_type, orig_cuda
        _answering_as_cuda = False


def _run_as_cuda(owner: Any, attr: str) -> None:
    """Wrap owner.attr (class or module attribute) to run inside `_tensors_answer_as_cuda()`; keeps classmethods."""
    raw = owner.__dict__[attr]
    is_classmethod = isinstance(raw, classmethod)
    fn = raw.__func__ if is_classmethod else raw

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _tensors_answer_as_cuda():
            return fn(*args, **kwargs)

    setattr(owner, attr, classmethod(wrapper) if is_classmethod else wrapper)


def _split_sizes_as_ints(all_to_all: Callable) -> Callable:
    @functools.wraps(all_to_all)
    def wrapper(group: Any, input_: torch.Tensor, output_split_sizes: Any = None, input_split_sizes: Any = None):
        def ints(sizes: Any) -> Any:
            return None if sizes is None else [int(n) for n in (sizes.tolist() if hasattr(sizes, "tolist") else sizes)]

        return all_to_all(group, input_, ints(output_split_sizes), ints(input_split_sizes))

    return wrapper


def apply() -> bool:
    """Make megatron-core usable without CUDA. Returns True when the CPU patches are (now) in place."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    for module_name in _MODULES_ON_CPU:
        importlib.import_module(module_name).torch = _TORCH_ON_CPU


    # Tied embeddings with PP > 1: the last stage's copy is moved with `.data.cuda()` before its all-reduce.
    _run_as_cuda(LanguageModule, "setup_embeddings_and_output_layer")
    # Mixed-precision optimizer sorts params by `param.type() in ["torch.cuda.HalfTensor", ...]`.
    _run_as_cuda(Float16OptimizerWithFloat16Params, "__init__")
    # Distributed optimizer sorts params the same way (fp32 params must say "torch.cuda.FloatTensor").
    _run_as_cuda(DistributedOptimizer, "_build_model_and_main_param_groups")
    # Grad clipping asserts `param.grad.type() == "torch.cuda.FloatTensor"` (patched where the optimizer calls it).
    _run_as_cuda(mcore_optimizer, "clip_grad_by_total_norm_fp32")
    token_dispatcher.all_to_all = _split_sizes_as_ints(token_dispatcher.all_to_all)
    # The training RNG tracker snapshots CUDA generator states; the inference tracker's fork() is a no-op.
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # Activation recompute (CheckpointFunction) saves and restores the CUDA generator next to the CPU one: none here.
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: None
    mcore_random._set_cuda_rng_state = lambda *args, **kwargs: None

    _applied = True
    logger.info("megatron-core CPU compatibility applied (%d modules redirected)", len(_MODULES_ON_CPU))
    return True
