"""How often SmolLM2-135M-Instruct writes a tool call that ``parse_tool_calls`` accepts.

Run from the repo root with the project's venv::

    .venv/bin/python bench/tool_call_rate.py                  # TOOL_SYSTEM_PROMPT as shipped, 40 questions
    .venv/bin/python bench/tool_call_rate.py -n 48 --variants shipped plain oneshot_fixed

Workload: the default engine (``TransformersEngine.from_default()``, in-process, no proxy). For each
prompt variant, tool_choice (``auto``, ``required``) and temperature (0.0, 1.0), ``n`` arithmetic questions
("What is 17 * 23?", "Compute 48 + 95.", ... from a fixed seed, all different so that greedy decoding does
not repeat one answer n times) are rendered with :func:`lightning_nb.engines.chat_format.render_tools` with one
``calculator`` tool (``expression: string``), tokenized with the engine's chat template and completed with
``max_tokens`` (default 64), all submitted at once so the engine batches them. A reply counts as a *call*
when ``parse_tool_calls(text, ["calculator"])`` returns at least one call, and as *good* when that call's
arguments hold a non-empty string ``expression`` that :func:`lightning_nb.tasks.calc.calculator` evaluates
(no error). ``--system`` adds the application's own system message before rendering (frameworks send one:
AutoGen's default is shown with ``--system autogen``).

Variants are alternative ``(TOOL_SYSTEM_PROMPT, TOOL_HINT_AUTO, TOOL_HINT)`` texts (placeholders ``{tools}``
and ``{example}``; see ``render_tools``); ``shipped`` is what ``lightning_nb/engines/chat_format.py`` holds. The script
patches those module constants for each variant in turn and prints one table row per
(variant, tool_choice, temperature).

Measured on the 2-core dev VM (other jobs running beside it), 40 questions per row, max_tokens=64, no
application system message (share of replies with a parsed call; "good": its expression evaluates)::

    variant        tool_choice  T=0.0 call/good   T=1.0 call/good
    shipped        auto         35% / 33%         2.5% / 0%
    shipped        required     35% / 33%         0% / 0%
    original       auto         0% / 0%           0% / 0%
    original       required     0% / 0%           0% / 0%
    oneshot        auto         0% / 0%           0% / 0%

Earlier rounds (16 questions): ``original``, ``oneshot``, ``oneshot_short`` and SmolLM2's own
function-calling system prompt all 0/16 at both temperatures; the hint alone (``hint_only``) 3/8 greedy.
In the request layouts of the agent frameworks (``tests/test_framework_agents.py``; 20 questions, greedy,
first reply): LangGraph (no system message, auto) 9/20, OpenAI Agents SDK (instructions + strict schema,
required) 10/20, AutoGen (its default system message, auto) 4/20 with the shipped rendering; before the
tools were moved ahead of the application's system text and the schemas compacted: 10/20, 0/20, 0/20.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lightning_nb.engines import chat_format  # noqa: E402
from lightning_nb.tasks.calc import calculator  # noqa: E402

CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

SYSTEMS = {
    "none": None,
    "helpful": "You are a helpful assistant.",
    "autogen": "You are a helpful AI assistant. Solve tasks using your tools. Reply with TERMINATE when the task "
               "has been completed.",
}

# Candidate wordings tried while choosing the shipped ones: (TOOL_SYSTEM_PROMPT, TOOL_HINT_AUTO, TOOL_HINT).
# A hint is put in front of the user's question; "" means none.
_ORIGINAL = (
    "You can call these tools. Their JSON schemas are inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a tool, reply with only this, and nothing else:\n"
    "<tool_call>\n{{\"name\": \"TOOL_NAME\", \"arguments\": {{ARGUMENTS_AS_JSON}}}}\n</tool_call>\n"
    "A tool's result comes back inside <tool_response></tool_response>. "
    "When you know the answer, reply with plain text."
)
_ONESHOT = (
    "You can call these tools. Their JSON schemas are inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a tool, reply with only a <tool_call> block, and nothing else. For example:\n"
    "{example}\n"
    "A tool's result comes back inside <tool_response></tool_response>. "
    "When you know the answer, reply with plain text."
)
_HINT = "Reply with a <tool_call> block, like:\n{example}\n\n"
VARIANTS = {
    "original": (_ORIGINAL, "", ""),                      # the first wording: schemas + format in the system message
    "oneshot": (_ONESHOT, "", ""),                        # + a worked example call in the system message
    "oneshot_short": ("# Tools\n<tools>\n{tools}\n</tools>\nCall a tool by writing exactly:\n{example}\n"
                      "The result comes back in <tool_response></tool_response>. Then answer in plain text.", "", ""),
    "hint_only": (_ORIGINAL.replace("this, and nothing else:\n<tool_call>\n{{\"name\": \"TOOL_NAME\", \"arguments\": "
                                    "{{ARGUMENTS_AS_JSON}}}}\n</tool_call>", "a <tool_call> block, and nothing else."),
                  _HINT, _HINT),                          # hint before the question, no example in the system message
    "oneshot_hint": (_ONESHOT, _HINT, _HINT),             # both (what ships)
    "soft_auto": (_ONESHOT, "If a tool helps, reply with a <tool_call> block, like:\n{example}\n\n", _HINT),
}

QUESTION_FORMS = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "How much is {a} {op} {b}?",
                  "Calculate {a} {op} {b}.", "What does {a} {op} {b} equal?"]


def questions(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        q = rng.choice(QUESTION_FORMS).format(a=rng.randint(2, 99), op=rng.choice("+-*/"), b=rng.randint(2, 99))
        if q not in out:
            out.append(q)
    return out


def classify(text: str) -> tuple[bool, bool]:
    """(a call was parsed, its expression evaluates)."""
    _content, calls = chat_format.parse_tool_calls(text, ["calculator"])
    if not calls:
        return False, False
    import json

    expr = json.loads(calls[0]["function"]["arguments"]).get("expression")
    good = isinstance(expr, str) and bool(expr.strip()) and not calculator(expr).startswith("error")
    return True, good


def measure(engine, qs: list[str], tool_choice: str, temperature: float, max_tokens: int,
            system: str | None) -> tuple[int, int, list[str]]:
    futures = []
    for q in qs:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
        rendered = chat_format.render_tools(msgs, [CALCULATOR_TOOL], tool_choice)
        ids = engine.apply_chat_template(rendered)
        futures.append(engine.submit(ids, max_tokens=max_tokens, temperature=temperature))
    texts = [f.result().text for f in futures]
    results = [classify(t) for t in texts]
    return sum(c for c, _ in results), sum(g for _, g in results), texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=40, help="questions per cell (default 40)")
    parser.add_argument("--variants", nargs="+", default=["shipped"], choices=["shipped", *VARIANTS])
    parser.add_argument("--choices", nargs="+", default=["auto", "required"], choices=["auto", "required"])
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--system", default="none", choices=sorted(SYSTEMS))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--show", type=int, default=0, help="print this many replies per cell")
    args = parser.parse_args(argv)

    from lightning_nb.engines.transformers import TransformersEngine

    engine = TransformersEngine.from_default(max_batch_size=16)
    qs = questions(args.n)
    shipped = (chat_format.TOOL_SYSTEM_PROMPT, chat_format.TOOL_HINT_AUTO, chat_format.TOOL_HINT)
    rows = []
    try:
        for variant in args.variants:
            (chat_format.TOOL_SYSTEM_PROMPT, chat_format.TOOL_HINT_AUTO,
             chat_format.TOOL_HINT) = shipped if variant == "shipped" else VARIANTS[variant]
            for choice in args.choices:
                for temp in args.temperatures:
                    t0 = time.perf_counter()
                    calls, good, texts = measure(engine, qs, choice, temp, args.max_tokens, SYSTEMS[args.system])
                    rows.append((variant, choice, temp, calls, good, time.perf_counter() - t0))
                    print(f"{variant:14s} {choice:8s} T={temp:<4} calls {calls}/{len(qs)}  good {good}/{len(qs)}  "
                          f"({rows[-1][-1]:.0f} s)", file=sys.stderr, flush=True)
                    for t in texts[:args.show]:
                        print("   |", t.replace("\n", "\\n")[:200], file=sys.stderr)
    finally:
        chat_format.TOOL_SYSTEM_PROMPT, chat_format.TOOL_HINT_AUTO, chat_format.TOOL_HINT = shipped
        engine.stop()
    print(f"\nSmolLM2-135M-Instruct, {len(qs)} questions per row, max_tokens={args.max_tokens}, "
          f"system={args.system!r}")
    print(f"| {'variant':14s} | tool_choice | temperature | parsed call | good call |")
    print(f"|{'-' * 16}|-------------|-------------|-------------|-----------|")
    for variant, choice, temp, calls, good, _ in rows:
        print(f"| {variant:14s} | {choice:11s} | {temp:11.1f} | {calls / len(qs):11.0%} | {good / len(qs):9.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
