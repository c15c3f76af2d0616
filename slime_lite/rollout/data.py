"""Prompt data: a JSONL or Parquet file read once, served in a reproducible (optionally shuffled) order with a resumable cursor."""

from __future__ import annotations

import json
import logging
import os
import random
import re
from dataclasses import dataclass
from typing import Any

from slime_lite.errors import SlimeLiteError
from slime_lite.rollout.turns import AGE_MASKED, INSERTED_CUT, RESTARTED
from slime_lite.types import (ENGINE_CUTS, FILTER_PASSED, FINISHED_BEFORE, LEADING_UNVERSIONED, POST_PROCESSED_REWARD,
                              REFUSED, TOKEN_VERSIONS, TRAJECTORY_END)

log = logging.getLogger(__name__)

# Sample metadata keys slime-lite itself writes and reads (the prompt's rendering, multi-turn turns and messages, the
# weight version of each token, ...): a data field of one of these names would be read as that, so it is left out.
RESERVED_METADATA = frozenset({
    "prompt_index", "prompt_text", "turns", "messages", "tool_calls", "tool_errors", "malformed_tool_calls",
    "sampling_params", "generation_time", "failure", "truncated_by", "agent_error", "start_rollout_id",
    TOKEN_VERSIONS, FINISHED_BEFORE, RESTARTED, LEADING_UNVERSIONED, AGE_MASKED, INSERTED_CUT, ENGINE_CUTS, REFUSED,
    POST_PROCESSED_REWARD, TRAJECTORY_END, FILTER_PASSED})


@dataclass
class Prompt:
    index: int
    prompt: str | list[dict[str, str]]
    label: Any  # text (a number label as its text); a list or dict (e.g. test cases) as the data has it, as in slime
    metadata: dict[str, Any]
    line: int = 0  # its line (row) in the file, for errors


_SLICE = re.compile(r"^(?P<path>.*)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")  # slime's data.jsonl@[0:1000]


def data_file(path: str) -> str:
    """The file a prompt-data path reads: PATH of ``PATH@[start:end]`` (unless a file has the whole name), else
    ``path`` itself."""
    part = _SLICE.match(path)
    return path if part is None or os.path.exists(path) else part["path"]


def _rows(path: str, flag: str) -> Any:
    """(line or row number, row) of a prompt file; as slime, ``PATH@[start:end]`` (a file of that name does not
    exist) is the rows ``start:end`` of PATH, Python's slice of its non-empty rows (negative bounds too)."""
    part = _SLICE.match(path)
    if part is None or data_file(path) == path:
        return _file_rows(path, flag)
    return list(_file_rows(part["path"], flag))[slice(*(int(x) if x else None for x in (part["start"],
                                                                                          part["end"])))]


def _file_rows(path: str, flag: str) -> Any:
    """(line or row number, row) of a JSONL file, or of a Parquet file (``.parquet``, as slime reads them)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # pyarrow: only for parquet prompt files

        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
            raise SlimeLiteError(f"{flag} {path}: cannot read it as Parquet ({exc}).") from None
        yield from enumerate(rows, 1)
        return
    try:
        # utf-8-sig: a byte-order mark (editors on Windows write one) is not part of the first line. Lines end at a
        # newline only (\n, \r\n or \r, read as \n): str.splitlines would also split inside a JSON string at
        # U+2028, U+2029 or U+0085, which JSON writers leave unescaped (ensure_ascii=False): invalid JSON then.
        lines = open(path, encoding="utf-8-sig").read().split("\n")
    except OSError as exc:
        raise SlimeLiteError(f"{flag} {path}: cannot read ({exc.strerror}).") from None
    except UnicodeDecodeError:
        raise SlimeLiteError(f"{flag} {path}: not a UTF-8 JSONL file (Parquet files must end in .parquet).") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise SlimeLiteError(f"{flag} {path}:{lineno}: not valid JSON ({exc.msg}).") from None


def _row_metadata(row: dict[str, Any], keys: DataKeys) -> dict[str, Any]:
    """A row's fields other than the prompt and the label, with the entries of its ``--metadata-key`` dict at the top
    (as slime makes that field the sample's metadata)."""
    meta = {k: v for k, v in row.items() if k not in (keys.input_key, keys.label_key, keys.tool_key)}
    nested = meta.get(keys.metadata_key)
    if isinstance(nested, dict):
        del meta[keys.metadata_key]
        meta.update(nested)
    return meta


def _tools(row: dict[str, Any], keys: DataKeys, where: str) -> list[Any] | None:
    """The row's ``--tool-key`` field: a list of tool schemas (or its JSON text, as slime reads it); None without."""
    tools = row.get(keys.tool_key) if keys.tool_key else None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise SlimeLiteError(f"{where}: the {keys.tool_key!r} field is text but not JSON ({exc.msg}); "
                                 f"{keys.tool_flag} names the field of a list of tool schemas.") from None
    if tools is not None and not isinstance(tools, list):
        raise SlimeLiteError(f"{where}: the {keys.tool_key!r} field is a {type(tools).__name__}, not a list of tool "
                             f"schemas (set {keys.tool_flag} to the field that holds them).")
    return tools


@dataclass(frozen=True)
class DataKeys:
    """The fields of a prompt file's rows (slime's --input-key, --label-key, --metadata-key, --tool-key)."""
    input_key: str = "prompt"
    label_key: str | None = "label"
    metadata_key: str = "metadata"
    tool_key: str | None = "tools"
    input_flag: str = "--input-key"  # the flags that set them, named in errors
    tool_flag: str = "--tool-key"
    label_flag: str = "--label-key"

    @classmethod
    def from_args(cls, args: Any, evaluation: bool = False) -> DataKeys:
        """The train data's keys, or the eval data's (each --eval-*-key, else the train data's)."""
        def pick(name: str) -> Any:
            value = getattr(args, f"eval_{name}", None) if evaluation else None
            return getattr(args, name) if value is None else value
        pre = "--eval-" if evaluation else "--"
        return cls(pick("input_key"), pick("label_key"), args.metadata_key, pick("tool_key"),
                   f"{pre}input-key", f"{pre}tool-key", f"{pre}label-key")


def _check_prompt(value: Any, where: str, keys: DataKeys) -> None:
    """A prompt is non-empty text, or a non-empty list of chat messages (objects with a string role)."""
    if isinstance(value, str) and value.strip():
        return
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str) and
                                                 isinstance(m.get("content"), (str, list, type(None))) for m in value):
        return
    what = "empty text" if isinstance(value, str) else "an empty list" if value == [] else (
        "a list that is not of chat messages ({\"role\": ..., \"content\": ...})" if isinstance(value, list)
        else f"a {type(value).__name__}")
    raise SlimeLiteError(f"{where}: the {keys.input_key!r} field is {what}; a prompt is text or a list of chat "
                         f"messages (set {keys.input_flag} to the field that holds it, or fix the row).")


def read_prompts(path: str, keys: DataKeys = DataKeys(), flag: str = "--prompt-data") -> list[Prompt]:
    prompts = []
    reserved: set[str] = set()
    input_key, label_key = keys.input_key, keys.label_key
    for lineno, row in _rows(path, flag):
        if not isinstance(row, dict) or input_key not in row:
            raise SlimeLiteError(
                f"{flag} {path}:{lineno}: no {input_key!r} key (set {keys.input_flag} to the prompt's key; "
                f"this line has {sorted(row) if isinstance(row, dict) else type(row).__name__})."
            )
        label = row.get(label_key) if label_key else None
        _check_prompt(row[input_key], f"{flag} {path}:{lineno}", keys)
        tools = _tools(row, keys, f"{flag} {path}:{lineno}")
        meta = _row_metadata(row, keys)
        # "tools" holds the --tool-key field's tools (what the template renders): another field of that name (a
        # data field when the key names another, one inside --metadata-key's dict) is left out, said below
        ours = RESERVED_METADATA | {"tools"}
        reserved.update(k for k in meta if k in ours)
        meta = {k: v for k, v in meta.items() if k not in ours}
        if tools is not None:
            meta["tools"] = tools  # as slime keeps them: a custom generate function's tools
        if isinstance(label, float) and label.is_integer():
            label = int(label)  # 85.0 in the data is the answer 85
        # an integer stays one, as slime keeps it (gpqa reads it as the right choice's index; the text rewards
        # compare its digits); other scalars become text
        if label is not None and (isinstance(label, bool) or not isinstance(label, (int, list, dict))):
            label = str(label)
        prompts.append(Prompt(len(prompts), row[input_key], label, meta, lineno))
    if not prompts:
        raise SlimeLiteError(f"{flag} {path}: the file has no prompts.")
    if reserved:
        log.warning("%s %s: the data fields %s are left out of the samples' metadata: slime-lite keeps its own "
                    "values under these names (rename them in the data to keep them)", flag, path, sorted(reserved))
    return prompts


class PromptSource:
    """Serves batches of prompts in epochs; ``state()``/``load_state()`` make a resumed run see the same order."""

    def __init__(self, prompts: list[Prompt], shuffle: bool, seed: int) -> None:
        self.prompts = prompts
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._make_order()
            take = self._order[self.offset : self.offset + n - len(out)]
            self.offset += len(take)
            out.extend(self.prompts[i] for i in take)
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._make_order()


def render_prompt(prompt: str | list[dict[str, str]], tokenizer: Any, apply_chat_template: bool,
                  tools: list[Any] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    """The text sent to the engine: the prompt itself, or the tokenizer's chat template with a generation prompt, the
    prompt's tools and --apply-chat-template-kwargs (both unused without the template, as in slime)."""
    if apply_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                             **(template_kwargs or {}))
    if not isinstance(prompt, str):
        raise SlimeLiteError("a prompt is a chat message list: add --apply-chat-template to render it.")
    return prompt


def encode_prompt(prompt: Prompt, tokenizer: Any, args: Any) -> tuple[str, list[int]]:
    """The text and token ids sent to the engine for a prompt: rendered as the run's flags say."""
    text = render_prompt(prompt.prompt, tokenizer, args.apply_chat_template, prompt.metadata.get("tools"),
                         args.apply_chat_template_kwargs)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


RENDER_CHECKED = 20_000  # prompts rendered before Ray starts (a template error is most often the data's shape)


def check_renders(prompts: list[Prompt], tokenizer: Any, args: Any, where: str) -> None:
    """The first ``RENDER_CHECKED`` prompts render as the run's flags say (the chat template, its kwargs, the row's
    tools); every row's shape was checked when the file was read, and every row is a text where no chat template
    renders it (a cheap check, on every row)."""
    if not args.apply_chat_template:
        listed = next((p for p in prompts if not isinstance(p.prompt, str)), None)
        if listed is not None:
            raise SlimeLiteError(f"{where}:{listed.line}: a prompt is a chat message list: add "
                                 "--apply-chat-template to render it.")
    for p in prompts[:RENDER_CHECKED]:
        try:
            render_prompt(p.prompt, tokenizer, args.apply_chat_template, p.metadata.get("tools"),
                          args.apply_chat_template_kwargs)
        except SlimeLiteError as exc:
            raise SlimeLiteError(f"{where}:{p.line}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a template error is the data's (or the flags')
            raise SlimeLiteError(f"{where}:{p.line}: the chat template cannot render this prompt "
                                 f"({type(exc).__name__}: {exc}).") from None


def drop_long_prompts(prompts: list[Prompt], limit: int | None, tokenizer: Any, args: Any,
                      where: str) -> list[Prompt]:
    """The prompts of at most ``limit`` tokens as rendered (--rollout-max-prompt-len / --eval-max-prompt-len; the
    others are left out, logged); every one longer is an error naming the flag."""
    if limit is None:
        return prompts
    kept = [p for p in prompts if len(encode_prompt(p, tokenizer, args)[1]) <= limit]
    if not kept:
        raise SlimeLiteError(f"{where}: every prompt is longer than {limit} tokens; raise the limit or drop it.")
    if len(kept) < len(prompts):
        log.info("%s: %d of %d prompts are longer than %d tokens and left out", where, len(prompts) - len(kept),
                 len(prompts), limit)
    return kept
