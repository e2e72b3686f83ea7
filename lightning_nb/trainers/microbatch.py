"""Micro-batches sized by tokens: which sequences one forward/backward takes, and how many tokens it may hold.

A trainer forwards a mini-batch in micro-batches and accumulates their gradients. With a fixed number of rows
per micro-batch (``GRPOConfig.micro_batch_size``), a micro-batch of short sequences leaves the device idle and
one of long sequences may not fit; on a GPU the time of a small forward is mostly fixed (kernel launches), so
tokens/s grows with the micro-batch. A token budget (``GRPOConfig.micro_batch_tokens``; verl's
``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``) fixes the memory of a forward instead:
:func:`plan_micro_batches` sorts the sequences by length and packs them greedily so that each micro-batch's
padded size, ``rows × its longest row`` (tokens), stays within the budget and padding stays small;
:func:`auto_micro_batch_tokens` picks the budget from free device memory.

The split never changes the gradient: the trainer's loss is normalized over the whole mini-batch
(``loss_agg_mode``), so the micro-batch losses add up to the mini-batch's whatever the split (up to float
rounding, checked in ``tests/test_microbatch.py``).

Pure Python but :func:`auto_micro_batch_tokens`, which imports torch when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, TypeVar

from lightning_nb.errors import ConfigError
from lightning_nb.trainers.prefix_tree import check_budget, plan_tree_micro_batches

__all__ = ["MicroBatcher", "plan_micro_batches", "padded_tokens", "bytes_per_token", "auto_micro_batch_tokens",
           "CPU_AUTO_TOKENS", "DEFAULT_ROWS", "AUTO_MEMORY_FRACTION", "AUTO_HEADROOM_BYTES", "AUTO_MAX_TOKENS",
           "AUTO_MIN_TOKENS"]

T = TypeVar("T")

#: ``micro_batch_tokens="auto"`` on CPU: a fixed budget (tokens). CPU memory is not measured: the machine's other
#: processes share it, and a CPU forward gains little from larger micro-batches. 2,048 tokens of SmolLM2-135M
#: hold about 0.4 GB of float32 logits per copy.
CPU_AUTO_TOKENS = 2048
#: Rows per micro-batch when neither ``micro_batch_tokens`` nor ``micro_batch_size`` is set (the old default).
DEFAULT_ROWS = 4
#: ``"auto"`` on CUDA uses this fraction of the memory left after the headroom and the pending gradients and
#: optimizer state (the safety margin of :func:`auto_micro_batch_tokens`).
AUTO_MEMORY_FRACTION = 0.7
#: ``"auto"`` on CUDA leaves this much free device memory (bytes) for the allocator's fragmentation and kernels'
#: workspaces (cuBLAS, attention).
AUTO_HEADROOM_BYTES = 1 << 30
#: ``"auto"`` never picks more than this many tokens per micro-batch (beyond it a forward is compute-bound anyway).
AUTO_MAX_TOKENS = 65536
#: ``"auto"`` never picks fewer (a budget below one row still forwards that row alone).
AUTO_MIN_TOKENS = 64


def plan_micro_batches(lengths: Sequence[int], max_tokens: Optional[int] = None,
                       max_rows: Optional[int] = None) -> list[list[int]]:
    """Split sequences of ``lengths`` (tokens) into micro-batches; returns lists of indices into ``lengths``.

    * ``max_tokens`` None: consecutive runs of ``max_rows`` (``DEFAULT_ROWS`` when None) in the order given,
      the last one shorter: the fixed-rows split (``GRPOConfig.micro_batch_tokens=None``).
    * ``max_tokens`` an int: the indices sorted by length, longest first (ties in index order), packed greedily
      (first-fit decreasing, as verl's ``rearrange_micro_batches`` balances by tokens): a micro-batch takes
      the next row while ``rows × its longest row <= max_tokens`` (padding counted: the trainer right-pads a
      micro-batch to its longest row) and, when ``max_rows`` is set, ``rows <= max_rows``. A row longer than
      ``max_tokens`` gets a micro-batch of its own (sequences are never cut). Since rows come longest first,
      a closed micro-batch could take no later row, so first-fit and next-fit agree. (Runs of k rows of the
      sorted order pad least of all splits into runs of k rows.)

    Every index appears exactly once; the result depends only on the arguments (deterministic). An empty
    ``lengths`` gives ``[]``.

    Raises:
        ConfigError: ``max_tokens`` or ``max_rows`` below 1.
    """
    check_budget("plan_micro_batches", max_tokens, max_rows)
    if max_tokens is None:
        rows = max_rows or DEFAULT_ROWS
        return [list(range(i, min(i + rows, len(lengths)))) for i in range(0, len(lengths), rows)]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: list[list[int]] = []
    for i in order:
        cur = plan[-1] if plan else None
        if cur is not None and (len(cur) + 1) * lengths[cur[0]] <= max_tokens and (
                max_rows is None or len(cur) < max_rows):
            cur.append(i)
        else:
            plan.append([i])
    return plan


def padded_tokens(lengths: Sequence[int], plan: Sequence[Sequence[int]]) -> int:
    """Tokens the micro-batches of ``plan`` forward, padding included: ``Σ rows × longest row``."""
    return sum(len(mb) * max(lengths[i] for i in mb) for mb in plan if mb)


@dataclass
class MicroBatcher:
    """The micro-batch rule of one update, and its tally of what was forwarded.

    ``max_tokens``: the token budget (None: fixed rows); ``max_rows``: the row cap (None: ``DEFAULT_ROWS``
    without a budget, no cap with one); ``tree``: micro-batches are forwarded as prefix trees
    (:mod:`~lightning_nb.trainers.prefix_tree`), so the budget counts each micro-batch's distinct prefixes
    (tree nodes) instead of padded rows. :meth:`split` / :meth:`count` plan over lengths (padded rows),
    :meth:`split_sequences` / :meth:`count_sequences` over token lists (rows or trees, as ``tree`` says);
    :meth:`record` counts one forward.
    """

    max_tokens: Optional[int] = None
    max_rows: Optional[int] = None
    tree: bool = False
    forwards: int = 0
    padded: int = 0  # tokens forwarded: rows x the longest row, or a tree's nodes
    real: int = 0  # tokens of the sequences themselves
    shared: int = 0  # sequence tokens a tree did not forward again (real - nodes, summed over tree forwards)

    def split(self, items: Sequence[T], lengths: Sequence[int]) -> list[list[T]]:
        """``items`` (one per length) grouped as :func:`plan_micro_batches` plans them."""
        return [[items[i] for i in mb] for mb in plan_micro_batches(lengths, self.max_tokens, self.max_rows)]

    def count(self, lengths: Sequence[int]) -> int:
        """How many micro-batches :meth:`split` makes of sequences of ``lengths``."""
        return len(plan_micro_batches(lengths, self.max_tokens, self.max_rows))

    def _plan(self, sequences: Sequence[Sequence[int]]) -> list[list[int]]:
        lengths = [len(s) for s in sequences]
        if not self.tree or self.max_tokens is None:  # padded rows, or fixed rows each forwarded as a tree
            return plan_micro_batches(lengths, self.max_tokens if not self.tree else None, self.max_rows)
        return plan_tree_micro_batches(sequences, self.max_tokens, self.max_rows)

    def split_sequences(self, items: Sequence[T], sequences: Sequence[Sequence[int]]) -> list[list[T]]:
        """``items`` (one per token list of ``sequences``) grouped into micro-batches: with ``tree`` and a token
        budget by :func:`~lightning_nb.trainers.prefix_tree.plan_tree_micro_batches` (nodes within the budget),
        with ``tree`` and no budget in fixed rows (batch order), else as :meth:`split`."""
        return [[items[i] for i in mb] for mb in self._plan(sequences)]

    def count_sequences(self, sequences: Sequence[Sequence[int]]) -> int:
        """How many micro-batches :meth:`split_sequences` makes of ``sequences``."""
        return len(self._plan(sequences))

    def record(self, lengths: Sequence[int], nodes: Optional[int] = None) -> None:
        """Count one forward of rows of ``lengths``: right-padded to the longest, or (``nodes`` given) as a prefix
        tree of that many nodes."""
        self.forwards += 1
        self.real += sum(lengths)
        if nodes is None:
            self.padded += len(lengths) * max(lengths, default=0)
        else:
            self.padded += nodes
            self.shared += sum(lengths) - nodes

    @property
    def padding_fraction(self) -> float:
        """Padding tokens / all forwarded tokens (0.0 before any forward, and for tree forwards)."""
        padding = self.padded - self.real + self.shared
        return padding / self.padded if self.padded else 0.0


def bytes_per_token(hidden: int, intermediate: int, layers: int, vocab: int, dtype_bytes: int,
                    gradient_checkpointing: bool = False, lora: bool = False) -> int:
    """Estimated device memory (bytes) one token of a training forward+backward holds, for a decoder of this shape.

    With ``h = hidden``, ``i = intermediate`` (the MLP width), ``L = layers``, ``V = vocab``, ``d = dtype_bytes``::

        layer   = d · (10 h + 4 i)     what one LLaMA/Qwen-style layer keeps for its backward per token: the
                                       two norms' inputs and outputs (4h), q, k, v and RoPE'd q, k (≤ 4h),
                                       the attention output (h), the input of o_proj (h), and the MLP's
                                       gate, up, act(gate) and product (4i); SDPA/flash attention keeps
                                       no T × T score matrix (an eager attention would need more)
              + 4 · (3 h + i)          with LoRA: the float32 copies of the adapted layers' inputs (peft)
        kept    = L · layer             without gradient checkpointing
                = L · d · h + layer     with it: each layer's input, plus one layer recomputed at a time
        logits  = V · (d + 3 · 4)       the model's logits, their float32 copy, the log-softmax and its gradient
        bytes   = kept + logits

    An upper-side estimate (the trainer asks for logits only from the first response token on); the
    measured peaks of issue 29 (Qwen2.5-7B shape, bf16, checkpointing, LoRA: about 1.36 GiB per extra 1,024
    tokens) are below it (this gives 2.5 GiB). SmolLM2-135M in bf16 without checkpointing: 1.40 MB per token.
    """
    layer = dtype_bytes * (10 * hidden + 4 * intermediate) + (4 * (3 * hidden + intermediate) if lora else 0)
    kept = layers * dtype_bytes * hidden + layer if gradient_checkpointing else layers * layer
    return kept + vocab * (dtype_bytes + 3 * 4)


def _model_shape(model: Any) -> tuple[int, int, int, int]:
    """``(hidden, intermediate, layers, vocab)`` from a transformers model's ``config`` (or its ``text_config``).

    Raises:
        ConfigError: the model has no such config.
    """
    cfg: Any = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    try:
        hidden, layers, vocab = int(cfg.hidden_size), int(cfg.num_hidden_layers), int(cfg.vocab_size)
    except (AttributeError, TypeError):
        raise ConfigError("GRPOConfig.micro_batch_tokens='auto' needs a transformers model whose config has "
                          "hidden_size, num_hidden_layers and vocab_size; set micro_batch_tokens to an int "
                          "(tokens per forward/backward)") from None
    return hidden, int(getattr(cfg, "intermediate_size", None) or 4 * hidden), layers, vocab


def auto_micro_batch_tokens(model: Any, *, gradient_checkpointing: bool = False, lora: bool = False,
                            pending_bytes: int = 0) -> int:
    """The token budget of ``micro_batch_tokens="auto"`` for training ``model`` where its weights are.

    On CPU: :data:`CPU_AUTO_TOKENS`. On CUDA: with ``free`` from ``torch.cuda.mem_get_info`` plus what
    torch's caching allocator holds unused (``memory_reserved − memory_allocated``)::

        usable = AUTO_MEMORY_FRACTION · (free − AUTO_HEADROOM_BYTES − pending_bytes)
        tokens = usable // bytes_per_token(model's shape, its dtype, gradient_checkpointing, lora)

    rounded down to a multiple of 64 and clamped to [``AUTO_MIN_TOKENS``, ``AUTO_MAX_TOKENS``].
    ``pending_bytes``: memory the step will still allocate beside the activations (gradients not yet
    allocated, optimizer state not yet created: the first update's). Measured when called, so a budget
    follows memory another tenant of the GPU (a sleeping or woken vLLM) frees or takes.

    Raises:
        ConfigError: on CUDA, a model without a transformers config (see :func:`bytes_per_token`).
    """
    import torch

    param = next(model.parameters())
    if param.device.type != "cuda":
        return CPU_AUTO_TOKENS
    per_token = bytes_per_token(*_model_shape(model), param.element_size(), gradient_checkpointing, lora)
    device = param.device
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    usable = AUTO_MEMORY_FRACTION * (free - AUTO_HEADROOM_BYTES - pending_bytes)
    tokens = int(usable // per_token) // 64 * 64
    return max(AUTO_MIN_TOKENS, min(AUTO_MAX_TOKENS, tokens))
