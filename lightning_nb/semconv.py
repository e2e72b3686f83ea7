"""The span schema: every span name and attribute key lightning-nb writes or reads, in one place.

The proxy, the tracer, the adapter, the store, the inspection views and the widgets all use these
constants; none writes such a key as a string literal (``tests/test_architecture.py`` checks it).
Values are plain span attributes: str, bool, int, float or lists of them; structured values (messages,
tools) are JSON text.

The naming rule for attribute keys (``tests/test_semconv.py`` checks every constant of :data:`ATTRIBUTE_KEYS`):

* an OpenTelemetry semantic convention where one means the same thing: the GenAI conventions (``gen_ai.*``,
  https://opentelemetry.io/docs/specs/semconv/gen-ai/) for the LLM call and the tool call, and the general
  ``error.*``, ``exception.*`` and ``service.*`` attributes; each is a name of the OpenTelemetry registry
  (the ``opentelemetry-semantic-conventions`` package lists them);
* ``openinference.span.kind``, the one OpenInference key, which only the OTLP export adds (Phoenix groups by it);
* ``lightning_nb.*`` for everything else: what RL needs and no convention names (token IDs, log-probs, the
  weight version, the sampling the engine applied, rewards, judges), and request fields OpenTelemetry leaves out.

Every key has a ``.``, so none is also a plain word, a DataFrame column or an OpenAI request field. Span names
are not keys: OpenTelemetry names a GenAI span ``"{operation} {model}"``, which varies with the model, while the
store, the adapter and the views select spans by a fixed name; they are the short names of :data:`SPAN_NAMES`.
Files written before this rule used bare keys (``"reward"``, ``"temperature"``, ``"logprobs"``...):
:data:`RENAMED_KEYS` lists them, and ``SqliteStore`` renames them when it opens such a file.
"""

from __future__ import annotations

__all__ = [
    "SPAN_NAMES", "ATTRIBUTE_KEYS", "RENAMED_KEYS",
    "LLM_SPAN", "REWARD_SPAN", "INTERMEDIATE_REWARD_SPAN", "AGENT_SPAN", "TOOL_SPAN_PREFIX", "HOOK_ERROR_SPAN",
    "ROLLOUT_ID", "ATTEMPT_ID",
    "SYSTEM", "AGENT_NAME", "AGENT_NAME_HEADER", "REQUEST_MODEL", "REQUEST_PREFIX", "REQUEST_TEMPERATURE",
    "REQUEST_TOP_P", "REQUEST_MAX_TOKENS", "REQUEST_SEED", "REQUEST_STOP_SEQUENCES", "REQUEST_TOOLS",
    "REQUEST_TOOL_CHOICE", "REQUEST_USER", "REQUEST_METADATA", "PROMPT", "COMPLETION", "RESPONSE_ID",
    "RESPONSE_FINISH_REASONS", "RESPONSE_TOOL_CALLS", "USAGE_INPUT_TOKENS", "USAGE_OUTPUT_TOKENS",
    "ENGINE", "CHOICE_INDEX", "CHOICES", "PROMPT_TOKEN_IDS", "COMPLETION_TOKEN_IDS", "LOGPROBS", "WEIGHT_VERSION",
    "TOKEN_IDS_MISSING", "SAMPLING_NOT_APPLIED", "WEIGHTS_CHANGED_DURING_CALL", "REQUEST_RESPONSE_MASK", "PROMPT_SPLICED",
    "TOOL_CHOICE_RESAMPLED", "ASSISTANT_TURNS_AS_SAMPLED", "ASSISTANT_TURNS_REWRITTEN", "REPLAYED_FROM", "REPLAY_DIVERGENCE",
    "APPLIED_TEMPERATURE",
    "APPLIED_TOP_P", "APPLIED_MAX_TOKENS", "APPLIED_STOP", "APPLIED_SEED", "APPLIED_SAMPLING",
    "REWARD", "REWARD_NAME", "REWARD_SOURCE", "REWARD_NOTE", "JUDGE_SPAN", "JUDGE_MODEL", "JUDGE_PROMPT",
    "JUDGE_VERDICT", "JUDGE_SCORE", "JUDGE_GROUP", "TOOL_NAME", "TOOL_INPUT", "TOOL_OUTPUT", "ERROR",
    "SEQUENCE_ID", "SPAN_KIND", "SERVICE_NAME", "HOOK", "EXCEPTION_TYPE", "EXCEPTION_MESSAGE", "EXCEPTION_STACKTRACE",
]

# ----- span names ----------------------------------------------------------------------------
#: One LLM call, written by the proxy: one span per returned choice, or one span with :data:`ERROR`
#: when the engine failed the call.
LLM_SPAN = "llm.chat.completions"
#: The final reward of an attempt (:func:`~lightning_nb.tracing.emit_reward`); the last one counts.
REWARD_SPAN = "reward"
#: One call of an LLM judge (:mod:`lightning_nb.rewards`): its prompt, verdict and score. Never an
#: :data:`LLM_SPAN`, so no trainer ever trains on the judge's tokens; ``store.rewards_df()`` lists its score as a
#: reward component named by :data:`REWARD_NAME`.
JUDGE_SPAN = "judge"
#: An intermediate (per-step) reward (:func:`~lightning_nb.tracing.emit_intermediate_reward`); never
#: named ``"reward"``, which is the final reward's name.
INTERMEDIATE_REWARD_SPAN = "intermediate_reward"
#: The root span a runner opens around one attempt of the agent.
AGENT_SPAN = "agent"
#: A tool call (:func:`~lightning_nb.tracing.tool_span`) is named ``TOOL_SPAN_PREFIX + tool name``.
TOOL_SPAN_PREFIX = "tool:"
#: An exception a runner lifecycle hook raised (:mod:`lightning_nb.runners.hooks`), one span per exception.
HOOK_ERROR_SPAN = "lightning_nb.hook_error"

# ----- ids every span carries (set by the tracer from the active rollout) ---------------------
#: The rollout id (text); set on every span of an attempt, and taken off again when the span is stored
#: (the store keeps it as the span's ``rollout_id`` field).
ROLLOUT_ID = "lightning_nb.rollout_id"
#: The attempt id (text); set and taken off like :data:`ROLLOUT_ID`.
ATTEMPT_ID = "lightning_nb.attempt_id"

# ----- LLM call: the request (OpenTelemetry GenAI conventions) --------------------------------
#: Who served the call; the proxy writes ``"lightning_nb"``.
SYSTEM = "gen_ai.system"
#: The agent that made the call, from the request header :data:`AGENT_NAME_HEADER`;
#: ``TripletAdapter(agent_match=...)`` selects on it.
AGENT_NAME = "gen_ai.agent.name"
#: HTTP request header (case-insensitive) the proxy records as :data:`AGENT_NAME`.
AGENT_NAME_HEADER = "X-Agent-Name"
#: The model name the client asked for.
REQUEST_MODEL = "gen_ai.request.model"
#: Prefix of the requested sampling parameters below (``REQUEST_PREFIX + "temperature"``...).
REQUEST_PREFIX = "gen_ai.request."
#: Sampling temperature the client asked for (float; absent when the request left it out).
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
#: ``top_p`` the client asked for (float; absent when the request left it out).
REQUEST_TOP_P = "gen_ai.request.top_p"
#: ``max_completion_tokens`` or ``max_tokens`` of the request (tokens).
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
#: ``seed`` the client asked for (int; absent when the request left it out).
REQUEST_SEED = "gen_ai.request.seed"
#: Stop strings, always a list.
REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
#: The request's ``tools`` (JSON text of the OpenAI tool definitions; OpenTelemetry's ``gen_ai.tool.definitions``).
REQUEST_TOOLS = "gen_ai.tool.definitions"
#: The request's ``tool_choice`` (JSON text).
REQUEST_TOOL_CHOICE = "lightning_nb.request.tool_choice"
#: The request's ``user`` (text; absent when empty).
REQUEST_USER = "lightning_nb.request.user"
#: The request's ``metadata`` (JSON text).
REQUEST_METADATA = "lightning_nb.request.metadata"
#: The request's messages as the client sent them, before the proxy renders tools into the prompt
#: (JSON text of a list of OpenAI chat messages, null fields left out).
PROMPT = "gen_ai.prompt"

# ----- LLM call: the response -----------------------------------------------------------------
#: The sampled text of this choice as the engine returned it (tool-call markup included, before the
#: proxy parses tool calls out of it).
COMPLETION = "gen_ai.completion"
#: The engine's response id (``""`` when it returned none).
RESPONSE_ID = "gen_ai.response.id"
#: A list with this choice's finish reason (``"stop"``, ``"length"``, ``"tool_calls"``).
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
#: Tool calls parsed from the completion (JSON text of OpenAI ``tool_calls``).
RESPONSE_TOOL_CALLS = "lightning_nb.response.tool_calls"
#: Prompt length (tokens); written with :data:`PROMPT_TOKEN_IDS` only.
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
#: Completion length (tokens); written with :data:`COMPLETION_TOKEN_IDS` only.
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
#: Why the LLM call failed (text, at most 2000 characters: the engine's error as LiteLLM reports it). A
#: span with it carries only the request model and the agent name: no completion, no token IDs. A judge span
#: carries it when the judge's call failed or its verdict had no score. (OpenTelemetry's ``error.message``.)
ERROR = "error.message"

# ----- LLM call: what RL needs (no OpenTelemetry convention) ----------------------------------
#: The engine class that served the call (``"TransformersEngine"``, ``"VLLMEngine"``...).
ENGINE = "lightning_nb.engine"
#: Index of this choice among the request's ``n`` choices.
CHOICE_INDEX = "lightning_nb.choice.index"
#: How many choices the call returned (the request's ``n``; one span each; OpenTelemetry's
#: ``gen_ai.request.choice.count``).
CHOICES = "gen_ai.request.choice.count"
#: The prompt exactly as the engine tokenized it (list of int token IDs); absent, with
#: :data:`TOKEN_IDS_MISSING` set, when the engine returned none.
PROMPT_TOKEN_IDS = "lightning_nb.prompt.token_ids"
#: The sampled tokens (list of int token IDs), the text of :data:`COMPLETION` before detokenization.
COMPLETION_TOKEN_IDS = "lightning_nb.completion.token_ids"
#: Log-probability (nats) of each completion token under the distribution it was sampled from
#: (logits / :data:`APPLIED_TEMPERATURE`, before any ``top_p`` cut; raw logits at temperature 0);
#: list of float, written only when the engine returned one per token of :data:`COMPLETION_TOKEN_IDS`.
LOGPROBS = "lightning_nb.completion.logprobs"
#: The weight version the completion was sampled with (int, the engine reports it; the version when the
#: call started if it does not). The trainer bumps it on each weight load.
WEIGHT_VERSION = "lightning_nb.weight_version"
#: The sampling temperature the engine applied (float; the rollout's, else the request's, else 1.0).
#: The adapter refuses an LLM span with token IDs but without it: the trainer scores tokens at the
#: temperature they were sampled at.
APPLIED_TEMPERATURE = "lightning_nb.sampling.temperature"
#: The nucleus-sampling ``top_p`` the engine applied (float; the rollout's, else the request's, else
#: 1.0). Always written, like :data:`APPLIED_TEMPERATURE`, and refused when missing the same way.
APPLIED_TOP_P = "lightning_nb.sampling.top_p"
#: The completion-token limit the engine applied (int, tokens; the request's capped by the rollout's,
#: 256 when neither sets one).
APPLIED_MAX_TOKENS = "lightning_nb.sampling.max_tokens"
#: The stop strings the engine applied (list of str; absent when none).
APPLIED_STOP = "lightning_nb.sampling.stop"
#: The sampling seed the engine applied (int; absent when none).
APPLIED_SEED = "lightning_nb.sampling.seed"
#: Every sampling parameter an engine can apply, as the proxy records them.
APPLIED_SAMPLING = (APPLIED_TEMPERATURE, APPLIED_TOP_P, APPLIED_MAX_TOKENS, APPLIED_STOP, APPLIED_SEED)
#: Why a call has no token IDs (text); such a call gives no triplet.
TOKEN_IDS_MISSING = "lightning_nb.token_ids_missing"
#: Keys of the rollout's ``sampling_parameters`` the proxy does not apply (sorted list of names; any key
#: other than those of :data:`APPLIED_SAMPLING`); absent when it applies them all.
SAMPLING_NOT_APPLIED = "lightning_nb.sampling_not_applied"
#: ``[WEIGHT_VERSION, version at the end of the call]`` (two ints) when new weights were loaded during
#: the call; absent otherwise.
WEIGHTS_CHANGED_DURING_CALL = "lightning_nb.weights_changed_during_call"
#: The ``response_mask`` a rollout server sent with the call (list of 0/1 ints, reference doc 002: one
#: entry per prompt token added since the previous call's prompt and completion, 0 for tokens the
#: model did not write); absent when none was sent. The proxy checked its length against the tokens
#: it served (a wrong one is a 400 and an :data:`ERROR` span instead).
REQUEST_RESPONSE_MASK = "lightning_nb.request.response_mask"
#: True when the proxy gave the engine the prompt as token IDs with the attempt's previous reply as sampled,
#: because its text re-tokenized differently (:mod:`lightning_nb.proxy.splice`); absent otherwise.
PROMPT_SPLICED = "lightning_nb.prompt.spliced"
#: How many replies without a tool call were sampled and dropped before this one to honour
#: ``tool_choice="required"`` or a named tool (int; absent when the first reply called a tool).
TOOL_CHOICE_RESAMPLED = "lightning_nb.tool_choice.resampled"
#: How many earlier assistant turns with tool calls the proxy rendered into the prompt as sampled
#: (their text as the model wrote it, so the prompt extends the previous call token for token) (int).
ASSISTANT_TURNS_AS_SAMPLED = "lightning_nb.assistant_turns.as_sampled"
#: How many earlier assistant turns with tool calls it re-wrote from ``tool_calls`` instead (the proxy no
#: longer knew their text, or the client changed the calls): each can fork the episode (int).
ASSISTANT_TURNS_REWRITTEN = "lightning_nb.assistant_turns.rewritten"
#: On a call the proxy answered from another rollout's record instead of sampling (a replay or the replayed
#: part of a branch, :mod:`lightning_nb.proxy.replay`): the recorded call's span id. Trainers never train such a
#: call's tokens again (its reply belongs to the parent); absent on a sampled call.
REPLAYED_FROM = "lightning_nb.replay.source_span_id"
#: On the :data:`ERROR` span of a call a replay refused (409) because the agent's request differs from the
#: record: JSON ``{"call": j, "field": ..., "recorded": ..., "requested": ...}``.
REPLAY_DIVERGENCE = "lightning_nb.replay.divergence"

# ----- rewards and tools ----------------------------------------------------------------------
#: The reward value (float) of a :data:`REWARD_SPAN` or :data:`INTERMEDIATE_REWARD_SPAN`.
REWARD = "lightning_nb.reward.value"
#: The component name of an intermediate reward (e.g. ``"tool_error"``).
REWARD_NAME = "lightning_nb.reward.name"
#: Who gave a final reward (text): absent when the agent returned or emitted it; ``"human"`` for
#: ``store.label(...)``, ``"judge"`` / ``"group_judge"`` for an LLM judge's score used as the reward.
REWARD_SOURCE = "lightning_nb.reward.source"
#: A note given with a label (``store.label(..., note=...)``), e.g. why a human gave that reward (text).
REWARD_NOTE = "lightning_nb.reward.note"
#: The judge's model name (text).
JUDGE_MODEL = "lightning_nb.judge.model"
#: The judge's prompt (JSON text of the chat messages sent to the judge).
JUDGE_PROMPT = "lightning_nb.judge.prompt"
#: The judge's reply, as it wrote it (text).
JUDGE_VERDICT = "lightning_nb.judge.verdict"
#: The score parsed from the verdict (float, in the rubric's range).
JUDGE_SCORE = "lightning_nb.judge.score"
#: The rollout ids a group judge scored together in one call (JSON text list), on each of their judge spans.
JUDGE_GROUP = "lightning_nb.judge.group"
#: The tool's name (text), the part of the span name after :data:`TOOL_SPAN_PREFIX`.
TOOL_NAME = "gen_ai.tool.name"
#: The tool's input (text; JSON text for structured input; OpenTelemetry's tool call arguments).
TOOL_INPUT = "gen_ai.tool.call.arguments"
#: The tool's output, set by the agent: ``span.set_attribute(TOOL_OUTPUT, result)`` (OpenTelemetry's tool
#: call result).
TOOL_OUTPUT = "gen_ai.tool.call.result"

# ----- OTLP export (lightning_nb.tracing.export; never stored) --------------------------------
#: The stored span's ``sequence_id`` (int), added to each span sent to a collector.
SEQUENCE_ID = "lightning_nb.sequence_id"
#: The OpenInference span kind Phoenix groups by (``"LLM"``, ``"TOOL"``, ``"EVALUATOR"``, ``"CHAIN"``).
SPAN_KIND = "openinference.span.kind"
#: The OpenTelemetry resource attribute naming the service (the tracer's and exporter's ``service_name``).
SERVICE_NAME = "service.name"
#: On a :data:`HOOK_ERROR_SPAN`: the hook class and callback, e.g. ``"MyHook.on_trace_end"``.
HOOK = "lightning_nb.hook"
#: OpenTelemetry's exception attributes, on a :data:`HOOK_ERROR_SPAN`: the exception type's name (text).
EXCEPTION_TYPE = "exception.type"
#: The exception's message (text).
EXCEPTION_MESSAGE = "exception.message"
#: The exception's traceback (text).
EXCEPTION_STACKTRACE = "exception.stacktrace"

# ----- the schema as a whole -------------------------------------------------------------------
#: Every span name (a tool span's name is :data:`TOOL_SPAN_PREFIX` + the tool's name).
SPAN_NAMES = (LLM_SPAN, REWARD_SPAN, JUDGE_SPAN, INTERMEDIATE_REWARD_SPAN, AGENT_SPAN, TOOL_SPAN_PREFIX,
              HOOK_ERROR_SPAN)
#: Every attribute key, under the naming rule of this module's docstring (:data:`AGENT_NAME_HEADER` is an HTTP
#: header and :data:`REQUEST_PREFIX` a prefix, neither a key).
ATTRIBUTE_KEYS = tuple(value for name, value in list(globals().items())
                       if name.isupper() and isinstance(value, str) and value not in SPAN_NAMES
                       and value not in (AGENT_NAME_HEADER, REQUEST_PREFIX))

#: The keys files written before the naming rule hold, by the span they were written on (a span name; for a tool
#: span, :data:`TOOL_SPAN_PREFIX`): the old key -> the constant that replaced it. ``SqliteStore``'s migration
#: ``005_semconv_keys`` renames them in such a file, on those spans only (an agent's own span may hold a key
#: ``"error"`` or ``"n"`` of its own). Never edit an entry (a migration that ran does not run again); a later
#: rename adds its own map and migration.
RENAMED_KEYS = {
    LLM_SPAN: {
        "error": ERROR, "engine": ENGINE, "choice_index": CHOICE_INDEX, "n": CHOICES,
        "prompt_token_ids": PROMPT_TOKEN_IDS, "completion_token_ids": COMPLETION_TOKEN_IDS, "logprobs": LOGPROBS,
        "weight_version": WEIGHT_VERSION, "temperature": APPLIED_TEMPERATURE, "top_p": APPLIED_TOP_P,
        "max_tokens": APPLIED_MAX_TOKENS, "stop": APPLIED_STOP, "seed": APPLIED_SEED,
        "gen_ai.request.tools": REQUEST_TOOLS, "gen_ai.request.tool_choice": REQUEST_TOOL_CHOICE,
        "gen_ai.request.user": REQUEST_USER, "gen_ai.request.metadata": REQUEST_METADATA,
        "gen_ai.response.tool_calls": RESPONSE_TOOL_CALLS,
    },
    REWARD_SPAN: {"reward": REWARD, "reward.source": REWARD_SOURCE, "reward.note": REWARD_NOTE,
                  "reward.name": REWARD_NAME},
    INTERMEDIATE_REWARD_SPAN: {"reward": REWARD, "reward.name": REWARD_NAME},
    JUDGE_SPAN: {"reward": REWARD, "reward.name": REWARD_NAME, "reward.note": REWARD_NOTE, "error": ERROR},
    TOOL_SPAN_PREFIX: {"tool.name": TOOL_NAME, "tool.input": TOOL_INPUT, "tool.output": TOOL_OUTPUT},
}
