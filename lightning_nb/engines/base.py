"""The Engine contract: what the LLM proxy and a trainer may use of an engine, and what every engine keeps.

* :class:`Engine` is the contract (an ABC). Its members come in two groups:
  :data:`SERVING_MEMBERS`, what the :class:`~lightning_nb.proxy.proxy.LLMProxy` uses (every engine has
  them), and :data:`WEIGHT_MEMBERS`, what a trainer, the audit and a notebook use of an engine whose
  weights lightning-nb owns (:class:`~lightning_nb.engines.transformers.TransformersEngine`,
  :class:`~lightning_nb.engines.vllm.VLLMEngine`; an :class:`~lightning_nb.engines.endpoint.OpenAIEndpoint`
  has none of them). ``tests/test_engine_contract.py`` checks every member on every engine.
* :class:`Generation` is one completion with its exact token IDs and log-probs.
* :func:`default_stop_token_ids` is the rule for the tokens that end a completion.

The engines import this module (and :mod:`lightning_nb.engines.chat_format`, :mod:`lightning_nb.models`),
never each other.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from contextlib import contextmanager
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from lightning_nb.engines.chat_format import prompt_token_ids
from lightning_nb.errors import ConfigError
from lightning_nb.models.default import IM_END

__all__ = ["Engine", "Generation", "SERVING_MEMBERS", "WEIGHT_MEMBERS", "default_stop_token_ids",
           "chat_completion_payload"]

#: Members of :class:`Engine` the LLM proxy uses; every engine has them.
SERVING_MEMBERS = ("model_name", "base_url", "deployment", "litellm_provider", "api_key", "returns_token_ids",
                   "tool_format", "supported_params", "weight_version", "load_weights", "close", "closed", "stop")
#: Members of :class:`Engine` a trainer, the audit and a notebook use; only engines that own their weights
#: have them (an :class:`~lightning_nb.engines.endpoint.OpenAIEndpoint` has none of these attributes, its
#: :meth:`~Engine.load_weights` raises and its :meth:`~Engine.generate` / :meth:`~Engine.submit` raise).
WEIGHT_MEMBERS = ("model", "tokenizer", "lock", "pad_token_id", "stop_token_ids", "model_source",
                  "released_for_update", "apply_chat_template", "generate", "submit", "chat")


@dataclass
class Generation:
    """One completion with the exact token IDs the model saw and produced.

    ``completion_ids`` includes the stop token when the model stopped by itself
    (finish_reason "stop"); ``text`` excludes it. ``logprobs[i]`` is the natural-log
    probability of ``completion_ids[i]`` under the sampling distribution
    (logits / temperature; raw logits for greedy decoding).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    weight_version: int
    temperature: float


def chat_completion_payload(gens: Sequence[Generation], tokenizer: Any, model: str, *, logprobs: bool,
                            token_ids: bool) -> dict[str, Any]:
    """Generations of one prompt as an OpenAI ``chat.completion`` dict, vLLM's way: with ``logprobs`` each choice's
    ``logprobs`` in the OpenAI shape (one entry per completion token, the stop token too; else None), with
    ``token_ids`` each choice's ``token_ids`` and the top-level ``prompt_token_ids``; ``weight_version`` is the
    oldest version among ``gens``. The TransformersEngine's endpoint answers with it, and the LLM proxy reads it
    back when it completes a prompt given as token IDs (:mod:`lightning_nb.proxy.splice`)."""
    choices = []
    for i, g in enumerate(gens):
        choice: dict[str, Any] = {"index": i, "finish_reason": g.finish_reason,
                                  "message": {"role": "assistant", "content": g.text},
                                  "logprobs": _openai_logprobs(tokenizer, g) if logprobs else None}
        if token_ids:
            choice["token_ids"] = list(g.completion_ids)
        choices.append(choice)
    prompt = len(gens[0].prompt_ids)
    completion = sum(len(g.completion_ids) for g in gens)
    payload: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        "weight_version": min(g.weight_version for g in gens),
    }
    if token_ids:
        payload["prompt_token_ids"] = list(gens[0].prompt_ids)
    return payload


def _openai_logprobs(tokenizer: Any, gen: Generation) -> dict[str, Any]:
    """``choices[i].logprobs`` in the OpenAI shape: one entry per completion token (the stop token too)."""
    tokens = [tokenizer.decode([t]) for t in gen.completion_ids]
    return {"content": [{"token": tok, "bytes": list(tok.encode("utf-8")), "logprob": lp, "top_logprobs": []}
                        for tok, lp in zip(tokens, gen.logprobs)], "refusal": None}


class Engine(abc.ABC):
    """An inference engine behind the :class:`~lightning_nb.proxy.proxy.LLMProxy`: the contract every engine keeps.

    **Serving** (:data:`SERVING_MEMBERS`). The proxy reaches every engine the same way, through
    LiteLLM (provider :attr:`litellm_provider`, default ``hosted_vllm``) at :attr:`base_url`.
    So implementations must:

    * serve an OpenAI-compatible Chat Completions API at :attr:`base_url` (ending in
      ``/v1``): ``POST /chat/completions`` and ``GET /models``, with ``model`` equal to
      :attr:`model_name`;
    * when the request has ``return_token_ids: true`` (vLLM's extension), return the
      rendered prompt's token IDs as top-level ``prompt_token_ids`` and each choice's
      completion token IDs as ``choices[i].token_ids``, exactly the tokens that were
      sampled (the stop token included when the model stopped by itself); an engine that
      cannot (a hosted API) sets :attr:`returns_token_ids` to False;
    * with ``logprobs: true``, return ``choices[i].logprobs.content[j].logprob``, the
      log-probability of token ``j`` under the distribution it was sampled from (after
      temperature), one entry per completion token;
    * return ``finish_reason`` ``"stop"`` or ``"length"`` per choice;
    * honour ``max_tokens``, ``temperature``, ``top_p`` and every optional parameter named in
      :attr:`supported_params` (the proxy answers any other parameter with a 400 naming it
      before the engine sees it; vLLM itself ignores unknown fields);
    * keep :attr:`weight_version`, the version of the weights that generations come
      from, and make a completion started after :meth:`load_weights` returns use the new
      weights (no stale KV cache);
    * release everything in :meth:`close` (idempotent): no thread or server process of
      the engine may outlive it, nor the interpreter, and nothing the engine started may
      keep a reference to it (so the engine, its model and its tokenizer are freed once
      the caller drops them); :attr:`closed` is True afterwards.

    **Weights** (:data:`WEIGHT_MEMBERS`). An engine whose weights lightning-nb owns also has
    the policy as a transformers module, which a trainer updates and then hands to
    :meth:`load_weights`:

    * :attr:`model`: for a :class:`~lightning_nb.engines.transformers.TransformersEngine`, the
      module it generates with (the trainer updates it in place: no copy); for a
      :class:`~lightning_nb.engines.vllm.VLLMEngine`, a transformers copy of the served weights
      (float32 on the CPU until a trainer moves it to its device), kept only for the trainer (the
      server has its own; :meth:`load_weights` exports this copy to it);
    * :attr:`tokenizer`, :attr:`pad_token_id`, :attr:`stop_token_ids`: what the trainer pads
      and renders with, and what :meth:`~lightning_nb.trainers.grpo.trainer.GRPOTrainer.save_pretrained`
      writes into the exported generation config;
    * :attr:`lock`: a trainer holds it while it changes :attr:`model`'s weights (and across
      :meth:`load_weights`), so no completion reads half-updated weights;
    * :meth:`released_for_update`: a trainer wraps each update in it (``with engine.lock,
      engine.released_for_update():`` ... ``engine.load_weights(model)``), so an engine that shares the
      accelerator with the trainer can give its memory back for the update's length (a
      :class:`~lightning_nb.engines.vllm.VLLMEngine` on CUDA sleeps); :meth:`load_weights` is allowed
      inside it, and the engine serves again (the new weights if they were loaded) once the block ends;
    * :attr:`model_source`: where the initial weights came from, so a checkpoint can rebuild them;
    * :meth:`apply_chat_template`, :meth:`generate`, :meth:`submit` and :meth:`chat`: token-level
      generation without the proxy (notebooks, the trainer's tests).

    Attributes:
        model_name: the name requests use in ``model``.
        weight_version: starts at 0; :meth:`load_weights` bumps it.
        returns_token_ids: whether responses carry exact token IDs (training needs them).
        tool_format: ``"hermes"``: the model writes tool calls as text, so the proxy renders
            ``tools`` into the prompt and parses ``<tool_call>`` JSON from the reply
            (:mod:`lightning_nb.engines.chat_format`); ``"native"``: the server takes ``tools`` itself.
        supported_params: optional OpenAI chat parameters this engine honours beyond
            ``max_tokens``, ``temperature``, ``top_p`` and ``logprobs``.
        litellm_provider: the LiteLLM provider prefix the proxy calls :attr:`base_url` with.
        api_key: sent as ``Authorization: Bearer`` by the proxy.
        model: the policy as a transformers causal LM ``nn.Module`` (see above; weight engines only).
        tokenizer: its tokenizer, with a chat template (weight engines only).
        lock: a ``threading.RLock`` guarding :attr:`model`'s weights (weight engines only).
        pad_token_id: the token that pads batches: the first of :attr:`stop_token_ids` (weight engines only).
        stop_token_ids: tokens that end a completion, as ints (weight engines only).
        model_source: ``"default"`` (the weights came from
            :func:`~lightning_nb.models.default.load_default_model`), the folder or hub id they were read from,
            or None (a model handed in); weight engines only.
    """

    model_name: str
    #: the version of the weights generations come from; :meth:`load_weights` bumps it
    weight_version: int = 0
    #: whether responses carry exact token IDs (``prompt_token_ids``, ``choices[i].token_ids``)
    returns_token_ids: bool = True
    #: ``"hermes"`` (tool calls as text, rendered and parsed by the proxy) or ``"native"``
    tool_format: str = "hermes"
    #: optional chat parameters honoured beyond ``max_tokens``, ``temperature``, ``top_p``, ``logprobs``
    supported_params: frozenset = frozenset()
    #: the LiteLLM provider prefix the proxy calls :attr:`base_url` with
    litellm_provider: str = "hosted_vllm"
    #: sent as ``Authorization: Bearer`` by the proxy
    api_key: str = "not-needed"
    # The weight members: annotations only (no class value), so an engine without them has no such attribute.
    #: the policy as a transformers ``nn.Module`` (for a VLLMEngine: the CPU copy the trainer updates)
    model: Any
    #: the policy's tokenizer, with a chat template
    tokenizer: Any
    #: ``threading.RLock``: held by a trainer while it changes :attr:`model` and by :meth:`load_weights`
    lock: Any
    #: pads batches: ``stop_token_ids[0]``
    pad_token_id: int
    #: tokens that end a completion
    stop_token_ids: list[int]
    #: ``"default"``, the folder or hub id the weights were read from, or None
    model_source: Optional[str]

    # ----- serving ------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def base_url(self) -> str:
        """OpenAI-compatible base URL, ending in ``/v1``."""

    @abc.abstractmethod
    def load_weights(self, weights: Any, *, version: Optional[int] = None) -> int:
        """Serve ``weights`` (an ``nn.Module`` or a state dict) from the next completion on.

        ``weights`` may be :attr:`model` itself (a trainer updated it in place), another module,
        or a state dict with :attr:`model`'s keys and shapes (copied into :attr:`model`).

        Returns the new :attr:`weight_version`: ``version`` when given (restoring a
        checkpoint), else the old one plus 1.

        Raises:
            LightningNbError: the engine cannot change its weights (an OpenAIEndpoint), or it is closed.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving and release threads and processes (idempotent)."""

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran: the engine serves nothing more (an engine with nothing to close: never)."""
        return False

    def stop(self) -> None:
        """Same as :meth:`close`."""
        self.close()

    def deployment(self) -> dict[str, Any]:
        """This engine as a LiteLLM deployment: ``litellm_params`` are what ``litellm.acompletion`` takes."""
        return {"model_name": self.model_name,
                "litellm_params": {"model": f"{self.litellm_provider}/{self.model_name}", "api_base": self.base_url,
                                   "api_key": self.api_key},
                "model_info": {"id": f"{type(self).__name__}-{id(self):x}"}}

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- weights: token-level generation without the proxy --------------------------------
    @contextmanager
    def released_for_update(self) -> Iterator[None]:
        """Give the engine's accelerator memory to the trainer while the ``with`` block runs; serve again after.

        A trainer wraps each update in it and calls :meth:`load_weights` inside (or not, when the
        weights did not change). Completions requested meanwhile wait, or are served by the old
        weights; none fails. This default does nothing: an engine that shares its module with the
        trainer (:class:`~lightning_nb.engines.transformers.TransformersEngine`) or serves from
        elsewhere has nothing to release. :meth:`VLLMEngine.released_for_update
        <lightning_nb.engines.vllm.VLLMEngine.released_for_update>` puts its server to sleep.

        Raises:
            LightningNbError: the engine could not release or take back its memory (names the cause).
        """
        yield

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token IDs of ``messages`` rendered with the chat template plus the assistant header
        (:func:`~lightning_nb.engines.chat_format.prompt_token_ids`, as the proxy's engine renders them)."""
        return prompt_token_ids(self.tokenizer, messages)

    def generate(self, prompt_ids: Sequence[int], *, max_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, seed: Optional[int] = None, stop: Optional[Sequence[str]] = None) -> Generation:
        """Complete ``prompt_ids`` and return a :class:`Generation` (blocking).

        Args:
            max_tokens: at most this many completion tokens (1 to 4096).
            temperature: 0 decodes greedily.
            seed: the same seed and weights give the same tokens.
            stop: up to 4 strings; the completion ends at the first one (finish_reason "stop").

        Raises:
            ConfigError: ``prompt_ids`` is empty or a sampling parameter is out of range (names it).
            NotImplementedError: this engine only serves through :attr:`base_url` (an OpenAIEndpoint).
        """
        raise NotImplementedError(f"{type(self).__name__} generates only through its base_url (the LLM proxy)")

    def submit(self, prompt_ids: Sequence[int], **sampling: Any) -> Future:
        """:meth:`generate` without blocking: the Future resolves to a :class:`Generation`.

        Raises:
            NotImplementedError: this engine only serves through :attr:`base_url` (an OpenAIEndpoint).
        """
        raise NotImplementedError(f"{type(self).__name__} generates only through its base_url (the LLM proxy)")

    def chat(self, message: str, *, system: Optional[str] = None, max_tokens: int = 96, temperature: float = 0.0) -> str:
        """Ask the current policy one question (greedy by default) and return its answer text."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
        return self.generate(self.apply_chat_template(messages), max_tokens=max_tokens, temperature=temperature).text

    def _copy_weights(self, weights: Any) -> None:
        """Copy ``weights`` (a module or a state dict) into :attr:`model`, unless it *is* :attr:`model`.

        Callers hold :attr:`lock`.
        """
        if weights is not self.model:
            state = weights.state_dict() if hasattr(weights, "state_dict") else weights
            self.model.load_state_dict(state)


def default_stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Tokens that end a completion: ``<|im_end|>`` and ``<|im_start|>`` where the vocabulary has them
    (ChatML models), then the model's ``generation_config.eos_token_id`` (an id or a list) and the
    tokenizer's eos; without duplicates, in that order (the first one also pads).

    For the default model this is ``[2, 1]`` (its GGUF reports the wrong eos; see
    :func:`~lightning_nb.models.default.load_default_model`).

    Raises:
        ConfigError: none of these exists (pass ``stop_token_ids`` explicitly).
    """
    vocab = tokenizer.get_vocab()
    ids = [vocab[t] for t in (IM_END, "<|im_start|>") if t in vocab]
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += list(eos) if isinstance(eos, (list, tuple)) else [eos]
    ids.append(getattr(tokenizer, "eos_token_id", None))
    out = list(dict.fromkeys(int(i) for i in ids if i is not None))
    if not out:
        raise ConfigError("the model and tokenizer define no end-of-turn token; pass stop_token_ids=[...]")
    return out

