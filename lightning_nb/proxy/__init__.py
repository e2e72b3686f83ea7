"""The LLM proxy: an OpenAI-compatible server in front of the engines that records every call as a span.

Modules: :mod:`~lightning_nb.proxy.proxy` (:class:`LLMProxy`: lifecycle, routing, one completion),
:mod:`~lightning_nb.proxy.request` (the request model, its checks, the sampling applied),
:mod:`~lightning_nb.proxy.response` (the reply, plain or streamed), :mod:`~lightning_nb.proxy.spans`
(the LLM spans recorded, keys from :mod:`lightning_nb.semconv`) and :mod:`~lightning_nb.proxy.app`
(the HTTP routes).
"""

from lightning_nb.proxy.proxy import LLMProxy

__all__ = ["LLMProxy"]
