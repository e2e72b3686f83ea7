"""Any OpenAI-compatible server as an engine: a vLLM or SGLang server you already run, or a hosted API."""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

from lightning_nb.engines.base import Engine
from lightning_nb.errors import ConfigError, LightningNbError

__all__ = ["OpenAIEndpoint"]

log = logging.getLogger(__name__)


class OpenAIEndpoint(Engine):
    """An OpenAI-compatible chat server that lightning-nb does not own, behind the LLM proxy.

    It keeps the serving half of the :class:`~lightning_nb.engines.base.Engine` contract only: it has no
    ``model``, ``tokenizer`` or ``lock`` (the weights are not ours), :meth:`load_weights` raises, and
    ``generate``/``submit`` raise (it generates only through the proxy).

    Use it to serve the policy from a vLLM server started by hand (``vllm serve MODEL``:
    its replies carry token IDs, so its spans train), or to call a hosted model for
    evaluation or as a judge. The proxy records every call; where the server returns no
    token IDs, each span says so in :data:`lightning_nb.semconv.TOKEN_IDS_MISSING`, and the
    :class:`~lightning_nb.adapter.TripletAdapter` refuses to build triplets from such a
    span rather than re-tokenize text the model never sampled as tokens.

    Args:
        base_url: the server's OpenAI base URL, ending in ``/v1``.
        model: the model name the server serves (and requests to the proxy use).
        api_key: sent as ``Authorization: Bearer``; None for a local server.
        returns_token_ids: whether the server honours vLLM's ``return_token_ids`` (vLLM
            >= 0.10 does). None (default) asks the server once, with a one-token request.
        tool_format: ``"native"`` (default): the server handles ``tools`` itself (hosted APIs,
            vLLM with ``--enable-auto-tool-choice``); ``"hermes"``: the proxy renders them as text.
        supported_params: optional chat parameters to pass through (default: all the proxy knows;
            the server answers a 400 for any it refuses, which the proxy passes on).
        litellm_provider: LiteLLM provider prefix (``hosted_vllm`` for vLLM/SGLang, ``openai`` for OpenAI).

    Raises:
        ConfigError: ``base_url`` does not end in ``/v1``.
        LightningNbError: ``returns_token_ids=None`` and the server cannot be reached.
    """

    def __init__(self, base_url: str, model: str, *, api_key: Optional[str] = None,
                 returns_token_ids: Optional[bool] = None, tool_format: str = "native",
                 supported_params: Optional[Iterable[str]] = None, litellm_provider: str = "hosted_vllm",
                 timeout_s: float = 60.0) -> None:
        if not base_url.rstrip("/").endswith("/v1"):
            raise ConfigError(f"base_url must be the server's OpenAI base URL ending in /v1, got {base_url!r}")
        if tool_format not in ("native", "hermes"):
            raise ConfigError(f"tool_format must be 'native' or 'hermes', got {tool_format!r}")
        self._base_url = base_url.rstrip("/")
        self.model_name = model
        self.api_key = api_key or "not-needed"
        self.tool_format = tool_format
        self.litellm_provider = litellm_provider
        self.weight_version = 0
        self.timeout_s = timeout_s
        self.supported_params = frozenset(supported_params if supported_params is not None else
                                          ("stop", "seed", "n", "response_format", "frequency_penalty",
                                           "presence_penalty", "top_logprobs"))
        self.returns_token_ids = self._probe_token_ids() if returns_token_ids is None else bool(returns_token_ids)

    @property
    def base_url(self) -> str:
        """The server's OpenAI base URL, as given (without a trailing ``/``)."""
        return self._base_url

    def _probe_token_ids(self) -> bool:
        """Ask for one token with ``return_token_ids``; True when the reply carries them."""
        import httpx

        body = {"model": self.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "return_token_ids": True}
        try:
            r = httpx.post(f"{self._base_url}/chat/completions", json=body, timeout=self.timeout_s,
                           headers={"Authorization": f"Bearer {self.api_key}"})
        except httpx.HTTPError as exc:
            raise LightningNbError(f"cannot reach {self._base_url} ({type(exc).__name__}: {exc}); start the server "
                                   "first, or pass returns_token_ids=True/False to skip this check") from exc
        if r.status_code == 404 and "model" in r.text:
            raise ConfigError(f"{self._base_url} does not serve model {self.model_name!r}: {r.text[:300]}")
        ok = r.status_code == 200 and bool(r.json().get("prompt_token_ids"))
        if not ok:
            log.warning("%s returns no token IDs (HTTP %s): its calls are traced but cannot be trained on",
                        self._base_url, r.status_code)
        return ok

    def load_weights(self, weights: Any, *, version: Optional[int] = None) -> int:
        """Not possible: this server's weights are not ours to change.

        Raises:
            LightningNbError: always; train with a TransformersEngine or VLLMEngine.
        """
        raise LightningNbError(f"OpenAIEndpoint {self._base_url} serves weights lightning-nb does not own, so a "
                               "trainer cannot update them; serve the policy with TransformersEngine or VLLMEngine")

    def close(self) -> None:
        """Nothing to release: the server is not ours, and this engine starts no thread and holds no
        connection between calls (its one probe is a single ``httpx.post``). A proxy may still route to it
        afterwards (:attr:`closed` stays False)."""
