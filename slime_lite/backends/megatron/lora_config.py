"""LoRA settings of a run: which Megatron linears get adapters, their scaling, and the checks of the --lora-* flags
(before Ray starts). No torch or Megatron import: the driver runs these checks.

``--lora-target-modules`` takes Hugging Face module names, Megatron linear names or ``all-linear``. Megatron fuses
some HF projections into one linear, and an adapter sits on the Megatron linear (one A shared by its parts, B
covering all its output rows), so fused parts are named together:

    q_proj, k_proj, v_proj      -> self_attention.linear_qkv   (column-parallel: B split over TP, A replicated)
    o_proj                      -> self_attention.linear_proj  (row-parallel: A split over TP, B replicated)
    gate_proj, up_proj          -> mlp.linear_fc1              (GLM4: gate_up_proj; column-parallel)
    down_proj                   -> mlp.linear_fc2              (row-parallel)

In PEFT's format each HF part gets its own adapter: the shared A is written for each part and B is cut into the
parts' rows, which gives exactly the same model (W_q + s B_q A, ...).
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any

from slime_lite.errors import SlimeLiteError
from slime_lite.model_families import FAMILIES

# Megatron linear (suffix under decoder.layers.i.) -> (parallel kind, its HF modules; GLM4's fused MLP aside)
LINEARS: dict[str, tuple[str, tuple[str, ...]]] = {
    "self_attention.linear_qkv": ("column", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("row", ("o_proj",)),
    "mlp.linear_fc1": ("column", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("row", ("down_proj",)),
}
GLM4_FC1 = ("gate_up_proj",)
ADAPTER_MARK = ".lora."  # in the name of every adapter parameter: decoder.layers.i.<linear>.lora.{A,B}
ALL = "all-linear"


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float
    linears: tuple[str, ...]  # Megatron linear suffixes, in LINEARS order

    @property
    def scaling(self) -> float:
        """alpha / rank (PEFT's and Megatron-Bridge's scaling of B A)."""
        return self.alpha / self.rank


def hf_modules(linear: str, fused_gate_up: bool) -> tuple[str, ...]:
    """The HF module names (last part) one Megatron linear holds."""
    return GLM4_FC1 if linear == "mlp.linear_fc1" and fused_gate_up else LINEARS[linear][1]


def valid_names(fused_gate_up: bool) -> list[str]:
    names = [ALL]
    for linear in LINEARS:
        names += [*hf_modules(linear, fused_gate_up), linear.rpartition(".")[2]]
    return names


def resolve_targets(names: list[str], fused_gate_up: bool, flag: str = "--lora-target-modules") -> tuple[str, ...]:
    """The Megatron linears named by HF / Megatron module names or all-linear; SlimeLiteError naming the valid names
    for a name that matches no layer of the model, and for a fused part named without its siblings."""
    names = [n for item in names for n in item.replace(",", " ").split()]
    if not names:
        raise SlimeLiteError(f"{flag} is empty; give {ALL} or module names: {', '.join(valid_names(fused_gate_up))}.")
    chosen: set[str] = set()
    for name in names:
        if name == ALL:
            chosen.update(LINEARS)
            continue
        hit = [lin for lin in LINEARS if name in (lin.rpartition(".")[2], *hf_modules(lin, fused_gate_up))]
        if not hit:
            raise SlimeLiteError(f"{flag}: {name!r} matches no layer of this model; valid names: "
                                 f"{', '.join(valid_names(fused_gate_up))}.")
        chosen.add(hit[0])
    for lin in chosen:  # a fused part alone cannot have its own adapter
        parts = hf_modules(lin, fused_gate_up)
        given = [p for p in parts if p in names]
        if given and len(given) < len(parts) and lin.rpartition(".")[2] not in names and ALL not in names:
            raise SlimeLiteError(f"{flag}: {', '.join(given)} is part of Megatron's fused {lin.rpartition('.')[2]} "
                                 f"({', '.join(parts)}), which has one adapter: name {', '.join(parts)} together.")
    return tuple(lin for lin in LINEARS if lin in chosen)


def sglang_target_modules(names: list[str]) -> list[str]:
    """SGLang's ``--lora-target-modules`` for ``--lora-target-modules names``: the HF modules of the adapted linears
    (SGLang maps gate_proj and up_proj onto a fused gate_up_proj itself)."""
    fused = any("gate_up_proj" in n for n in names)
    return [m for lin in resolve_targets(names, fused) for m in LINEARS[lin][1]]


def settings(args: Any, fused_gate_up: bool) -> LoraSettings | None:
    """The run's LoRA settings (None without --lora-rank)."""
    if args.lora_rank is None:
        return None
    alpha = args.lora_alpha if args.lora_alpha is not None else float(args.lora_rank)
    return LoraSettings(args.lora_rank, float(alpha), float(args.lora_dropout),
                        resolve_targets(args.lora_target_modules, fused_gate_up))


# flag -> why LoRA cannot run with it (value that is refused: truthy)
_REFUSED = {
    "ref_load": "the reference model of a LoRA run is its base (--hf-checkpoint without the adapters)",
    "sequence_parallel": "the adapters take each linear's whole input sequence",
    "debug_scramble_engine_weights": "an adapter-only push does not restore the scrambled base weights",
}


def check_lora_args(args: Any, hf_config: dict) -> None:
    """The --lora-* flags, before Ray starts: SlimeLiteError naming the flag and the fix."""
    given = [f for f in ("lora_alpha", "lora_adapter_path") if getattr(args, f) is not None]
    if args.lora_dropout:
        given.append("lora_dropout")
    if args.lora_target_modules and list(args.lora_target_modules) != [ALL]:  # its default
        given.append("lora_target_modules")
    if args.lora_rank is None:
        if given:
            raise SlimeLiteError(f"--{given[0].replace('_', '-')} needs --lora-rank R (LoRA is off without it).")
        return
    if args.lora_rank <= 0:
        raise SlimeLiteError(f"--lora-rank {args.lora_rank} must be a positive integer (e.g. 8, 16, 32); leave "
                             "it out to fine-tune every weight.")
    if args.lora_alpha is not None and not 0 < args.lora_alpha < math.inf:
        raise SlimeLiteError(f"--lora-alpha {args.lora_alpha} must be a finite number > 0 (the adapters are scaled by "
                             "alpha/rank; "
                             "e.g. --lora-alpha 16 with --lora-rank 8).")
    if not 0 <= args.lora_dropout < 1:
        raise SlimeLiteError(f"--lora-dropout {args.lora_dropout} must be in [0, 1).")
    for flag, why in _REFUSED.items():
        if getattr(args, flag, None):
            raise SlimeLiteError(f"--lora-rank cannot be used with --{flag.replace('_', '-')}: {why}. Drop one.")
    if args.transformer_impl != "local":
        raise SlimeLiteError("--lora-rank needs --transformer-impl local: Transformer Engine's linear_qkv applies the "
                             "input norm inside the linear, where the adapter cannot see the normed input.")
    if args.rollout_backend == "sglang" and args.rollout_external_engine_addrs and not args.debug_train_only:
        raise SlimeLiteError("--lora-rank with --rollout-external-engine-addrs: the adapters are pushed to SGLang "
                             "engines that slime-lite launches with --enable-lora; engines started elsewhere may lack "
                             "it. Let slime-lite start the engines, or train without LoRA.")
    family = FAMILIES.get(hf_config.get("model_type"))
    if family is not None and family.moe:
        raise SlimeLiteError(f"--lora-rank: {hf_config.get('model_type')} is a mixture-of-experts model, and the "
                             "adapters cover dense linears only; train it without LoRA.")
    fused = bool(family and family.fused_gate_up)
    linears = settings(args, fused).linears  # target names
    if args.lora_adapter_path is not None:
        from slime_lite.backends.megatron import peft_format  # imports torch: only with the flag

        peft_format.check_adapter_folder(args, hf_config, {lin: hf_modules(lin, fused) for lin in LINEARS}, linears)
