"""PEFT's LoRA folder: ``adapter_config.json`` + ``adapter_model.safetensors`` (``peft.PeftModel.from_pretrained``
loads it onto the HF base model). Tensors are named ``base_model.model.<HF module>.lora_{A,B}.weight``; B is
unscaled (PEFT scales by lora_alpha / r). ``write`` makes one from ``lora.hf_adapters``' dict, ``read`` is its
inverse, ``check_adapter_folder`` checks a --lora-adapter-path folder before Ray starts.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from slime_lite.errors import SlimeLiteError
from slime_lite.io import atomic_write_text

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"
# the HF linears LoRA here adapts: lora_config.LINEARS' and GLM4_FC1 (not imported: lora_config imports this module)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj")


def write(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], settings: Any, base_model: str,
          folder: str) -> None:
    """Write {HF weight name: (A, B)} as a PEFT folder for the HF model at ``base_model`` (``settings``: the run's
    lora_config.LoraSettings)."""
    os.makedirs(folder, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    for name, (a, b) in adapters.items():
        module = name.removesuffix(".weight")
        modules.add(module.rpartition(".")[2])
        tensors[PREFIX + module + _A] = a.detach().to("cpu").contiguous().clone()
        tensors[PREFIX + module + _B] = b.detach().to("cpu").contiguous().clone()
    save_file(tensors, os.path.join(folder, WEIGHTS))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
              "lora_dropout": settings.dropout, "target_modules": sorted(modules), "bias": "none",
              "use_rslora": False, "fan_in_fan_out": False, "inference_mode": True,
              "base_model_name_or_path": os.path.abspath(base_model)}
    atomic_write_text(json.dumps(config, indent=2) + "\n", os.path.join(folder, CONFIG))


def _config(folder: str, flag: str) -> dict[str, Any]:
    for f in (CONFIG, WEIGHTS):
        if not os.path.isfile(os.path.join(folder, f)):
            raise SlimeLiteError(f"{flag} {folder}: no {f} (a PEFT LoRA folder has {CONFIG} and {WEIGHTS}).")
    try:
        with open(os.path.join(folder, CONFIG), encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as exc:
        raise SlimeLiteError(f"{flag} {folder}: {CONFIG} is not JSON ({exc}).") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise SlimeLiteError(f"{flag} {folder}: {CONFIG} is not a LoRA adapter's (peft_type must be LORA).")
    return cfg


def check_adapter_folder(args: Any, flag: str = "--lora-adapter-path") -> None:
    """The folder's rank, scaling and tensor names agree with this run's --lora-* flags (every tensor a lora_A /
    lora_B of a linear LoRA here adapts)."""
    folder = args.lora_adapter_path
    cfg = _config(folder, flag)
    if cfg.get("r") != args.lora_rank:
        raise SlimeLiteError(f"{flag} {folder} has rank r={cfg.get('r')}; give --lora-rank {cfg.get('r')}.")
    if cfg.get("use_rslora") or cfg.get("use_dora"):
        raise SlimeLiteError(f"{flag} {folder} uses rsLoRA/DoRA scaling; only plain LoRA (alpha/r) is supported.")
    # what PEFT applies beyond one lora_A / lora_B pair per module with one r and lora_alpha: loading without it
    # would give another model than PEFT's
    extra = {k: cfg[k] for k in ("rank_pattern", "alpha_pattern", "modules_to_save", "lora_bias", "layer_replication",
                                 "trainable_token_indices", "target_parameters") if cfg.get(k)}
    if cfg.get("bias", "none") != "none":
        extra["bias"] = cfg["bias"]
    if extra:
        raise SlimeLiteError(f"{flag} {folder} sets {', '.join(f'{k}={v!r}' for k, v in extra.items())} in {CONFIG}; "
                             "only plain LoRA adapters (one r and lora_alpha for every module, bias none, no "
                             "modules_to_save) can be loaded.")
    alpha = args.lora_alpha if args.lora_alpha is not None else float(args.lora_rank)
    if float(cfg.get("lora_alpha", 8)) != alpha:
        raise SlimeLiteError(f"{flag} {folder} was trained with lora_alpha {cfg.get('lora_alpha')}; give "
                             f"--lora-alpha {cfg.get('lora_alpha')} (this run has {alpha:g}).")
    with safe_open(os.path.join(folder, WEIGHTS), framework="pt") as f:
        if "A" not in {_lora_name(k, folder, flag)[1] for k in f.keys()}:
            raise SlimeLiteError(f"{flag} {folder}: {WEIGHTS} holds no lora_A tensors.")


def _lora_name(key: str, folder: str, flag: str) -> tuple[str, str]:
    """(HF weight name, "A" or "B") of an adapter tensor of ``WEIGHTS``; a SlimeLiteError for any other tensor
    (PEFT's embedding adapters, modules_to_save, base-layer weights, ...): PEFT would apply it, this run could not."""
    k = key.replace(".default.weight", ".weight")  # PEFT keeps the adapter name "default" in memory
    for suffix, part in ((_A, "A"), (_B, "B")):
        module = k.removeprefix(PREFIX).removesuffix(suffix)
        if k.endswith(suffix) and module.rpartition(".")[2] in MODULES:
            return module + ".weight", part
    raise SlimeLiteError(f"{flag} {folder}: {WEIGHTS} holds {key}, which PEFT would apply but this run cannot: "
                         f"LoRA here adapts only the linears {', '.join(MODULES)} (lora_A / lora_B pairs). Train "
                         "the adapter with target_modules among those and without modules_to_save.")


def read(folder: str, flag: str = "--lora-adapter-path") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF weight name: (A, B)} of a PEFT folder (the prefix and PEFT's adapter name, if saved, stripped); a
    SlimeLiteError for a tensor other than a lora_A / lora_B of a linear LoRA here adapts."""
    _config(folder, flag)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(os.path.join(folder, WEIGHTS), framework="pt") as f:
        for key in f.keys():
            name, part = _lora_name(key, folder, flag)
            parts.setdefault(name, {})[part] = f.get_tensor(key)
    half = [n for n, p in parts.items() if len(p) != 2]
    if half:
        raise SlimeLiteError(f"{flag} {folder}: {half[0]} has only one of lora_A / lora_B.")
    return {n: (p["A"], p["B"]) for n, p in parts.items()}
