"""Per-token log-probabilities of a model, and the padding the GRPO update's tensors share.

Shapes: ``B`` sequences, ``T`` tokens (right-padded), ``L = T − 1`` scored positions (position t
scores token t + 1), ``V`` the vocabulary. Log-probabilities are in nats.
"""

from __future__ import annotations

from typing import Any, Sequence

from lightning_nb.trainers.prefix_tree import tree_path

__all__ = ["response_logprobs", "logprob_path", "FUSED_MODEL_TYPES", "shift_pad", "tree_response_logprobs"]

#: ``config.model_type`` of the models whose causal-LM ``forward`` is exactly ``lm_head(decoder(...))``:
#: for these :func:`response_logprobs` runs the decoder and the fused float32 head itself.
FUSED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "olmo2"})
#: config fields by which a model changes its logits after the head (any of them set: the model's forward runs).
_LOGIT_CHANGERS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _fused_parts(model: Any) -> tuple[Any, Any, str]:
    """``(decoder, head weight, "")`` when :func:`response_logprobs` may run the fused head on ``model``, else
    ``(None, None, reason)``. ``model`` may be a ``peft.PeftModel`` (its base model, adapters active, is used)."""
    import torch

    from lightning_nb.models.lm_head import has_fp32_head

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        return None, None, f"model_type {model_type!r} is not one of FUSED_MODEL_TYPES"
    changers = [k for k in _LOGIT_CHANGERS if getattr(config, k, None) not in (None, 1, 1.0)]
    if changers:
        return None, None, f"the config sets {changers[0]}"
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None, None, f"the output layer is a {type(head).__name__}, not a bias-free torch.nn.Linear"
    if head._forward_hooks or head._forward_pre_hooks:
        return None, None, "the output layer has forward hooks"
    if "forward" in head.__dict__ and not has_fp32_head(base):
        return None, None, "the output layer's forward was replaced"
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if decoder is None or decoder is base:
        return None, None, "the model has no separate decoder (get_decoder)"
    return decoder, head.weight, ""


def logprob_path(model: Any) -> str:
    """Which computation :func:`response_logprobs` runs for ``model``: ``"fused"`` (its decoder, then the
    float32 fused head :func:`~lightning_nb.models.lm_head.token_logprobs`), or ``"forward: <reason>"``
    (the model's own ``forward``, then :func:`~lightning_nb.models.lm_head.logits_token_logprobs`)."""
    reason = _fused_parts(model)[2]
    return f"forward: {reason}" if reason else "fused"


def response_logprobs(model: Any, ids_B_T: Any, attn_B_T: Any, mask_B_L: Any, temp_B: Any) -> Any:
    """Log-probs (B, T-1) of tokens 1..T-1 under ``model`` at masked positions (0 elsewhere), float32, nats.

    Logits are divided by ``temp_B`` (B,), the sampling temperature of each sequence, and are
    float32 whatever the model's dtype (a bfloat16 head would round them to 8 bits). Two paths
    (:func:`logprob_path` says which runs):

    * **fused** (a plain decoder + bias-free ``nn.Linear`` head, ``config.model_type`` in
      :data:`FUSED_MODEL_TYPES`): the decoder's hidden states at the masked positions, then
      :func:`~lightning_nb.models.lm_head.token_logprobs`, which saves for backward no ``(N, V)``
      tensor. Measured on the default model, 8 × 512 tokens (3,576 scored), float32: 5.13 GiB saved
      for backward in all (the decoder's activations; largest tensor 0.023 GiB) against 5.78 GiB
      (largest: the float32 log-softmax, 0.655 GiB) with the formula before issue 29. At a 7B shape
      (V = 151,936, H = 3,584, micro-batch 4 × 1,024 scored tokens) that is 0.03 GiB saved (bfloat16
      hidden states and float32 log-sum-exps) instead of 2.32 GiB, and about 0.13 GiB alive at once
      while the head runs (one float32 chunk of 4,096 × 4,096 logits and its softmax) instead of
      three to four 2.32 GiB float32 copies (bench/logprob_memory.py measures the peak on a GPU);
    * **forward** (anything else: soft-capped or scaled logits, a LoRA-wrapped head): the model's
      own ``forward`` from the first masked position on (``logits_to_keep``), then
      :func:`~lightning_nb.models.lm_head.logits_token_logprobs`, which upcasts one chunk of rows at a
      time and saves only the model's logits.

    Both give the same values (float32: within 1e-5) and gradients. A ``peft`` model's adapters stay
    active (and ``disable_adapter()`` gives the base model) on both paths.
    """
    import torch

    from lightning_nb.models.lm_head import logits_token_logprobs, token_logprobs

    L = mask_B_L.shape[1]
    cols = mask_B_L.any(dim=0).nonzero()
    first = int(cols[0]) if len(cols) else L - 1
    sel_B_K = mask_B_L[:, first:].bool()  # positions first..L-1 (position t scores token t + 1)
    target_N = ids_B_T[:, 1:][:, first:][sel_B_K]
    temp_N = temp_B[:, None].expand(sel_B_K.shape)[sel_B_K]
    decoder, weight_V_H, _ = _fused_parts(model)
    if decoder is not None:
        hidden_B_T_H = decoder(input_ids=ids_B_T, attention_mask=attn_B_T, use_cache=False).last_hidden_state
        logp_N = token_logprobs(hidden_B_T_H[:, first:L][sel_B_K], weight_V_H, target_N, temp_N)
    else:
        keep = L + 1 - first  # positions first..T-1 (T = L + 1); the last one predicts nothing
        logits_B_K_V = model(input_ids=ids_B_T, attention_mask=attn_B_T, logits_to_keep=keep).logits
        logp_N = logits_token_logprobs(logits_B_K_V[:, :-1][sel_B_K], target_N, temp_N)
    out_B_L = torch.zeros(mask_B_L.shape, dtype=torch.float32, device=logp_N.device)
    out_B_L[:, first:][sel_B_K] = logp_N.to(torch.float32)
    return out_B_L


def shift_pad(rows: Sequence[Sequence[float]], T: int, device: Any) -> Any:
    """(B, T-1) float32 tensor of per-token ``rows`` (each as long as its sequence) for tokens 1..T-1, 0-padded."""
    import torch

    return torch.tensor([list(r[1:]) + [0] * (T - len(r)) for r in rows], dtype=torch.float32, device=device)


def tree_response_logprobs(model: Any, tree: Any, sequences: Sequence[Sequence[int]], mask_B_L: Any,
                           temp_B: Any) -> Any:
    """:func:`response_logprobs` of ``sequences`` computed by one forward over their prefix tree.

    ``tree`` is :func:`~lightning_nb.trainers.prefix_tree.build_prefix_tree` of ``sequences`` (B of them, the
    longest T tokens); ``mask_B_L`` and ``temp_B`` are as for :func:`response_logprobs`. The decoder runs once
    over the tree's N nodes as a single row, each at its position in the sequences (``position_ids`` = depth)
    under the tree attention mask, so every shared token is forwarded once and its gradient is the sum over the
    sequences that hold it: the same log-probs (float32: within 1e-5 of the padded rows) and the same gradients.
    Position t of sequence b is scored from the hidden state of node ``tree.paths[b][t]``.

    Both of :func:`response_logprobs`'s paths: **fused** (the decoder, then the float32 head on the scored
    positions only) and **forward** (the model's own ``forward`` with ``logits_to_keep`` the distinct scored
    nodes). Needs an attention implementation that reads a dense 4-D mask
    (:func:`~lightning_nb.trainers.prefix_tree.tree_path`).

    Returns:
        (B, T − 1) float32 log-probs in nats at the masked positions, 0 elsewhere.

    Raises:
        ValueError: ``tree`` is not the tree of ``sequences``, or the model's attention takes no 4-D mask.
    """
    import torch

    from lightning_nb.models.lm_head import logits_token_logprobs, token_logprobs
    from lightning_nb.trainers.prefix_tree import tree_attention_mask

    if len(tree.paths) != len(sequences) or any(len(p) != len(s) for p, s in zip(tree.paths, sequences)):
        raise ValueError("tree_response_logprobs: tree is not the prefix tree of these sequences "
                         "(build it with build_prefix_tree(sequences))")
    reason = tree_path(model)
    if reason != "tree":
        raise ValueError(f"tree_response_logprobs: {reason}")
    device = mask_B_L.device
    sel_B_L = mask_B_L.bool()
    b_N, t_N = sel_B_L.nonzero(as_tuple=True)  # the scored positions, row-major as response_logprobs orders them
    node_N = torch.tensor([tree.paths[b][t] for b, t in zip(b_N.tolist(), t_N.tolist())], dtype=torch.long,
                          device=device)
    target_N = torch.tensor([sequences[b][t + 1] for b, t in zip(b_N.tolist(), t_N.tolist())], dtype=torch.long,
                            device=device)
    temp_N = temp_B[b_N]
    ids_1_N = torch.tensor([tree.ids], dtype=torch.long, device=device)
    pos_1_N = torch.tensor([tree.depth], dtype=torch.long, device=device)
    attn = tree_attention_mask(tree, model, device)
    decoder, weight_V_H, _ = _fused_parts(model)
    if decoder is not None:
        hidden_N_H = decoder(input_ids=ids_1_N, attention_mask=attn, position_ids=pos_1_N,
                             use_cache=False).last_hidden_state[0]
        logp_N = token_logprobs(hidden_N_H.index_select(0, node_N), weight_V_H, target_N, temp_N)
    else:
        keep_K, slot_N = torch.unique(node_N, return_inverse=True)  # each scored node's logits once
        logits_K_V = model(input_ids=ids_1_N, attention_mask=attn, position_ids=pos_1_N, use_cache=False,
                           logits_to_keep=keep_K).logits[0]
        logp_N = logits_token_logprobs(logits_K_V.index_select(0, slot_N), target_N, temp_N)
    out_B_L = torch.zeros(mask_B_L.shape, dtype=torch.float32, device=device)
    out_B_L[b_N, t_N] = logp_N.to(torch.float32)
    return out_B_L
