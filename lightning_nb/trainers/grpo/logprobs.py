"""Per-token log-probabilities of a model, and the padding the GRPO update's tensors share.

Shapes: ``B`` sequences, ``T`` tokens (right-padded), ``L = T − 1`` scored positions (position t
scores token t + 1), ``V`` the vocabulary. Log-probabilities are in nats.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["response_logprobs", "shift_pad", "micro_batches"]


def response_logprobs(model: Any, ids_B_T: Any, attn_B_T: Any, mask_B_L: Any, temp_B: Any) -> Any:
    """Log-probs (B, T-1) of tokens 1..T-1 under ``model`` at masked positions (0 elsewhere).

    Goes through the model's own ``forward`` (so logit scaling or soft-capping a model
    applies is kept), asking it only for the logits from the first masked position on
    (``logits_to_keep``): the vocabulary (49,152) makes the LM head the costliest layer
    for prompt positions that are never scored. Logits are divided by ``temp_B`` (B,),
    the sampling temperature of each sequence.
    """
    import torch

    L = mask_B_L.shape[1]
    cols = mask_B_L.any(dim=0).nonzero()
    first = int(cols[0]) if len(cols) else L - 1
    keep = L + 1 - first  # positions first..T-1 (T = L + 1); the last one predicts nothing
    logits_B_K_V = model(input_ids=ids_B_T, attention_mask=attn_B_T, logits_to_keep=keep).logits
    logits_B_K_V = logits_B_K_V[:, :-1].float() / temp_B[:, None, None]
    sel_B_K = mask_B_L[:, first:].bool()
    target_N = ids_B_T[:, 1:][:, first:][sel_B_K]
    logp_N = torch.log_softmax(logits_B_K_V[sel_B_K], dim=-1).gather(-1, target_N[:, None]).squeeze(-1)
    out_B_L = torch.zeros(mask_B_L.shape, dtype=logp_N.dtype, device=logp_N.device)
    out_B_L[:, first:][sel_B_K] = logp_N
    return out_B_L


def shift_pad(rows: Sequence[Sequence[float]], T: int, device: Any) -> Any:
    """(B, T-1) float32 tensor of per-token ``rows`` (each as long as its sequence) for tokens 1..T-1, 0-padded."""
    import torch

    return torch.tensor([list(r[1:]) + [0] * (T - len(r)) for r in rows], dtype=torch.float32, device=device)


def micro_batches(seqs: Sequence[Any], size: int) -> int:
    """Micro-batches of ``size`` that ``seqs`` make (the last may be smaller)."""
    return -(-len(seqs) // size)
