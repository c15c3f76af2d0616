"""Prompt data (rollout/data.py): what a JSONL file's rows become, and the sample metadata made from them."""

from __future__ import annotations

import json

from slime_lite.rollout.data import read_prompts
from slime_lite.rollout.generate import new_group
from slime_lite.rollout.stats import rollout_metrics


def _write(path, rows, encoding="utf-8") -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding=encoding)
    return str(path)


def test_a_line_separator_inside_a_json_string_does_not_split_the_line(tmp_path) -> None:
    # ensure_ascii=False leaves U+2028 / U+2029 / U+0085 unescaped: still one valid JSON line each
    path = _write(tmp_path / "p.jsonl", [{"prompt": "a\u2028b", "label": "1"},
                                         {"prompt": "c\u2029d\x85e", "label": "2"}])
    prompts = read_prompts(path, "prompt", "label")
    assert [(p.prompt, p.label) for p in prompts] == [("a\u2028b", "1"), ("c\u2029d\x85e", "2")]


def test_a_byte_order_mark_and_crlf_line_ends_are_read(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "1+1=", "label": 2}\r\n\r\n{"prompt": "2+2=", "label": 4}\r\n')
    assert [(p.prompt, p.label) for p in read_prompts(str(path), "prompt", "label")] == [("1+1=", "2"), ("2+2=", "4")]


def test_data_fields_never_pass_for_slime_lites_own_sample_metadata(tmp_path) -> None:
    """A row's other fields go into the samples' metadata (slime's ``metadata`` field's entries at the top), but a
    field named like a key slime-lite writes itself (the rendered prompt, multi-turn ``turns`` and ``messages``)
    would be read as that: the prompt index and text must be the run's, and the rollout metrics must not crash."""
    path = _write(tmp_path / "p.jsonl", [
        {"prompt": "1+1=", "label": "2", "prompt_index": 99, "prompt_text": "other", "source": "mtbench",
         "turns": ["first question", "second question"], "messages": [{"role": "user", "content": "x"}],
         "metadata": {"difficulty": 3, "rm_type": "math"}}])
    prompt = read_prompts(path, "prompt", "label")[0]
    assert prompt.metadata == {"source": "mtbench", "difficulty": 3, "rm_type": "math"}
    group = new_group(prompt, 2, 0, 0, "rendered 1+1=", [1, 2, 3])
    assert all(s.metadata["prompt_index"] == 0 and s.metadata["prompt_text"] == "rendered 1+1=" for s in group)
    for s in group:
        s.response_length, s.reward = 0, 1.0
    assert rollout_metrics(group)["rollout/raw_reward"] == 1.0


def test_a_label_keeps_its_data_type_as_in_slime(tmp_path) -> None:
    """A custom reward gets a list or dict label (test cases, several answers) as the data has it, as slime gives
    it, not its Python repr; a number label is its text, as before."""
    import asyncio

    from slime_lite.args import parser_defaults
    from slime_lite.rollout.rewards import compute_reward

    path = _write(tmp_path / "p.jsonl", [{"prompt": "a", "label": ["x", "y"]}, {"prompt": "b", "label": {"n": 1}},
                                         {"prompt": "c", "label": -3}, {"prompt": "d"}])
    prompts = read_prompts(path, "prompt", "label")
    assert [p.label for p in prompts] == [["x", "y"], {"n": 1}, "-3", None]
    group = new_group(prompts[2], 1, 0, 0, "c", [1])
    group[0].response = "so it is \\boxed{-3}."
    assert asyncio.run(compute_reward(parser_defaults(rm_type="math"), group[0])) == 1.0
