"""Reward functions: ``--rm-type {addition,math,boxed_math,deepscaler,dapo,gpqa,f1,remote_rm}`` or
``--custom-rm-path module.fn`` (slime's signature). ``deepscaler`` and ``boxed_math`` follow slime's rm_hub rules
(the answer after the reasoning, in ``\\boxed{}``), graded by the same number-or-text comparison as ``math``;
``dapo`` is DAPO's rule (the last ``Answer: ...`` line of the response's end against an integer label, +1 or -1, as
the dict ``{"score", "acc", "pred"}``: pick the scalar with ``--reward-key score``); ``gpqa`` reads the option letter
a multiple-choice answer picks; ``f1`` is the token F1 of the normalised answer; ``remote_rm`` posts ``{"prompt",
"response", "label"}`` to ``--rm-url`` and takes the JSON answer as the reward. ``boxed_<type>`` (as slime) scores
only the response's last ``\\boxed{...}`` (none: an empty response) with ``<type>``. A sample's
``metadata["rm_type"]`` (a data field) picks its type, as in slime; with every row's field set, no --rm-type is
needed.

A custom reward model is ``async def rm(args, sample, **kwargs) -> float | dict`` (a plain ``def`` works too); with
``--group-rm`` it gets a prompt's whole group, ``rm(args, samples)``, and returns one reward per sample.
A dict reward is stored whole in ``sample.reward`` and ``--reward-key`` picks the scalar the trainer uses.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import numbers
import re
import string
import weakref
from collections import Counter
from fractions import Fraction
from typing import Any, Callable

from slime_lite.errors import SlimeLiteError
from slime_lite.hooks import call_maybe_async, load_hook
from slime_lite.types import Sample

log = logging.getLogger(__name__)

RM_TYPES = ("addition", "math", "boxed_math", "deepscaler", "dapo", "gpqa", "f1", "remote_rm")
REMOTE_RM_ATTEMPTS = 5  # a remote reward model's request is sent at most this often (backoff 0.5, 1, 2, 4 s)
REMOTE_RM_CONCURRENCY = 64  # requests in flight to --rm-url at once (a rollout scores every sample together)
_REMOTE_LIMITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its Semaphore
# End-of-text markers an engine may leave in the response text when it does not skip special tokens.
_EOS_STRINGS = ("<|endoftext|>", "<|im_end|>", "</s>", "<|eot_id|>")
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+"


def strip_response(text: str) -> str:
    """The response without surrounding whitespace and trailing end-of-text markers."""
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for eos in _EOS_STRINGS:
            if text.endswith(eos):
                text, changed = text[: -len(eos)].rstrip(), True
    return text


def _label(sample: Sample) -> str:
    if sample.label is None:
        raise SlimeLiteError(
            f"sample {sample.index}: no label to score against; set --label-key to the data field holding it."
        )
    return str(sample.label).strip()


def addition_reward(response: str, label: str) -> float:
    """1.0 when the response (eos and whitespace stripped) is exactly the label, else 0.0."""
    return 1.0 if strip_response(response) == label.strip() else 0.0


def extract_final_answer(response: str) -> str | None:
    """The final answer of a math response: the last ``\\boxed{...}``, else a ``#### x`` answer, else the last number."""
    text = strip_response(response)
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "\\boxed{" in text:  # a boxed answer cut off before its closing brace (the length limit): no answer
        return None
    hashes = re.findall(r"####\s*(" + _NUMBER + ")", text)
    if hashes:
        return hashes[-1]
    numbers = list(re.finditer(_NUMBER, text)) + list(_FRAC.finditer(text))  # a LaTeX fraction is a number too
    return max(numbers, key=lambda m: m.end()).group(0) if numbers else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


_FRAC = re.compile(r"(-?)\\[dt]?frac(?:\{(-?\d+)\}|(\d))(?:\{(\d+)\}|(\d))")  # \frac{1}{2}, -\dfrac12
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")  # 1,234,567.5: the only commas a number has
_LATEX_NOISE = ("\\$", "$", "\\!", "\\,", "\\;", "\\ ", "\\left", "\\right", "^{\\circ}", "^\\circ", "\\%", "%")
_UNITS = re.compile(r"(?<=\S)\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z ]*\}$")  # 18 \text{ dollars}
_WRAPPED = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{(.*)\}")  # a whole answer in \text{(C)}
_MIXED = re.compile(r"(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}")  # 2\frac{1}{4}: two and a quarter


def _balanced(text: str) -> bool:
    depth = 0
    for c in text:
        depth += {"{": 1, "}": -1}.get(c, 0)
        if depth < 0:
            return False
    return depth == 0


def _canonical(text: str) -> str:
    """An answer as written, without what LaTeX may vary: spacing, ``\\left``/``\\right``, ``\\dfrac``, dollar
    signs, ``{,}`` thousands, a unit in ``\\text{...}`` after it or a ``\\text{...}`` around it, a space after a
    sign, the parentheses of a choice ``(C)``."""
    text = _UNITS.sub("", text.strip().replace("\u2212", "-"))
    while (whole := _WRAPPED.fullmatch(text.strip())) is not None and _balanced(whole.group(1)):
        text = whole.group(1)  # (not "\text{a} or \text{b}": its inner "a} or \text{b" is not one group)
    for noise in _LATEX_NOISE:
        text = text.replace(noise, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    return re.sub(r"^\(([A-Za-z])\)$", r"\1", re.sub(r"\s+", "", text))  # a choice "(C)" is "C"


def _to_number(text: str) -> Fraction | None:
    """The number an answer or label writes (a LaTeX fraction, a thousands-separated or signed number, ``$...$``,
    a percent or degree sign, a unit, an ``x = `` in front), else None."""
    text = re.sub(r"^[A-Za-z]\w?=", "", _canonical(text)).rstrip(".,")
    if "," in text:
        if not _THOUSANDS.fullmatch(text):
            return None  # "3,4" is two numbers, not 34
        text = text.replace(",", "")
    mixed = _MIXED.fullmatch(text)
    if mixed:
        value = int(mixed.group(2)) + Fraction(int(mixed.group(3)), int(mixed.group(4))) if int(mixed.group(4)) \
            else None
        return None if value is None else -value if mixed.group(1) else value
    frac = _FRAC.fullmatch(text)
    if frac:
        sign, num, den = frac.group(1), frac.group(2) or frac.group(3), frac.group(4) or frac.group(5)
        text = f"{sign}{num}/{den}" if not (sign and num.startswith("-")) else f"{num[1:]}/{den}"
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def math_reward(response: str, label: str) -> float:
    """1.0 when the final answer equals the label as a number (or as text when either is not a number)."""
    answer = extract_final_answer(response)
    return 0.0 if answer is None else _same_answer(answer, label)


def _same_answer(answer: str, label: str) -> float:
    """1.0 when the answer and the label (unboxed if boxed) are the same number, or the same text as
    ``_canonical`` writes both."""
    if "\\boxed" in label:
        label = _last_boxed(label) or label
    got, want = _to_number(answer), _to_number(label)
    if got is None or want is None:  # as text, whatever the case (slime's normaliser lowercases too)
        return 1.0 if _canonical(answer).lower() == _canonical(label).lower() else 0.0
    return 1.0 if got == want else 0.0


def boxed_math_reward(response: str, label: str) -> float:
    """slime's ``boxed_math``: only the last ``\\boxed{...}`` of the response counts (none: 0.0)."""
    answer = _last_boxed(strip_response(response))
    return 0.0 if answer is None else _same_answer(answer, label)


def deepscaler_reward(response: str, label: str) -> float:
    """slime's ``deepscaler`` rule: the solution is what follows ``</think>`` (or ``###Response``); 1.0 when its last
    ``\\boxed{...}`` equals the label (itself unboxed if it is boxed), else 0.0; no reasoning end marker is 0.0."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    answer = _last_boxed(solution)
    if answer is None or not label.strip():
        return 0.0
    return _same_answer(answer, label)


def _normalised_words(text: str) -> list[str]:
    """Lower case, no punctuation, no English articles: the words of an answer as F1 compares them."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def f1_reward(response: str, label: str) -> float:
    """slime's ``f1``: the F1 of the response's and the label's words (normalised as above); a yes/no/noanswer
    answer or label scores only an exact match."""
    got, want = _normalised_words(strip_response(response)), _normalised_words(label)
    if (" ".join(got) in ("yes", "no", "noanswer") or " ".join(want) in ("yes", "no", "noanswer")) and got != want:
        return 0.0
    same = sum((Counter(got) & Counter(want)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(got), same / len(want)
    return 2 * precision * recall / (precision + recall)


_DAPO_ANSWER = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_DAPO_UNITS = re.compile(r"\\(?:text|mbox|textbf|mathrm)\{([^{}]*)\}")


def dapo_reward(response: str, label: str) -> dict:
    """DAPO's rule (slime's ``dapo``): the last ``Answer: ...`` of the response's last 300 characters, normalised
    (what follows its last ``=``; no spaces, ``$``, ``\\boxed``/``\\text`` wrappers, ``{,}`` thousands, a unit
    in words after a number or a trailing period) equals the label, an integer (``42.0`` is 42; another label is
    compared as text). ``score`` +1.0 or -1.0, ``acc`` the same as a bool, ``pred`` the normalised answer
    (``None``: no answer line)."""
    found = _DAPO_ANSWER.findall(strip_response(response)[-300:])
    pred = _dapo_normal(found[-1]) if found else None
    want = _dapo_normal(label)
    try:
        number = float(want)
        want = str(int(number)) if number.is_integer() else want
    except (ValueError, OverflowError):
        pass
    acc = pred is not None and pred == want
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def _dapo_normal(answer: str) -> str:
    answer = answer.split("=")[-1]
    boxed = _last_boxed(answer)
    answer = _DAPO_UNITS.sub(r"\1", boxed if boxed is not None else answer)
    for noise in ("\\$", "$", "\\!", "\\,", "\\;", "\\ ", "{,}", "^{\\circ}", "^\\circ", "\\%", "%"):
        answer = answer.replace(noise, "")
    number_then_words = re.fullmatch(r"\s*(-?\d[\d,]*(?:\.\d+)?)\s*[A-Za-z][A-Za-z ]*[.?!]?\s*", answer)
    answer = number_then_words.group(1) if number_then_words else answer  # 18 dollars, 90 degrees
    answer = re.sub(r"\s+", "", answer).rstrip(".")
    return answer.replace(",", "") if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+", answer) else answer


_LETTER_SAID = (re.compile(r"(?i:answer|option|choice)\s*(?i:is)?\s*:?\s*\(?([A-Z])\)?(?![A-Za-z])"),
                re.compile(r"\(?([A-Z])\)?\s+(?i:is\s+(?:the\s+)?correct)"))


def gpqa_reward(response: str, label: Any, metadata: dict[str, Any]) -> float:
    """slime's ``gpqa``: 1.0 when the option letter the answer (after any ``</think>``) picks is the right one.
    The right letter is the row's ``correct_letter`` field, else a one-letter label, else an integer label (an
    index into the letters), else the letter of the choice (the row's ``choices``, a list or dict) whose text is
    the label's, else a text label of digits as an index (a data file's integer label stays an integer).
    The letters are the row's ``valid_letters``, else A.. for its choices, else A-J. The picked letter is the last
    one after "answer"/"option"/"choice" (else the last before "is correct"), else the last lone capital among the
    letters; with none, the right choice's text (or the label) inside the answer scores 1.0."""
    text = response.rsplit("</think>", 1)[-1]
    choices = metadata.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else list(choices or [])
    letters = ([str(v).strip().upper() for v in metadata["valid_letters"]] if metadata.get("valid_letters")
               else list(string.ascii_uppercase[:len(choices) or 10]))
    right = metadata.get("correct_letter")
    right = right.strip().upper() if isinstance(right, str) and right.strip() else None
    said = str(label).strip() if label is not None and not isinstance(label, (int, float)) else ""
    if right is None and said.upper() in letters:
        right = said.upper()
    elif right is None and isinstance(label, numbers.Integral) and 0 <= int(label) < len(letters):
        right = letters[int(label)]
    elif right is None and said:
        right = next((letters[i] for i, c in enumerate(choices[:len(letters)])
                      if _plain(str(c)) == _plain(said)), None)
        if right is None and said.isdigit() and int(said) < len(letters):  # digits given as text: an index
            right = letters[int(said)]
    picked = _picked_letter(text, letters)
    if picked and right:
        return 1.0 if picked == right else 0.0
    targets = [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)] + [said]
    if right in letters and letters.index(right) < len(choices):
        targets.append(str(choices[letters.index(right)]))
    plain = _plain(text)
    return 1.0 if any(t and len(t) > 1 and _plain(t) in plain for t in targets) else 0.0


def _picked_letter(text: str, letters: list[str]) -> str | None:
    """The letter the response settles on: the last of the first pattern that names a choice (a reasoning text
    weighs options before it concludes), else its last lone capital that is a choice."""
    for pattern in _LETTER_SAID:
        said = [m.group(1) for m in pattern.finditer(text) if m.group(1) in letters]
        if said:
            return said[-1]
    return next((c for c in reversed(re.findall(r"\b([A-Z])\b", text)) if c in letters), None)


def _plain(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


_BUILTIN: dict[str, Callable[[str, str], float | dict]] = {
    "addition": addition_reward, "math": math_reward, "boxed_math": boxed_math_reward,
    "deepscaler": deepscaler_reward, "dapo": dapo_reward, "f1": f1_reward}
_WITH_METADATA = {"gpqa": gpqa_reward}  # (response, label as the data has it, the row's fields)
# boxed_<type>: the last \boxed{...} of the response scored by <type> (boxed_math is its own: the same with math's
# comparison of the boxed text as it is)
_BOXABLE = tuple(t for t in (*_BUILTIN, *_WITH_METADATA) if t != "boxed_math")


def known_rm_type(name: Any) -> bool:
    """A reward type --rm-type or a row's rm_type field may name: RM_TYPES or ``boxed_`` + a rule-based one."""
    return name in RM_TYPES or (isinstance(name, str) and name.startswith("boxed_") and name[6:] in _BOXABLE)


def rm_type_arg(value: str) -> str:
    """argparse type of --rm-type."""
    import argparse

    if not known_rm_type(value):
        raise argparse.ArgumentTypeError(_unknown_rm_type(value))
    return value


def _unknown_rm_type(name: Any) -> str:
    hint = (" (slime's ifbench needs its instruction checkers, which are not built in: score it with "
            "--custom-rm-path)" if isinstance(name, str) and name.endswith("ifbench") else "")
    return (f"{name!r} is not a reward type: choose one of {', '.join(RM_TYPES)}, or boxed_<type> for "
            f"{', '.join(_BOXABLE)}{hint}")


def sample_rm_type(args: Any, sample: Sample) -> str | None:
    """The reward type of a sample: its metadata's ``rm_type`` (a data field: mixed data sets), else --rm-type."""
    return _row_rm_type(sample.metadata) or args.rm_type


def _row_rm_type(meta: dict[str, Any]) -> Any:
    """A row's ``rm_type`` field, stripped; None when absent or blank (the row then has --rm-type)."""
    rm_type = meta.get("rm_type")
    return (rm_type.strip() or None) if isinstance(rm_type, str) else rm_type


async def remote_reward(args: Any, sample: Sample) -> float | dict:
    """``remote_rm``: POST ``{"prompt", "response", "label"}`` to --rm-url; the JSON answer (a number or a dict) is
    the reward. A connection error, a timeout or a 5xx answer is retried with backoff; a 4xx answer is not."""
    import aiohttp  # aiohttp: only with a remote reward model

    body = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    timeout = aiohttp.ClientTimeout(total=args.rollout_request_timeout)
    limit = _REMOTE_LIMITS.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(REMOTE_RM_CONCURRENCY))
    async with limit:
        return await _post_reward(args, sample, body, timeout)


async def _post_reward(args: Any, sample: Sample, body: dict[str, Any], timeout: Any) -> float | dict:
    """One sample's POST, sent again (with backoff) while the answer may change."""
    import aiohttp

    error = ""
    for attempt in range(REMOTE_RM_ATTEMPTS):
        if attempt:
            await asyncio.sleep(0.5 * 2 ** (attempt - 1))
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session, \
                    session.post(args.rm_url, json=body) as resp:
                text = await resp.text()
                if resp.status < 400:
                    reward = _parse_reward(text)
                    if reward is not None:
                        return reward
                    raise SlimeLiteError(f"--rm-url {args.rm_url}: sample {sample.index}: the answer is not a "
                                         f"JSON number or object: {text[:200]!r}.")
                error = f"HTTP {resp.status}: {text[:200]}"
                if resp.status < 500:
                    break  # the request itself is wrong: sending it again gives the same answer
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    raise SlimeLiteError(f"--rm-url {args.rm_url}: sample {sample.index}: the reward model did not answer "
                         f"({error}; {attempt + 1} attempt(s)).")


def _parse_reward(text: str) -> float | dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(value, dict):
        return value
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None


@functools.lru_cache(maxsize=None)
def _custom_rm(path: str) -> Callable[..., Any]:
    return load_hook(path, "--custom-rm-path")


async def compute_reward(args: Any, sample: Sample, **kwargs: Any) -> float | dict:
    """The reward of one sample: ``--custom-rm-path`` when set, else the built-in ``--rm-type``."""
    custom = args.custom_rm_path
    if custom:
        reward = await call_maybe_async(_custom_rm(custom), args, sample, **kwargs)
        if isinstance(reward, dict):
            return reward
        if not isinstance(reward, numbers.Real):
            raise SlimeLiteError(
                f"--custom-rm-path {custom}: returned {type(reward).__name__}; it must return a float or a dict."
            )
        return float(reward)
    rm_type = sample_rm_type(args, sample)
    if rm_type == "remote_rm":
        return await remote_reward(args, sample)
    if rm_type is None:  # (checked before the run, unless a generate hook may set the rewards)
        raise SlimeLiteError(f"sample {sample.index} has no reward: its generate hook set none, its data has no "
                             "rm_type field and no --rm-type is given; give --rm-type or --custom-rm-path, or set "
                             "sample.reward in the hook.")
    if not known_rm_type(rm_type):
        where = (f"--rm-type {rm_type!r}" if rm_type == args.rm_type
                 else f"sample {sample.index}: its data's rm_type field {rm_type!r}")
        raise SlimeLiteError(f"{where}: {_unknown_rm_type(rm_type)}; or give --custom-rm-path module.fn.")
    response = sample.response
    if rm_type.startswith("boxed_") and rm_type != "boxed_math":
        rm_type, response = rm_type[6:], _last_boxed(strip_response(response)) or ""
    if rm_type in _WITH_METADATA:
        _label(sample)  # a label is needed
        return _WITH_METADATA[rm_type](response, sample.label, sample.metadata)
    return _BUILTIN[rm_type](response, _label(sample))


NO_REWARD_HOOK = "slime_lite.rollout.calc_task.generate"  # a built-in generate hook that sets no reward


def check_data_rm_types(args: Any, metadata: list[dict[str, Any]], where: str, eval_data: bool = False) -> None:
    """Before any rollout: every row's rm_type field names a reward type (remote_rm only with --rm-url); a row
    without one needs --rm-type, unless a --custom-generate-function-path hook may set ``sample.reward`` itself (as
    slime's agent examples do); a type whose reward is a dict (dapo) needs --reward-key."""
    if args.custom_rm_path:
        return  # the custom reward model reads the field, if it wants
    hook = args.custom_generate_function_path
    hook_rewards = hook and hook != NO_REWARD_HOOK  # (the tool task's hook leaves rewards to the reward model)
    unscored = sum(_row_rm_type(meta) is None for meta in metadata) if args.rm_type is None else 0
    if unscored and hook_rewards:
        log.warning("%s: %d prompts have no rm_type field and no --rm-type is given: --custom-generate-function-path "
                    "%s must set sample.reward on their samples (a sample left without one stops the run)", where,
                    unscored, hook)
    for i, meta in enumerate(metadata):
        rm_type = _row_rm_type(meta)
        if rm_type is None and args.rm_type is None and not hook_rewards:
            raise SlimeLiteError(f"{where}: prompt {i} has no rm_type field and no --rm-type is given: give "
                                 "--rm-type (the reward of rows without the field) or --custom-rm-path.")
        if rm_type is not None and not known_rm_type(rm_type):
            raise SlimeLiteError(f"{where}: prompt {i}: its rm_type {_unknown_rm_type(rm_type)} "
                                 "(or use --custom-rm-path).")
        if rm_type == "remote_rm" and not args.rm_url:
            raise SlimeLiteError(f"{where}: prompt {i} has rm_type remote_rm: give the reward model's --rm-url.")
        key = (eval_data and args.eval_reward_key) or args.reward_key
        if (rm_type or args.rm_type or "").removeprefix("boxed_") == "dapo" and not key:
            raise SlimeLiteError(f"{where}: prompt {i} is scored by dapo, whose reward is the dict "
                                 "{score, acc, pred}: give --reward-key score (as slime's DAPO scripts do).")


def check_data_labels(args: Any, prompts: list[Any], where: str, label_flag: str = "--label-key") -> None:
    """Before any rollout: a row a built-in reward type scores (not remote_rm, no --custom-rm-path) has a label it
    can compare with, text or a number (a list or object label is for a custom reward model)."""
    if args.custom_rm_path:
        return
    for p in prompts:
        if (_row_rm_type(p.metadata) or args.rm_type) == "remote_rm":
            continue
        if p.label is None or isinstance(p.label, (list, dict)):
            what = "no label" if p.label is None else f"a {type(p.label).__name__} label"
            kind = _row_rm_type(p.metadata) or args.rm_type
            raise SlimeLiteError(f"{where}:{p.line}: {what}; rm_type {kind} compares the response with a "
                                 f"text or number label (set {label_flag} to the field that holds it, or score with "
                                 "--custom-rm-path).")


async def compute_group_rewards(args: Any, samples: list[Sample]) -> list[float | dict]:
    """--group-rm: the rewards of one prompt's group; a custom reward model gets the whole list at once (slime's
    batched reward model, e.g. one that ranks the responses) and returns one reward per sample."""
    custom = args.custom_rm_path
    if not custom:
        return list(await asyncio.gather(*(compute_reward(args, s) for s in samples)))
    rewards = await call_maybe_async(_custom_rm(custom), args, samples)
    if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
        got = f"{len(rewards)} values" if isinstance(rewards, (list, tuple)) else type(rewards).__name__
        raise SlimeLiteError(f"--custom-rm-path {custom} with --group-rm: returned {got} for a group of "
                             f"{len(samples)}; it must return one reward (a float or a dict) per sample.")
    bad = [r for r in rewards if not isinstance(r, (dict, numbers.Real))]
    if bad:
        raise SlimeLiteError(f"--custom-rm-path {custom} with --group-rm: returned a {type(bad[0]).__name__} "
                             "reward; each must be a float or a dict.")
    return [r if isinstance(r, dict) else float(r) for r in rewards]
