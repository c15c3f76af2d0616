"""A black-box agent for the calculator task, written against the official openai client (chat completions with
one tool). slime-lite gives it a base URL per trajectory and trains on the tokens the engine produced:

    --custom-generate-function-path examples.calc_agent.generate
    --custom-rm-path slime_lite.rollout.calc_task.reward

(scripts/run-tiny-agent-grpo.sh). Nothing below knows about slime-lite but the last line.
"""

import json
import re

from openai import AsyncOpenAI

from slime_lite.rollout.agent_endpoint import openai_agent

CALC = {"type": "function", "function": {
    "name": "calc", "description": "Work out one operation of two integers, e.g. 12*34.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}


def calc(expr: str) -> str:
    m = re.fullmatch(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*", expr)
    if m is None:
        return "error: expr must be one operation of two integers, e.g. 12*34"
    x, op, y = int(m[1]), m[2], int(m[3])
    return str(x + y if op == "+" else x - y if op == "-" else x * y)


async def run(base_url: str, task) -> str:
    async with AsyncOpenAI(base_url=base_url, api_key="unused") as client:  # closed: no connection left open
        messages = [{"role": "user", "content": task.prompt}]
        for _ in range(5):
            reply = (await client.chat.completions.create(model="policy", messages=messages,
                                                          tools=[CALC])).choices[0]
            messages.append(reply.message)
            if not reply.message.tool_calls:
                return reply.message.content or ""
            for call in reply.message.tool_calls:
                result = calc(json.loads(call.function.arguments).get("expr", ""))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


generate = openai_agent(run)
