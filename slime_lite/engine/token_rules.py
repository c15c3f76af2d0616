"""What a decode step's next token is and whether it ends a request, as SGLang decides both.

A mixin of ``Scheduler`` (scheduler.py). In its model thread: the general sampler (logit bias, truncation, the
``min_new_tokens`` bans, top / token-id log-probs) and the finish rules (stop strings, stop token ids and eos, the
length), using its ``lm`` and ``eos_ids``. From any thread, the text side: ``encode`` / ``decode`` under the
tokenizer's lock, the response text trimmed as SGLang's detokenizer trims it, the model's eos ids.
"""

from __future__ import annotations

from typing import Any

import torch

from slime_lite.engine import logprobs as lpx
from slime_lite.engine.request import Request, RequestOutput
from slime_lite.engine.sampling import sample

# turn-end tokens some checkpoints do not name as eos (Llama 3's tool-call <|eom_id|>, ...): SGLang stops on them (and
# bans them below min_new_tokens) when the tokenizer's added vocabulary has them
ADDITIONAL_STOP_TOKENS = ("<|eom_id|>", "<|content_model_end_sampling|>", "<|ifm|im_end|>")


class TokenRulesMixin:
    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list[int], list[float], list[Any]]:
        """The general sampler (logit bias, truncation, ``min_new_tokens`` bans) over float32 ``logits`` of
        ``reqs``; also each request's top / token-id log-probs (``logprobs.extras``; None when it asks none)."""
        biased = [i for i, r in enumerate(reqs) if r.params.logit_bias]
        if biased:
            logits = logits.clone()
            for i in biased:
                ids, bias = reqs[i].params.bias_tensors
                logits[i, ids.to(logits.device)] += bias.to(logits.device, logits.dtype)
        banned = [self._banned(r) for r in reqs]
        tokens, logprobs = sample(logits, [r.params for r in reqs], [r.seed for r in reqs],
                                  [len(r.output_ids) for r in reqs], banned if any(banned) else None)
        tokens, logprobs = torch.stack((tokens.double(), logprobs.double())).tolist()  # one device sync
        extra: list[Any] = [None] * len(reqs)
        for i, r in enumerate(reqs):
            if r.top_logprobs_num or r.token_ids_logprob is not None:
                t = 1.0 if r.params.greedy else r.params.temperature
                top, ids = lpx.extras(torch.log_softmax(logits[i : i + 1].float() / t, dim=-1), r.top_logprobs_num,
                                      r.token_ids_logprob)
                extra[i] = (top and top[0], ids and ids[0])
        return [int(t) for t in tokens], logprobs, extra

    def _banned(self, req: Request) -> list[int]:
        """Below ``min_new_tokens``: the stop token ids and eos, ``ignore_eos`` or not (SGLang's penalizer)."""
        if len(req.output_ids) >= req.params.min_new_tokens:
            return []
        if req.banned_ids is None:  # once a request (its stop_token_ids may be long)
            req.banned_ids = sorted(i for i in req.params.stop_id_set | self.eos_ids if 0 <= i < self.lm.vocab_size)
        return req.banned_ids

    def _check_finished(self, req: Request, tok: int) -> dict[str, Any] | None:
        """SGLang's order: stop strings first, then stop token ids / eos (neither under ``ignore_eos``), then the
        length; so eos as the last allowed token is a stop. Stop strings are looked for in the text with special
        tokens, whatever ``skip_special_tokens`` says (SGLang decodes the tail that way)."""
        p = req.params
        if p.stop:  # the tail in tokens: a character may take up to 4 (byte-level tokens), so a string its bytes
            window = max(len(s.encode("utf-8")) for s in p.stop) + 8
            tail = self.decode(req.output_ids[-window:], False)
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if not p.ignore_eos and (tok in p.stop_id_set or tok in self.eos_ids):
            return {"type": "stop", "matched": tok}
        if len(req.output_ids) >= req.max_new:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids; with the special tokens the tokenizer adds (a BOS for some) unless told not to."""
        with self.tokenizer_lock:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def output_text(self, out: RequestOutput) -> str:
        """The response text, trimmed as SGLang's detokenizer does: without the matched stop token (kept with
        ``no_stop_trim``); cut before the matched stop string, or right after it with ``no_stop_trim`` (the rest of
        the token that completed it is dropped either way)."""
        ids, fr, p = out.output_ids, out.finish_reason or {}, out.params
        matched = fr.get("matched") if fr.get("type") == "stop" else None
        if isinstance(matched, int) and not p.no_stop_trim and ids:
            ids = ids[:-1]
        text = self.decode(ids, p.skip_special_tokens)
        if isinstance(matched, str):
            cut = text.find(matched)
            if cut >= 0:
                text = text[: cut + len(matched)] if p.no_stop_trim else text[:cut]
        return text

    def _eos_ids(self) -> set[int]:
        """The config's, the generation config's and the tokenizer's eos, and the turn-end tokens SGLang stops on too
        when the tokenizer has them (``ADDITIONAL_STOP_TOKENS``)."""
        ids: set[int] = set()
        for src in (self.hf.config, getattr(self.hf, "generation_config", None)):
            val = getattr(src, "eos_token_id", None) if src is not None else None
            ids.update([val] if isinstance(val, int) else (val or []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        added = self.tokenizer.get_added_vocab()
        return ids | {added[t] for t in ADDITIONAL_STOP_TOKENS if t in added}
