"""Log-probs the embedded engine returns besides the sampled token's, in SGLang's shapes.

- ``top_logprobs_num = k``: per position, the ``k`` most likely tokens ``[logprob, token_id, text]``, best first.
- ``token_ids_logprob = [ids]``: per position, those tokens' ``[logprob, token_id, text]`` in the order given.
- ``input_token_logprobs`` (and the input top / token-id lists): from ``logprob_start_len`` to the end of the
  prompt; the first entry has no log-prob (``None``: nothing before it was scored), whatever the start. The default
  ``logprob_start_len = -1`` means none of the prompt (an empty list), or only its last token when
  ``token_ids_logprob`` is given.

Output positions' values are taken from ``log_softmax((logits + logit_bias) / temperature)`` (temperature 1 for
greedy rows), like the sampled token's own log-prob (sampling.py). Prompt positions' are of the raw logits,
``log_softmax(logits)``, whatever the request's temperature and bias, as SGLang's are: at a temperature other than 1
they are not comparable with the output tokens' log-probs.
``text`` is the token's text with ``return_text_in_logprobs``, else ``None``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

Pairs = list[tuple[float, int]]


def extras(logp: torch.Tensor, top_k: int, token_ids: list[int] | None) -> tuple[list[Pairs] | None,
                                                                                  list[Pairs] | None]:
    """Per row of ``logp [N, V]``: the top ``top_k`` ``(logprob, id)`` pairs (None when 0) and the pairs of
    ``token_ids`` (None when None)."""
    top = ids = None
    if top_k > 0:
        vals, idx = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
        top = [list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())]
    if token_ids is not None:
        vals = logp[:, token_ids].tolist() if token_ids else [[] for _ in range(logp.shape[0])]
        ids = [list(zip(v, token_ids)) for v in vals]
    return top, ids


def resolve_start(start: int, prompt_len: int, token_ids: list[int] | None) -> int:
    """SGLang's ``logprob_start_len``: -1 is the end of the prompt (its last token with ``token_ids_logprob``);
    past the prompt is a ValueError."""
    if start == -1:
        return prompt_len - 1 if token_ids is not None else prompt_len
    if start > prompt_len:
        raise ValueError(f"logprob_start_len={start} is higher than the number of input tokens ({prompt_len})")
    return start


def meta_info(out: Any, top_k: int, token_ids: list[int] | None, text: Callable[[int], str] | None
              ) -> dict[str, Any]:
    """The log-prob fields of a ``/generate`` result's ``meta_info`` for a ``RequestOutput``."""

    def triples(pairs):
        return [[lp, t, None if text is None else text(t)] for lp, t in pairs]

    def rows(per_position):
        return [triples(p) if p else None for p in (per_position or [])]

    inputs = out.input_ids_for_logprobs or []
    meta: dict[str, Any] = {
        "input_token_logprobs": triples(zip(out.input_logprobs or [], inputs)),
        "output_token_logprobs": triples(zip(out.output_logprobs, out.output_ids)),
        "output_token_logprobs_length": len(out.output_ids),
    }
    if top_k > 0:
        meta["input_top_logprobs"] = rows(out.input_top)
        meta["output_top_logprobs"] = rows(out.output_top)
    if token_ids is not None:
        meta["input_token_ids_logprobs"] = rows(out.input_ids_lp)
        meta["output_token_ids_logprobs"] = rows(out.output_ids_lp)
    return meta
