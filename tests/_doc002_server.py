"""A rollout server written from reference doc 002's text alone, for the conformance test.

It imports nothing of lightning_nb (the point: what a third party builds from the doc must work with the kit).
It follows the doc's ``RolloutSession`` as written: tokenize the messages with the model's chat template (the
cached ``GET /tools`` definitions passed to it), ``response_mask = [0] * num_new_tokens`` (None on the first turn
or when nothing was added), a callback body ``{rollout_id, messages, response_mask, tools, sampling params...}``,
``last_prompt_length = current_prompt_length + len(reply["token_ids"])`` (the reply's top-level ``token_ids``),
tool calls from ``choices[0].message.tool_calls`` run until a reply makes none, ``max_turns``, the response
``{rollout_id, status, final_messages, finish_reason, metrics}`` and the error format
``{rollout_id, status: "ERROR", error_message, final_messages: []}``.

Its calculator answers a JSON object (``{"operation", "a", "b", "result"}``) and its assistant messages carry
``content: ""`` rather than null (SmolLM2's chat template cannot concatenate a null content).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
from fastapi import FastAPI, Request


def _tool(name, description):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}


TOOLS = [_tool("add", "Add two numbers"), _tool("subtract", "Subtract b from a"),
         _tool("multiply", "Multiply two numbers"), _tool("divide", "Divide a by b")]
OPS = {"add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b,
       "divide": lambda a, b: a / b}


async def execute_tool(call):
    name = call["function"]["name"]
    try:
        args = call["function"].get("arguments") or "{}"
        args = json.loads(args) if isinstance(args, str) else args
        a, b = float(args["a"]), float(args["b"])
        result = OPS[name](a, b)
    except Exception as exc:  # the model reads the error
        return json.dumps({"operation": name, "error": f"{type(exc).__name__}: {exc}"})
    return json.dumps({"operation": name, "a": a, "b": b, "result": result})


class RolloutSession:
    def __init__(self, request, tokenizer, tools, lock):
        self.request, self.tokenizer, self.tools, self.lock = request, tokenizer, tools, lock
        self.messages = list(request["messages"])
        self.last_prompt_length = 0  # CRITICAL for mask calculation
        self.server_url = request["server_url"]
        key = request.get("callback_api_key")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.masks = []  # what each call sent, for the test to read

    async def call_llm(self, client, sampling_params):
        with self.lock:
            current_prompt = self.tokenizer.apply_chat_template(
                self.messages, tools=self.tools, add_generation_prompt=True, tokenize=True, return_dict=False)
        current_prompt_length = len(current_prompt)
        num_new_tokens = current_prompt_length - self.last_prompt_length
        response_mask = [0] * num_new_tokens if self.last_prompt_length and num_new_tokens > 0 else None
        self.masks.append(response_mask)
        response = await client.post(
            f"{self.server_url}/v1/chat/completions", headers=self.headers,
            json={"rollout_id": self.request["rollout_id"], "messages": self.messages, "tools": self.tools,
                  "response_mask": response_mask, **sampling_params})
        if response.status_code != 200:
            raise RuntimeError(f"trainer answered {response.status_code}: {response.text[:500]}")
        reply = response.json()
        self.last_prompt_length = current_prompt_length + len(reply["token_ids"])
        return reply


def make_app(tokenizer):
    """The doc's FastAPI server: ``GET /tools`` and ``POST /rollout``; ``app.state.sessions`` keeps every session."""
    app = FastAPI()
    app.state.sessions = []
    lock = threading.Lock()

    @app.get("/tools")
    async def tools():
        return {"tools": TOOLS}

    @app.post("/rollout")
    async def rollout(request: Request):
        req = await request.json()
        session = RolloutSession(req, tokenizer, req.get("tools") or TOOLS, lock)
        app.state.sessions.append(session)
        metrics = {"num_llm_calls": 0, "num_tool_calls": 0}
        t0 = time.perf_counter()
        finish_reason = "max_turns"
        try:
            async with httpx.AsyncClient(timeout=300) as client:
                for _ in range(req.get("max_turns", 10)):
                    reply = await session.call_llm(client, req["sampling_params"])
                    metrics["num_llm_calls"] += 1
                    message = reply["choices"][0]["message"]
                    calls = message.get("tool_calls") or []
                    session.messages.append({"role": "assistant", "content": message.get("content") or "",
                                             **({"tool_calls": calls} if calls else {})})
                    if not calls:
                        finish_reason = "stop"
                        break
                    results = await asyncio.gather(*(execute_tool(c) for c in calls))
                    metrics["num_tool_calls"] += len(calls)
                    session.messages += [{"role": "tool", "tool_call_id": c["id"], "content": r}
                                         for c, r in zip(calls, results)]
        except Exception as exc:
            return {"rollout_id": req["rollout_id"], "status": "ERROR", "error_message": str(exc),
                    "final_messages": []}
        metrics["total_latency_ms"] = (time.perf_counter() - t0) * 1e3
        return {"rollout_id": req["rollout_id"], "status": "COMPLETED", "final_messages": session.messages,
                "finish_reason": finish_reason, "metrics": metrics}

    return app
