"""LoRA adapters on the Megatron model's column- and row-parallel linears (lora_config.py says which linears).

``apply(model, settings, seed)`` freezes every weight of the model and gives each targeted linear a child module
``lora`` with A [rank, in] and B [out, rank]; the linear's output gains ``scaling * B (A x)``:

- column-parallel (linear_qkv, linear_fc1): A replicated on every TP rank, B split over TP like the weight's rows.
  ``A x`` goes through Megatron's copy-to-TP region, so its gradient (and A's) sums every rank's part.
- row-parallel (linear_proj, linear_fc2): A split over TP like the weight's input columns, B replicated. The
  partial ``A x`` of each rank is summed over TP (Megatron's reduce-from-TP region) before B.

A starts as PEFT's (Kaiming-uniform) from a generator seeded by the run's seed and the layer's global id, the same
for every TP/PP layout; B starts at zero, so before the first step the model is exactly the base model. The
reference model is the same model with the adapters switched off (``disabled``): no second copy of the weights.
``hf_adapters`` gathers the adapters under HF names (PEFT's per-projection layout); ``load_hf_adapters`` is its
inverse. With adapters, checkpoints hold only the adapters' model state (``is_adapter``).
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)

from slime_lite.backends.megatron.convert import _hf_names, _merge, _split
from slime_lite.backends.megatron.lora_config import ADAPTER_MARK, LINEARS, LoraSettings
from slime_lite.backends.megatron.model import hf_arch, unwrap
from slime_lite.errors import SlimeLiteError


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_adapter(name: str) -> bool:
    return ADAPTER_MARK in name


class LoraAdapter(torch.nn.Module):
    """The adapter of one parallel linear: ``delta(x)`` is what it adds to the linear's output."""

    def __init__(self, kind: str, in_full: int, in_local: int, out_local: int, settings: LoraSettings,
                 a_full: torch.Tensor, tp_rank: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.kind, self.scaling, self.enabled = kind, settings.scaling, True
        a = a_full if kind == "column" else a_full.chunk(in_full // in_local, dim=1)[tp_rank]
        self.A = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.B = torch.nn.Parameter(torch.zeros(out_local, settings.rank, dtype=dtype, device=device))
        # the split one is TP-parallel: Megatron's grad-norm counts the replicated one once
        set_tensor_model_parallel_attributes(self.B if kind == "column" else self.A, True,
                                             0 if kind == "column" else 1, 1)
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout else torch.nn.Identity()

    def added_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out + scaling * B (A x)``, the sum and the scaling inside B's GEMM (one pass over the [tokens, out]
        output, where a separate scale and add would make two more)."""
        h = torch.nn.functional.linear(self.dropout(x), self.A)
        h = copy_to_tensor_model_parallel_region(h) if self.kind == "column" else \
            reduce_from_tensor_model_parallel_region(h)
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]).to(out.dtype),
                           self.B.t().to(out.dtype), alpha=self.scaling)
        return flat.view(out.shape)


def _foldable(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the plain strides of its shape: a view where it can be, else a copy (as are its gradients).

    A frozen Megatron linear runs ``torch.matmul(x, W.t())`` forward and ``grad.matmul(W)`` backward. torch folds a
    [s, b, n] operand into one [s*b, n] GEMM only when its strides allow it (or when W requires grad); otherwise it
    runs a batched matmul of s [b, n] x [n, m] products that reads W once per token. The logits' gradient reaches
    the output layer transposed ([s, 1, V] with strides (V, s*V, 1), from GPTModel's [b, s] transpose), so without
    this the frozen output layer's backward read its 151,936-row weight once per token: LoRA steps 4.6x slower than
    full fine-tuning on an H200 at the 1.5B shape."""
    return t.reshape(-1, t.shape[-1]).view(t.shape) if t.dim() > 2 else t


def _foldable_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of a frozen linear: its input as one GEMM operand (``_foldable``)."""
    if args:
        return (_foldable(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "input_": _foldable(kwargs["input_"])}


def _after_frozen_linear(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook of a frozen linear (Megatron's return (output, bias)): the output's gradient as one GEMM operand
    (``_foldable``), plus the adapter's delta where the linear has an enabled one."""
    out, bias = output
    out = _foldable(out)
    adapter = getattr(module, "lora", None)
    if adapter is not None and adapter.enabled:
        out = adapter.added_to(out, args[0] if args else kwargs["input_"])
    return out, bias


def _init_a(rank: int, in_full: int, seed: int, layer: int, linear: str) -> torch.Tensor:
    """PEFT's A init (Kaiming-uniform, a=sqrt(5): bound 1/sqrt(in)) of the full A, from a generator of its own."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 101 + zlib.crc32(linear.encode()) % 97)
    bound = 1.0 / math.sqrt(in_full)
    return torch.empty(rank, in_full).uniform_(-bound, bound, generator=gen)


def adapted_linears(model: torch.nn.Module) -> Iterator[tuple[int, str, torch.nn.Module]]:
    """(global layer id, Megatron linear suffix, linear) of each adapted linear of this rank's stage."""
    gpt = unwrap(model)
    for layer in getattr(getattr(gpt, "decoder", None), "layers", []):
        for linear in LINEARS:
            mod = layer.get_submodule(linear)
            if hasattr(mod, "lora"):
                yield layer.layer_number - 1, linear, mod


def apply(model: torch.nn.Module, settings: LoraSettings, seed: int) -> None:
    """Freeze the model and add the adapters of ``settings`` (before DDP wraps the model)."""
    gpt = unwrap(model)
    for p in gpt.parameters():
        p.requires_grad_(False)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for layer in getattr(getattr(gpt, "decoder", None), "layers", []):
        for linear in settings.linears:
            mod = layer.get_submodule(linear)
            kind = LINEARS[linear][0]
            in_local = mod.input_size if kind == "column" else mod.input_size_per_partition
            out_local = mod.output_size_per_partition if kind == "column" else mod.output_size
            a_full = _init_a(settings.rank, mod.input_size, seed, layer.layer_number - 1, linear)
            mod.add_module("lora", LoraAdapter(kind, mod.input_size, in_local, out_local, settings, a_full, tp_rank,
                                               mod.weight.dtype, mod.weight.device))
    for mod in gpt.modules():  # every frozen linear, the output layer's too (``_foldable``)
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            mod.register_forward_pre_hook(_foldable_input, with_kwargs=True)
            mod.register_forward_hook(_after_frozen_linear, with_kwargs=True)


@contextlib.contextmanager
def disabled(model: torch.nn.Module):
    """The base model: every adapter switched off inside the block (the reference model's forward)."""
    mods = [m for _, _, m in adapted_linears(model)]
    for m in mods:
        m.lora.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.lora.enabled = True


def hf_adapters(model: torch.nn.Module, hf_config: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF weight name: (A [rank, in], B [out, rank])} of this rank's PP stage, TP gathered (collective over the TP
    group; every TP rank gets them). B is unscaled; a fused linear's parts share its A."""
    arch = hf_arch(hf_config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()

    def gathered(t: torch.Tensor) -> list[torch.Tensor]:
        if tp == 1:
            return [t.detach()]
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=group)
        return parts

    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer, linear, mod in adapted_linears(model):
        weight_kind, names = _hf_names(f"decoder.layers.{layer}.{linear}.weight", arch, 0)
        if mod.lora.kind == "column":
            a, bs = mod.lora.A.detach(), _merge(weight_kind, gathered(mod.lora.B), arch)
            out.update((n, (a, b)) for n, b in zip(names, bs))
        else:
            (a,) = _merge("row", gathered(mod.lora.A), arch)
            out[names[0]] = (a, mod.lora.B.detach())
    return out


def load_hf_adapters(model: torch.nn.Module, hf_config: Any, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
                     where: str) -> None:
    """Fill this rank's adapters from {HF weight name: (A, B unscaled)} (``hf_adapters``' layout); SlimeLiteError
    naming ``where`` for a missing or misshaped adapter, fused parts whose A differ, or an adapter of a module this
    run does not adapt (PEFT would apply it)."""
    arch = hf_arch(hf_config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    used: set[str] = set()
    with torch.no_grad():
        for layer, linear, mod in adapted_linears(model):
            weight_kind, names = _hf_names(f"decoder.layers.{layer}.{linear}.weight", arch, 0)
            used.update(names)
            missing = [n for n in names if n not in adapters]
            if missing:
                raise SlimeLiteError(f"{where} has no adapter for {missing[0]}; it was trained with other "
                                     "target modules: give the same --lora-target-modules.")
            a_parts = [adapters[n][0] for n in names]
            if any(not torch.equal(a_parts[0], x) for x in a_parts[1:]):
                raise SlimeLiteError(f"{where}: {', '.join(names)} have different lora_A, but Megatron's fused "
                                     f"{linear.rpartition('.')[2]} has one A for all of them; only adapters whose "
                                     "fused parts share A (as slime-lite exports them) can be loaded.")
            if mod.lora.kind == "column":
                a, b = a_parts[0], _split(weight_kind, [adapters[n][1] for n in names], arch, tp_rank, tp)
            else:
                a, b = _split("row", [a_parts[0]], arch, tp_rank, tp), adapters[names[0]][1]
            for what, param, value in (("lora_A", mod.lora.A, a), ("lora_B", mod.lora.B, b)):
                if tuple(param.shape) != tuple(value.shape):
                    raise SlimeLiteError(f"{where}: {names[0]} {what} has shape {tuple(value.shape)} where this "
                                         f"run's adapter has {tuple(param.shape)} (--lora-rank and the model must "
                                         "be the ones it was trained with).")
                param.copy_(value)
    stage = {layer.layer_number - 1 for layer in getattr(getattr(unwrap(model), "decoder", None), "layers", [])}
    for name in adapters:  # the other stages' layers are their ranks' to check
        m = _HF_LAYER.match(name)
        if name not in used and (m is None or int(m.group(1)) in stage or int(m.group(1)) >= arch.num_layers):
            raise SlimeLiteError(f"{where} has an adapter for {name}, which this run's --lora-target-modules leave "
                                 "out (PEFT would apply it): give the --lora-target-modules it was trained with.")

