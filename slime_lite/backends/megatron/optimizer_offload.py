"""--optimizer-cpu-offload: Megatron's hybrid CPU optimizer (``HybridDeviceOptimizer``, CUDA only).

With the flag, the trainer runs Megatron's distributed optimizer with the precision-aware path
(--use-precision-aware-optimizer, which Megatron requires with the offload): the GPU keeps the bf16 weights and
gradient buffers, while the float32 master weights and the Adam moments live in pinned host memory (the share
``--optimizer-offload-fraction``, default all) and each optimizer step runs on the CPU; with
--overlap-cpu-optimizer-d2h-h2d the gradient and weight copies overlap the CPU step.

The distributed optimizer's ``state_dict`` leaves the per-parameter state (master weights, moments) out, so a
checkpoint also stores ``param_state`` (Megatron's DP-rank-0 gather of it) and a resume scatters it back.
With ``--offload-train`` the weights are views of DDP's parameter buffer, which train_offload.py empties and refills
in place; the state already on the host stays there.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig


def optimizer_config(args: Any, **fields: Any) -> OptimizerConfig:
    """Megatron's OptimizerConfig of ``fields``, with the offload fields of the flags when --optimizer-cpu-offload
    is on (``use_distributed_optimizer`` included: the hybrid optimizer runs under the distributed one)."""
    if not args.optimizer_cpu_offload:
        return OptimizerConfig(**fields, use_distributed_optimizer=False)
    fields.update(use_distributed_optimizer=True, optimizer_cpu_offload=True,
                  optimizer_offload_fraction=args.optimizer_offload_fraction,
                  overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d)
    if importlib.util.find_spec("transformer_engine") is not None:
        return OptimizerConfig(**fields, use_precision_aware_optimizer=True)
    # megatron-core 0.16.1's check of the precision-aware flag compares Transformer Engine's version even when TE is
    # absent (a TypeError); with the CPU offload it needs nothing of TE. Set what the check would set without TE.
    config = OptimizerConfig(**fields)
    config.use_precision_aware_optimizer = True
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    config.store_param_remainders = False
    return config


def _distributed(optimizer: Any) -> list[Any]:
    return [o for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]
            if hasattr(o, "get_parameter_state_dp_zero")]


def param_state(optimizer: Any) -> list[Any] | None:
    """The per-parameter state of each distributed optimizer in the chain (on DP rank 0; None elsewhere), or None
    without --optimizer-cpu-offload. Every rank must call it (a gather)."""
    opts = _distributed(optimizer)
    if not opts:
        return None
    return [o.get_parameter_state_dp_zero() for o in opts]  # keyed by dtypes: a weights-only load reads them


def plain_groups(state: Any) -> Any:
    """An optimizer ``state_dict`` without the classes Megatron's hybrid CPU optimizer keeps in each param group
    (``cpu_optimizer_cls``), which a weights-only load cannot read. Dropping them is safe: the optimizer of the resumed
    run was built with its own (the hybrid optimizer reads the class from its ``defaults``, and the distributed
    optimizer's load keeps only the saved groups' other settings)."""
    if isinstance(state, dict):
        return {k: ([{gk: gv for gk, gv in g.items() if not isinstance(gv, type)} for g in v]
                    if k == "param_groups" else plain_groups(v)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):  # a chained optimizer's list of state dicts
        items = [plain_groups(v) for v in state]
        return items if isinstance(state, list) else tuple(items)
    return state


def check_param_state(optimizer: Any, saved: list[Any] | None, where: str) -> None:
    """SlimeLiteError when a checkpoint's ``param_state`` does not fit this run's optimizer (saved with
    --optimizer-cpu-offload and resumed without it, or the other way round)."""
    from slime_lite.errors import SlimeLiteError

    opts = _distributed(optimizer)
    if (saved is None) != (not opts) or (opts and len(saved) != len(opts)):
        raise SlimeLiteError(f"{where} was saved {'without' if saved is None else 'with'} --optimizer-cpu-offload "
                             f"and this run is {'with' if opts else 'without'} it: resume with the optimizer flags "
                             "it was saved with.")


def load_param_state(optimizer: Any, saved: list[Any] | None) -> None:
    """Scatter ``param_state``'s result back, after the optimizer's own ``load_state_dict`` (every rank calls it)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    with torch.no_grad():  # it copies into shards that are views of the weights (float32: the main params)
        for o, state in zip(_distributed(optimizer), saved or []):
            o.load_parameter_state_from_dp_zero(state)
            if isinstance(o.optimizer, HybridDeviceOptimizer):
                own_steps(o.optimizer)
                # megatron-core 0.16.1's dp-zero load replaces the hybrid optimizer's state tensors (master weights,
                # moments) without handing them to its CPU/GPU sub-optimizers, which would step on from the values
                # they had before the load (its other loaders sync; this one does not): hand them over here.
                o.optimizer._sync_hdo_state_to_sub_optimizers()
                # The distributed optimizer's load_state_dict first runs the hybrid optimizer's dummy_step (random
                # gradients, to create its state), whose copy-back hook writes into the model's weights loaded just
                # before; put the loaded master weights back in them (what the step's own copy-back does).
                for param, inner in o.optimizer.param_to_inner_param.items():
                    param.data.copy_(inner.data)


def own_steps(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter's Adam ``step`` its own tensor. megatron-core 0.16.1's distributed optimizer, without
    Apex or Transformer Engine, loads one ``step`` tensor into every parameter's state; torch's AdamW then adds 1 to
    it once per parameter at each step, and the bias corrections after a resume are those of a step count many times
    too large."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
