"""The doctor's on-task rows: is step 1's model on its task, or writing gibberish? The trainer's NLL per model token,
repeated bigrams, the share of valid tokens (over model turns only: a tool's or the environment's tokens are no
sign of the model), and whether the prompts are formatted as the model expects (chat template or not)."""

from __future__ import annotations

import os
from typing import Any

from slime_lite.checks.ci import Check, cuda_available
from slime_lite.checks.ci import make_check as _c
from slime_lite.rollout.data import render_prompt
from slime_lite.rollout.turns import turns
from slime_lite.tokenizer import load_tokenizer

# the built-in addition task answers with digits only; any other task: printable or whitespace tokens
TASK_CHARS = {"addition": set("0123456789")}


def model_turn_ids(sample: Any, eos_id: int | None) -> list[list[int]]:
    """The token ids of each model turn of the sample's response (a final EOS left out)."""
    response = list(sample.tokens[len(sample.tokens) - sample.response_length:])
    out = [response[t["start"]:t["start"] + t["length"]] for t in turns(sample) if t["source"] == "model"]
    if out and out[-1] and eos_id is not None and out[-1][-1] == eos_id:
        out[-1] = out[-1][:-1]
    return out


def repetition_rate(ids: list[int]) -> float:
    """Share of a response's token bigrams that repeat an earlier bigram of the same response."""
    grams = list(zip(ids, ids[1:]))
    return 0.0 if len(grams) < 2 else 1.0 - len(set(grams)) / len(grams)


def _trained_nll(samples: list, log_probs: list | None) -> float | None:
    """Mean NLL over the response tokens at loss_mask 1 (the model's; inserted turns are at 0): the trainer's
    log-probs, else the engine's."""
    total = count = 0
    for i, s in enumerate(samples):
        lps = log_probs[i] if log_probs is not None else s.rollout_log_probs
        if lps is None:
            continue
        mask = s.loss_mask if s.loss_mask is not None else [1] * s.response_length
        for lp, m in zip(lps, mask):
            if m:
                total -= float(lp)
                count += 1
    return total / count if count else None


def on_task_checks(args: Any, samples: list, log_probs: list | None, nll_threshold: float,
                   missing: str = "no rollout dump: the run stopped before its first rollout was saved") -> list[Check]:
    """The gibberish score of step 1: trainer NLL per model token, repetition, share of valid tokens."""

    if not samples:
        return [Check(n, None, t, False, missing)
                for n, t in (("on_task_nll", f"< {nll_threshold:g}"), ("on_task_repetition", "< 0.5"),
                             ("on_task_valid_chars", ">= 0.9"))]
    tok = load_tokenizer(args.hf_checkpoint)
    special = set(getattr(tok, "all_special_ids", []) or [])
    nll = _trained_nll(samples, log_probs)
    per_sample = [model_turn_ids(s, tok.eos_token_id) for s in samples]
    rep = sum(sum(repetition_rate(t) for t in turns_) / max(len(turns_), 1) for turns_ in per_sample) / len(samples)
    allowed = TASK_CHARS.get(args.rm_type or "")
    good = total = 0
    for t in (t for turns_ in per_sample for ids in turns_ for t in ids):
        total += 1
        text = tok.decode([t])
        if allowed is not None:
            good += t not in special and bool(text) and all(c in allowed for c in text)
        else:
            good += t not in special and bool(text) and (text.isspace() or text.isprintable())
    valid = good / total if total else 0.0
    what = f"characters valid for --rm-type {args.rm_type}" if allowed is not None else \
        "printable or whitespace, non-special tokens"
    return [
        _c("on_task_nll", nll, f"< {nll_threshold:g} (trainer NLL per model token)",
           nll is not None and nll < nll_threshold),
        _c("on_task_repetition", rep, "< 0.5 (repeated bigrams)", rep < 0.5),
        _c("on_task_valid_chars", valid, f">= 0.9 ({what})", valid >= 0.9),
    ]


def prompt_format_check(args: Any, samples: list, max_prompts: int = 8, margin: float = 0.5) -> Check:
    """Are the prompts formatted as the model expects? The trainer-side model's NLL per token of the answers
    (labels, else the sampled responses) after the prompt as the run rendered it vs with the chat template toggled.
    A run whose format makes the answers much less likely than the other format fails."""
    import torch  # torch: `slime-lite doctor --help` stays instant

    name, flag = "on_task_prompt_format", "--apply-chat-template"
    tok = load_tokenizer(args.hf_checkpoint)
    picked = [s for s in samples if isinstance(s.prompt, str)][:: max(1, args.n_samples_per_prompt)][:max_prompts]
    if not picked or not getattr(tok, "chat_template", None) or _checkpoint_bytes(args.hf_checkpoint) > 4 << 30:
        return Check(name, None, "answer NLL/token with the chat template toggled", True,
                     "skipped: no text prompts, no chat template, or a model over 4 GB")
    from transformers import AutoModelForCausalLM  # transformers: only for the on-task checks

    device = "cuda" if cuda_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.hf_checkpoint, dtype=torch.float32).to(device).eval()
    eos = tok.eos_token_id

    def nll(apply: bool) -> float:
        total, count = 0.0, 0
        for s in picked:
            target = str(s.label) if s.label is not None and str(s.label) else \
                s.response.replace(tok.eos_token or "\0", "")
            p = tok(render_prompt(s.prompt, tok, apply, s.metadata.get("tools"), args.apply_chat_template_kwargs),
                    add_special_tokens=False)["input_ids"]
            t = tok(target, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
            ids = torch.tensor([p + t], device=device)
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(p) - 1: -1].float()
            total -= float(torch.log_softmax(logits, -1).gather(-1, ids[0, len(p):, None]).sum())
            count += len(t)
        return total / max(count, 1)

    used, other = nll(args.apply_chat_template), nll(not args.apply_chat_template)
    what = "with" if args.apply_chat_template else "without"
    passed = used <= other + margin
    cause = (f"prompts are formatted unlike the model's warm-start data: the answers cost {used:.2f} nats/token "
             f"{what} {flag} but {other:.2f} {'without' if args.apply_chat_template else 'with'} it; "
             f"{'drop' if args.apply_chat_template else 'add'} {flag} (or warm-start the model in this format)")
    return _c(name, used, f"<= {other:.2f} + {margin:g} (answer NLL/token, {flag} toggled)", passed, cause)


def _checkpoint_bytes(hf_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir)
               if f.endswith((".safetensors", ".bin")))
