"""slime's --only-train-params-name-list / --freeze-params-name-list: requires_grad off on the parameters whose
Megatron names match (``re.search``), before DDP wraps the model, so the optimizer and the gradient buffers leave
them out. Torch only: the rules between the flags are checked when the flags are parsed (args_train.py).
``grads_through_frozen_embedding`` keeps full activation recompute training when the embedding is frozen (LoRA too)."""

from __future__ import annotations

import logging
import re

import torch

from slime_lite.errors import SlimeLiteError

log = logging.getLogger("slime_lite.train")


def freeze_by_name(model: torch.nn.Module, only_train: list[str] | None, freeze: list[str] | None) -> int:
    """As slime: with ``only_train``, a parameter trains when one pattern matches its name (the others are frozen);
    with ``freeze``, a parameter whose name one pattern matches is frozen. Returns how many were frozen here; a
    model left with nothing to train is an error naming the flag."""
    if not only_train and not freeze:
        return 0
    frozen = 0
    for name, param in model.named_parameters():
        if only_train:
            keep = any(re.search(p, name) for p in only_train)
        else:
            keep = not any(re.search(p, name) for p in freeze or [])
        if not keep and param.requires_grad:
            param.requires_grad_(False)
            frozen += 1
    flag, patterns = (("--only-train-params-name-list", only_train) if only_train
                      else ("--freeze-params-name-list", freeze))
    if not any(p.requires_grad for p in model.parameters()):
        names = [n for n, _ in model.named_parameters()][:4]
        raise SlimeLiteError(f"{flag} {' '.join(patterns)} leaves no parameter to train (names look like "
                             f"{', '.join(names)}): fix the patterns.")
    log.info("%s: %d parameters frozen, %d train", flag, frozen, sum(p.requires_grad for p in model.parameters()))
    return frozen


def _require_grad(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_()
    return output


def grads_through_frozen_embedding(model: torch.nn.Module) -> bool:
    """When every embedding weight of this stage is frozen (LoRA, --freeze-params-name-list embedding), make the
    embedding's output require grad (PEFT's ``enable_input_require_grads``): Megatron's full recompute
    (``--recompute-granularity full``) is a reentrant checkpoint, which runs no backward through a block whose input
    needs no grad, so the layers it recomputes would get no gradient. Returns whether the hook was added."""
    embedding = getattr(model, "embedding", None)
    params = list(embedding.parameters()) if embedding is not None else []
    if not params or any(p.requires_grad for p in params):
        return False
    embedding.register_forward_hook(_require_grad)
    return True
