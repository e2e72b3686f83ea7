"""The LM head in float32, for the engine's logits and the trainer's token log-probs alike.

A bfloat16 LM head rounds its logits to bfloat16: a logit of magnitude 16–32 is held to
0.125 (8 significant bits), so the log-probs an engine and a trainer take from two
bfloat16 forwards can differ by tenths of a nat from the head alone. Both sides here
compute the logits of their (bfloat16) hidden states in float32 instead:

* :func:`install_fp32_head` gives a model's output ``nn.Linear`` a per-instance ``forward``
  that returns float32 logits (the engine installs it on a non-float32 model; the
  ``state_dict`` keys and the weights do not change);
* :func:`token_logprobs` is the trainer's fused head: ``log p(target)`` of selected rows
  from their hidden states and the head's weight, in float32, in chunks of the vocabulary,
  with a backward that recomputes each chunk's softmax. It saves for backward only its
  inputs and one float32 number per row (the log-sum-exp), never an ``(N, V)`` tensor: the
  plain ``log_softmax(logits.float() / T).gather`` saves its float32 log-softmax, N × V × 4
  bytes (at V = 151,936 and N = 4 × 1,024 tokens: 2.3 GiB), and has three or four such float32
  copies alive while it runs; here one vocabulary chunk of :data:`VOCAB_CHUNK` columns at a time is alive
  (N × 4,096 × 4 bytes, plus the float32 copy of that chunk of the weight where no
  ``torch.mm(..., out_dtype=torch.float32)`` runs).
* :func:`logits_token_logprobs` is the same for logits a model's own ``forward`` already
  returned (any dtype): float32 is made one chunk of rows at a time, and the backward
  recomputes the softmax from the saved logits.

The log-softmax with the log-sum-exp saved and the softmax recomputed in the backward is
the online-softmax idea of Milakov & Gimelshein, "Online normalizer calculation for
softmax" (2018), applied to the LM head as in Wijmans et al., "Cut Your Losses in
Large-Vocabulary Language Models" (2024).

torch is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import types
from typing import Any, Optional

__all__ = ["VOCAB_CHUNK", "ROW_CHUNK", "token_logprobs", "logits_token_logprobs", "fp32_logits",
           "install_fp32_head", "has_fp32_head"]

#: vocabulary columns per chunk of :func:`token_logprobs` (a float32 chunk of logits is N × this × 4 bytes).
VOCAB_CHUNK = 4096
#: rows per chunk of :func:`logits_token_logprobs` (float32 rows alive at once: this × V × 4 bytes).
ROW_CHUNK = 256
_OUT_DTYPE_MM: dict[str, bool] = {}  # "cuda" -> whether torch.mm(..., out_dtype=float32) runs there


def _compute_dtype(dtype: Any) -> Any:
    """float32 for bfloat16/float16/float32 inputs; float64 stays float64 (for gradcheck)."""
    import torch

    return torch.promote_types(dtype, torch.float32)


def _mm_nt(a_N_H: Any, b_V_H: Any) -> Any:
    """``a @ b.T`` in float32 (float64 for float64 inputs): low-precision inputs are multiplied with float32
    accumulation and a float32 result, never rounded to their own dtype (:func:`_mm`)."""
    return _mm(a_N_H, b_V_H.t(), b_V_H.dtype if a_N_H.dtype == b_V_H.dtype else a_N_H.dtype)


def _mm(a_N_K: Any, b_K_M: Any, low: Any) -> Any:
    """``a @ b`` as float32 (float64 if either is float64), for a model whose weights are in dtype ``low``.

    On CUDA with ``low`` bfloat16/float16, both operands are taken in ``low`` and multiplied by
    ``torch.mm(..., out_dtype=torch.float32)`` where this torch has it: the tensor cores' float32
    accumulator written out unrounded (a float32 operand such as a gradient is rounded to ``low`` first,
    as a plain mixed-precision backward does). Elsewhere both operands are upcast (exact for bfloat16
    values) and multiplied in float32.
    """
    import torch

    ctype = torch.promote_types(torch.promote_types(a_N_K.dtype, b_K_M.dtype), torch.float32)
    if low != ctype and ctype == torch.float32 and a_N_K.is_cuda and _OUT_DTYPE_MM.get("cuda", True):
        try:
            out = torch.mm(a_N_K.to(low), b_K_M.to(low), out_dtype=torch.float32)
            _OUT_DTYPE_MM["cuda"] = True
            return out
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE_MM["cuda"] = False
    return a_N_K.to(ctype) @ b_K_M.to(ctype)


class _TokenLogprob:
    """``torch.autograd.Function`` body of :func:`token_logprobs` (made a Function lazily: torch is optional)."""

    @staticmethod
    def forward(ctx: Any, h_N_H: Any, w_V_H: Any, target_N: Any, temp_N: Any, vocab_chunk: int) -> Any:
        import torch

        ctype = _compute_dtype(h_N_H.dtype)
        inv_t_N = 1.0 / temp_N.to(ctype)
        lse_N = torch.full(target_N.shape, -torch.inf, dtype=ctype, device=h_N_H.device)
        tgt_N = torch.zeros(target_N.shape, dtype=ctype, device=h_N_H.device)
        for v0 in range(0, w_V_H.shape[0], vocab_chunk):
            z_N_C = _mm_nt(h_N_H, w_V_H[v0: v0 + vocab_chunk]) * inv_t_N[:, None]
            lse_N = torch.logaddexp(lse_N, torch.logsumexp(z_N_C, dim=-1))
            inside_N, idx_N = _in_chunk(target_N, v0, z_N_C.shape[1])
            tgt_N = torch.where(inside_N, z_N_C.gather(1, idx_N[:, None]).squeeze(1), tgt_N)
            del z_N_C
        ctx.save_for_backward(h_N_H, w_V_H, target_N, inv_t_N, lse_N)
        ctx.vocab_chunk = vocab_chunk
        return tgt_N - lse_N

    @staticmethod
    def backward(ctx: Any, g_N: Any) -> Any:
        """d log p(y) / d z_j = 1[j = y] − softmax(z)_j, z = h·Wᵀ / T; each chunk's softmax is recomputed from
        the saved log-sum-exp."""
        import torch

        h_N_H, w_V_H, target_N, inv_t_N, lse_N = ctx.saved_tensors
        ctype = inv_t_N.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gt_N = g_N.to(ctype) * inv_t_N  # d loss / d logit_y, before the softmax term
        grad_h = torch.zeros(h_N_H.shape, dtype=ctype, device=h_N_H.device) if need_h else None
        grad_w = torch.empty_like(w_V_H) if need_w else None
        for v0 in range(0, w_V_H.shape[0], ctx.vocab_chunk):
            w_C_H = w_V_H[v0: v0 + ctx.vocab_chunk]
            z_N_C = _mm_nt(h_N_H, w_C_H) * inv_t_N[:, None]
            d_N_C = torch.exp(z_N_C - lse_N[:, None]).mul_(-gt_N[:, None])  # −g/T · softmax
            del z_N_C
            inside_N, idx_N = _in_chunk(target_N, v0, d_N_C.shape[1])
            d_N_C.scatter_add_(1, idx_N[:, None], (gt_N * inside_N)[:, None])  # + g/T at the target
            if need_h:
                grad_h += _mm(d_N_C, w_C_H, w_V_H.dtype)
            if need_w:
                grad_w[v0: v0 + ctx.vocab_chunk] = _mm(d_N_C.t(), h_N_H, w_V_H.dtype).to(w_V_H.dtype)
        return (grad_h.to(h_N_H.dtype) if need_h else None), grad_w, None, None, None


def _in_chunk(target_N: Any, v0: int, width: int) -> tuple[Any, Any]:
    """``(inside_N, idx_N)``: whether each target falls in columns ``v0 .. v0 + width − 1``, and its column
    there (clamped, so a gather at it is valid; use it only where ``inside_N``)."""
    inside_N = (target_N >= v0) & (target_N < v0 + width)
    return inside_N, (target_N - v0).clamp(0, width - 1)


def _functions() -> dict[str, Any]:
    """The two ``torch.autograd.Function`` classes, built on first use."""
    if not _FUNCTIONS:
        import torch

        for name, body in (("token", _TokenLogprob), ("logits", _LogitsTokenLogprob), ("linear", _Fp32Linear)):
            _FUNCTIONS[name] = type(f"{body.__name__[1:]}Function", (torch.autograd.Function,),
                                    {"forward": staticmethod(body.forward),
                                     "backward": staticmethod(body.backward)})
    return _FUNCTIONS


_FUNCTIONS: dict[str, Any] = {}


def token_logprobs(hidden_N_H: Any, weight_V_H: Any, target_N: Any, temp_N: Any,
                   vocab_chunk: int = VOCAB_CHUNK) -> Any:
    """Log-probs (N,) in nats of ``target_N`` under ``softmax(hidden_N_H @ weight_V_H.T / temp_N)``, in float32.

    Args:
        hidden_N_H: the final hidden states of the N scored positions (any float dtype; bfloat16 is
            multiplied with float32 accumulation and float32 logits, never rounded to bfloat16).
        weight_V_H: the LM head's weight (no bias), V vocabulary rows.
        target_N: the token each row scores (int64, in ``[0, V)``).
        temp_N: each row's sampling temperature (> 0).
        vocab_chunk: vocabulary columns whose float32 logits are alive at once.

    Returns:
        (N,) float32 log-probs (float64 for float64 inputs), differentiable with respect to
        ``hidden_N_H`` and ``weight_V_H``. Saved for backward: the inputs and an (N,) log-sum-exp.

    Raises:
        ValueError: shapes disagree (``hidden_N_H`` and ``weight_V_H`` not (N, H) and (V, H), or
            ``target_N``/``temp_N`` not (N,)).
    """
    N, H = hidden_N_H.shape
    if weight_V_H.dim() != 2 or weight_V_H.shape[1] != H or tuple(target_N.shape) != (N,) \
            or tuple(temp_N.shape) != (N,):
        raise ValueError(f"token_logprobs: hidden {tuple(hidden_N_H.shape)}, weight {tuple(weight_V_H.shape)}, "
                         f"target {tuple(target_N.shape)}, temp {tuple(temp_N.shape)}: want (N, H), (V, H), (N,), "
                         "(N,)")
    return _functions()["token"].apply(hidden_N_H, weight_V_H, target_N, temp_N, int(vocab_chunk))


class _LogitsTokenLogprob:
    """``torch.autograd.Function`` body of :func:`logits_token_logprobs`."""

    @staticmethod
    def forward(ctx: Any, logits_N_V: Any, target_N: Any, temp_N: Any, row_chunk: int) -> Any:
        import torch

        ctype = _compute_dtype(logits_N_V.dtype)
        inv_t_N = 1.0 / temp_N.to(ctype)
        lse_N = torch.empty(target_N.shape, dtype=ctype, device=logits_N_V.device)
        tgt_N = torch.empty_like(lse_N)
        for r in range(0, logits_N_V.shape[0], row_chunk):
            z_R_V = logits_N_V[r: r + row_chunk].to(ctype) * inv_t_N[r: r + row_chunk, None]
            lse_N[r: r + row_chunk] = torch.logsumexp(z_R_V, dim=-1)
            tgt_N[r: r + row_chunk] = z_R_V.gather(1, target_N[r: r + row_chunk, None]).squeeze(1)
        ctx.save_for_backward(logits_N_V, target_N, inv_t_N, lse_N)
        ctx.row_chunk = row_chunk
        return tgt_N - lse_N

    @staticmethod
    def backward(ctx: Any, g_N: Any) -> Any:
        import torch

        logits_N_V, target_N, inv_t_N, lse_N = ctx.saved_tensors
        gt_N = g_N.to(inv_t_N.dtype) * inv_t_N
        grad = torch.empty_like(logits_N_V)
        for r in range(0, logits_N_V.shape[0], ctx.row_chunk):
            rows = slice(r, r + ctx.row_chunk)
            z_R_V = logits_N_V[rows].to(inv_t_N.dtype) * inv_t_N[rows, None]
            d_R_V = torch.exp(z_R_V - lse_N[rows, None]).mul_(-gt_N[rows, None])
            d_R_V.scatter_add_(1, target_N[rows, None], gt_N[rows, None])
            grad[rows] = d_R_V.to(grad.dtype)
        return grad, None, None, None


def logits_token_logprobs(logits_N_V: Any, target_N: Any, temp_N: Any, row_chunk: int = ROW_CHUNK) -> Any:
    """Log-probs (N,) in nats of ``target_N`` under ``softmax(logits_N_V / temp_N)``, computed in float32.

    For logits a model's ``forward`` returned (any dtype): each chunk of ``row_chunk`` rows is upcast,
    and the backward recomputes its softmax; saved for backward are ``logits_N_V`` itself (already
    alive as the model's output) and an (N,) log-sum-exp, no float32 copy of the logits.
    """
    return _functions()["logits"].apply(logits_N_V, target_N, temp_N, int(row_chunk))


def fp32_logits(x: Any, weight_V_H: Any, bias_V: Optional[Any] = None) -> Any:
    """``x @ weight.T + bias`` as float32 logits (..., V), whatever the dtype of ``x`` and ``weight``.

    A float32 weight is ``F.linear`` unchanged. A lower-precision one is multiplied with float32
    accumulation (:func:`_mm_nt`) in chunks of :data:`VOCAB_CHUNK` vocabulary rows (only one chunk of
    the weight is upcast at a time); under autograd (the trainer's fallback path, or a trainer such as
    verl's actor running the shared model's ``forward``) ``x`` and the weight are saved in their own
    dtype and the backward upcasts chunk by chunk, so no float32 copy of the weight is kept.
    """
    import torch
    import torch.nn.functional as F

    if weight_V_H.dtype == torch.float32 and x.dtype == torch.float32:
        return F.linear(x, weight_V_H, bias_V)
    x_N_H = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight_V_H.requires_grad):
        out_N_V = _functions()["linear"].apply(x_N_H, weight_V_H)
    else:
        out_N_V = _chunked_mm_nt(x_N_H, weight_V_H)
    if bias_V is not None:
        out_N_V = out_N_V + bias_V.to(out_N_V.dtype)
    return out_N_V.reshape(*x.shape[:-1], weight_V_H.shape[0])


def _chunked_mm_nt(x_N_H: Any, w_V_H: Any) -> Any:
    """(N, V) ``x @ w.T`` in float32 (:func:`_mm_nt`), one chunk of :data:`VOCAB_CHUNK` weight rows at a time."""
    import torch

    return torch.cat([_mm_nt(x_N_H, w_V_H[v0: v0 + VOCAB_CHUNK]) for v0 in range(0, w_V_H.shape[0], VOCAB_CHUNK)],
                     dim=1)


class _Fp32Linear:
    """``torch.autograd.Function`` body of :func:`fp32_logits` under autograd: float32 ``x @ w.T`` that saves
    ``x`` and ``w`` in their own dtype (no float32 copy of the weight is kept for backward)."""

    @staticmethod
    def forward(ctx: Any, x_N_H: Any, w_V_H: Any) -> Any:
        ctx.save_for_backward(x_N_H, w_V_H)
        return _chunked_mm_nt(x_N_H, w_V_H)

    @staticmethod
    def backward(ctx: Any, g_N_V: Any) -> Any:
        import torch

        x_N_H, w_V_H = ctx.saved_tensors
        ctype = g_N_V.dtype
        grad_x = torch.zeros(x_N_H.shape, dtype=ctype, device=x_N_H.device) if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(w_V_H) if ctx.needs_input_grad[1] else None
        for v0 in range(0, w_V_H.shape[0], VOCAB_CHUNK):
            g_N_C = g_N_V[:, v0: v0 + VOCAB_CHUNK]
            if grad_x is not None:
                grad_x += _mm(g_N_C, w_V_H[v0: v0 + VOCAB_CHUNK], w_V_H.dtype)
            if grad_w is not None:
                grad_w[v0: v0 + VOCAB_CHUNK] = _mm(g_N_C.t(), x_N_H, w_V_H.dtype).to(w_V_H.dtype)
        return (None if grad_x is None else grad_x.to(x_N_H.dtype)), grad_w


def _fp32_head_forward(self: Any, x: Any) -> Any:
    """An output ``nn.Linear``'s forward returning float32 logits (installed by :func:`install_fp32_head`)."""
    return fp32_logits(x, self.weight, self.bias)


def has_fp32_head(model: Any) -> bool:
    """Whether :func:`install_fp32_head` ran on ``model`` (its output layer returns float32 logits)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    forward = head.__dict__.get("forward") if head is not None else None
    return getattr(forward, "__func__", None) is _fp32_head_forward


def install_fp32_head(model: Any) -> bool:
    """Make ``model``'s output layer (``get_output_embeddings()``, an ``nn.Linear``) return float32 logits.

    In place and idempotent: a per-instance ``forward`` (a bound method, so ``copy.deepcopy`` of the
    model binds it to the copy); parameters, buffers and ``state_dict`` keys are untouched. A float32
    model's logits do not change. Returns False (and changes nothing) when the output layer is not an
    ``nn.Linear`` (a LoRA-wrapped or quantized head): its logits then stay in the model's dtype.
    """
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return False
    if not has_fp32_head(model):
        head.forward = types.MethodType(_fp32_head_forward, head)
    return True
