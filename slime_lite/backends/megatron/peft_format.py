"""PEFT's LoRA folder: ``adapter_config.json`` + ``adapter_model.safetensors`` (``peft.PeftModel.from_pretrained``
loads it onto the HF base model). Tensors are named ``base_model.model.<HF module>.lora_{A,B}.weight``; B is
unscaled (PEFT scales by lora_alpha / r). ``write`` makes one from ``lora.hf_adapters``' dict, ``read`` is its
inverse, ``check_adapter_folder`` checks a --lora-adapter-path folder before Ray starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from slime_lite.errors import SlimeLiteError
from slime_lite.io import atomic_write_text, save_safetensors

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight$")
# adapter_config.json keys that leave PEFT's forward plain LoRA (metadata; training-, init- or target-only settings,
# the tensors saying which modules are adapted) or that the checks handle; any other key set (not null, false or
# empty) is a variant PEFT computes otherwise (aLoRA's alora_invocation_tokens, use_bdlora, kasa_config, ...)
_NEUTRAL = {"peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
            "inference_mode", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules",
            "layers_to_transform", "layers_pattern", "megatron_core", "qalora_group_size", "runtime_config",
            "use_rslora", "use_dora", "bias", "init_lora_weights"}
_PLAIN_INIT = (True, False, "gaussian", "orthogonal", "eva")  # the others (pissa, olora, loftq, ...) change the base
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
    save_safetensors(tensors, os.path.join(folder, WEIGHTS))
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


def check_adapter_folder(args: Any, hf_config: dict, linears: dict[str, tuple[str, ...]], targets: tuple[str, ...],
                         flag: str = "--lora-adapter-path") -> None:
    """Before Ray starts, what the train worker would refuse: a config that is not plain LoRA of this run's rank and
    scaling, an unreadable ``WEIGHTS``, and tensors that do not fit this run's adapters on the ``hf_config`` model
    (``linears``: every Megatron linear LoRA adapts -> its HF modules, in lora_config.LINEARS order; ``targets``: the
    run's). Reads the tensors' names and shapes (the header) and only the lora_A of fused parts."""
    folder = args.lora_adapter_path
    cfg = _config(folder, flag)
    if cfg.get("r") != args.lora_rank:
        raise SlimeLiteError(f"{flag} {folder} has rank r={cfg.get('r')}; give --lora-rank {cfg.get('r')}.")
    if cfg.get("use_rslora") or cfg.get("use_dora"):
        raise SlimeLiteError(f"{flag} {folder} uses rsLoRA/DoRA scaling; only plain LoRA (alpha/r) is supported.")
    # what PEFT applies beyond one lora_A / lora_B pair per module with one r and lora_alpha: loading without it
    # would give another model than PEFT's
    extra = {k: v for k, v in cfg.items() if k not in _NEUTRAL and v not in (None, False, "", [], {})}
    if cfg.get("bias", "none") != "none":
        extra["bias"] = cfg["bias"]
    if cfg.get("init_lora_weights", True) not in _PLAIN_INIT:
        extra["init_lora_weights"] = cfg["init_lora_weights"]
    if extra:
        raise SlimeLiteError(f"{flag} {folder} sets {', '.join(f'{k}={v!r}' for k, v in extra.items())} in {CONFIG}; "
                             "only plain LoRA adapters (one r and lora_alpha for every module, bias none, no "
                             "modules_to_save, no variant such as aLoRA) can be loaded.")
    alpha = args.lora_alpha if args.lora_alpha is not None else float(args.lora_rank)
    if float(cfg.get("lora_alpha", 8)) != alpha:
        raise SlimeLiteError(f"{flag} {folder} was trained with lora_alpha {cfg.get('lora_alpha')}; give "
                             f"--lora-alpha {cfg.get('lora_alpha')} (this run has {alpha:g}).")
    with _weights(folder, flag) as f:
        pairs = _pairs(f, folder, flag)
        if not pairs:
            raise SlimeLiteError(f"{flag} {folder}: {WEIGHTS} holds no lora_A tensors.")
        held = _fit(f, pairs, hf_config, args.lora_rank, linears, f"{flag} {folder}")
    want = [m for lin in targets for m in linears[lin]]
    if set(held) != set(want):
        raise SlimeLiteError(f"{flag} {folder} adapts {', '.join(held)}, and this run's --lora-target-modules "
                             f"{' '.join(args.lora_target_modules)} adapt {', '.join(want)}: give "
                             f"--lora-target-modules {' '.join(held)}.")


def _fit(f: Any, pairs: dict[str, dict[str, str]], hf_config: dict, rank: int, linears: dict[str, tuple[str, ...]],
         where: str) -> list[str]:
    """The HF modules (LINEARS order) the adapter adapts; SlimeLiteError where no --lora-target-modules could load
    it: a tensor of no linear of the model, a shape off its rank or the model's sizes, a module adapted in some
    layers only, or the parts of a Megatron fused linear without all of them or with different lora_A."""
    cannot = (" It cannot be loaded under any --lora-target-modules; merge it into the base model (peft's "
              "merge_and_unload) and give that folder as --hf-checkpoint.")
    place = {m: "self_attn" if lin.startswith("self_attention") else "mlp" for lin, ms in linears.items() for m in ms}
    layers, sizes = hf_config.get("num_hidden_layers"), _sizes(hf_config)
    held: dict[str, set[int]] = {}
    for name, keys in pairs.items():
        m = _LAYER.match(name)
        if m is None or place.get(m.group(3)) != m.group(2) or (layers and int(m.group(1)) >= layers):
            raise SlimeLiteError(f"{where} has an adapter for {name}, which is no linear of the --hf-checkpoint "
                                 f"model ({hf_config.get('model_type')}, {layers} layers): it was trained for "
                                 "another model." + cannot)
        held.setdefault(m.group(3), set()).add(int(m.group(1)))
        a, b = (tuple(f.get_slice(keys[p]).get_shape()) for p in ("A", "B"))
        io = sizes.get(m.group(3)) if sizes else None
        if a[:1] != (rank,) or b[1:] != (rank,) or (io and (a[1:], b[0]) != ((io[0],), io[1])):
            want = f"[{rank}, {io[0]}] and [{io[1]}, {rank}]" if io else f"rank {rank}"
            raise SlimeLiteError(f"{where}: {name} has lora_A {list(a)} and lora_B {list(b)}, where this model and "
                                 f"--lora-rank {rank} (its config's r) take {want}: it was trained for another "
                                 "model." + cannot)
    for module, at in held.items():
        if layers and at != set(range(layers)):
            raise SlimeLiteError(f"{where} adapts {module} in layers {sorted(at)} of {layers} only (PEFT's "
                                 "layers_to_transform?), and the adapters here cover every layer." + cannot)
    for lin, parts in linears.items():
        given = [p for p in parts if p in held]
        if given and len(given) < len(parts):
            absent = ", ".join(p for p in parts if p not in given)
            raise SlimeLiteError(f"{where} adapts {', '.join(given)} without {absent}, "
                                 f"but Megatron fuses {', '.join(parts)} into one {lin.rpartition('.')[2]} with one "
                                 "adapter." + cannot)
        for layer in sorted(held.get(parts[0], ()) if len(given) > 1 else ()):
            names = [f"model.layers.{layer}.{place[p]}.{p}.weight" for p in parts]
            first, *others = (f.get_tensor(pairs[n]["A"]) for n in names)
            if any(not torch.equal(first, x) for x in others):
                raise SlimeLiteError(f"{where}: {', '.join(names)} have different lora_A (PEFT initializes each "
                                     f"on its own), but Megatron's fused {lin.rpartition('.')[2]} has one A for all "
                                     "of them; only adapters whose fused parts share lora_A (as slime-lite saves "
                                     "them) can be loaded." + cannot)
    return [m for parts in linears.values() for m in parts if m in held]


def _sizes(c: dict) -> dict[str, tuple[int, int]] | None:
    """{HF module: (in features, out features)} from config.json; None when it lacks the sizes."""
    h, heads, ffn = c.get("hidden_size"), c.get("num_attention_heads"), c.get("intermediate_size")
    if not (h and heads and ffn):
        return None
    hd = c.get("head_dim") or h // heads
    q, kv = heads * hd, (c.get("num_key_value_heads") or heads) * hd
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, ffn),
            "up_proj": (h, ffn), "gate_up_proj": (h, 2 * ffn), "down_proj": (ffn, h)}


@contextlib.contextmanager
def _weights(folder: str, flag: str) -> Iterator[Any]:
    """``WEIGHTS`` opened; a SlimeLiteError naming it for a file that is not safetensors (truncated, empty)."""
    try:
        with safe_open(os.path.join(folder, WEIGHTS), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise SlimeLiteError(f"{flag} {folder}: {WEIGHTS} cannot be read ({exc}): a truncated or partial copy? "
                             f"Copy or save the adapter folder again and give it as {flag}.") from None


def _pairs(f: Any, folder: str, flag: str) -> dict[str, dict[str, str]]:
    """{HF weight name: {"A": tensor key, "B": tensor key}} of an opened ``WEIGHTS``; SlimeLiteError for a tensor
    that is no lora_A / lora_B of a linear LoRA here adapts and for an A without its B (or the reverse)."""
    parts: dict[str, dict[str, str]] = {}
    for key in f.keys():
        name, part = _lora_name(key, folder, flag)
        parts.setdefault(name, {})[part] = key
    half = [n for n, p in parts.items() if len(p) != 2]
    if half:
        raise SlimeLiteError(f"{flag} {folder}: {half[0]} has only one of lora_A / lora_B.")
    return parts


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
    with _weights(folder, flag) as f:
        return {n: (f.get_tensor(k["A"]), f.get_tensor(k["B"])) for n, k in _pairs(f, folder, flag).items()}
