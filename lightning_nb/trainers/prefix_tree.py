"""Prefix trees of training sequences: each token that several sequences share, with the same tokens before it,
forwarded once.

A GRPO batch repeats most of its context. Every sequence of the demo's batch starts with the same system prompt
(177 tokens), the sequences of one group share their task's first prompt, and a multi-turn episode's turns
share everything before the turn (``pack_episode`` already packs those into one sequence). A causal decoder's
hidden state at position t depends only on tokens 0..t, so sequences that agree on tokens 0..t have the same
hidden state there: computing it once and letting every sequence below it attend to it gives the same log-probs,
and since backpropagation adds the gradients of every use of a shared activation, the same gradient.

:class:`PrefixTree` lays the distinct prefixes of some sequences out as one row of *nodes*: node n holds one
token at position ``depth[n]`` (its RoPE position) and attends to its ancestors and itself (the tree attention
mask, :meth:`PrefixTree.attention_mask`), which is what each sequence's causal mask gives it in its own row.
:func:`plan_tree_micro_batches` splits a mini-batch into such trees under a token budget counted in nodes.
The same scheme for one shared prompt per group is Unsloth's PrefixGrouper (2026; forward a GRPO group's prompt
once) and, for trees of any depth, the "tree attention" of speculative decoding (SpecInfer, Miao et al. 2024,
§4.2: a token tree verified in one decoder pass with a topology-aware causal mask). Here the trees hold whole
packed multi-turn episodes with their response_mask, and train.

The trainer's forward over a tree: :func:`lightning_nb.trainers.grpo.logprobs.tree_response_logprobs`
(``GRPOTrainer``), and patch 7 of :mod:`lightning_nb.trainers.verl.patches` inside verl's actor (``VerlTrainer``);
both put the tree through the model's own forward with :func:`tree_attention_mask`, when :func:`tree_path` says
its attention reads one.

Pure Python but :meth:`PrefixTree.attention_mask` and :func:`tree_attention_mask`, which import torch when called.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lightning_nb.errors import ConfigError

__all__ = ["PrefixTree", "build_prefix_tree", "plan_tree_micro_batches", "tree_tokens", "MAX_TREE_TOKENS",
           "TREE_ATTENTION", "tree_path", "tree_attention_mask", "tree_token_budget"]

#: The most nodes one tree may hold, whatever the budget: its attention mask is dense (nodes², a float32
#: additive mask of 8,192 nodes is 256 MiB), and attention costs nodes² per layer, so past this size several
#: smaller trees forward faster.
MAX_TREE_TOKENS = 8192

#: ``config._attn_implementation`` values whose attention takes a dense 4-D mask as it is: ``"sdpa"`` a bool mask
#: (True = attend), ``"eager"`` an additive one. Flash attention takes none; flex attention a BlockMask.
TREE_ATTENTION = frozenset({"sdpa", "eager"})


@dataclass
class PrefixTree:
    """The distinct prefixes of some sequences, one node per distinct (prefix, token).

    ``ids[n]`` is node n's token, ``parent[n]`` the node before it (−1 for a first token), ``depth[n]`` its
    position in every sequence that holds it (0-based). Nodes are numbered in the order the sequences were
    inserted, so a parent always comes before its children. ``paths[i][t]`` is the node of sequence i's token t,
    for every t < ``len(sequence i)``.
    """

    ids: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    paths: list[list[int]] = field(default_factory=list)

    @property
    def nodes(self) -> int:
        """Tokens one forward over the tree holds (each shared token once)."""
        return len(self.ids)

    @property
    def sequence_tokens(self) -> int:
        """Tokens of the sequences themselves: what they would forward one row each, without padding."""
        return sum(len(p) for p in self.paths)

    @property
    def shared_tokens(self) -> int:
        """Sequence tokens the tree does not forward again (``sequence_tokens − nodes``)."""
        return self.sequence_tokens - self.nodes

    def attention_mask(self, device: Any = None) -> Any:
        """(nodes, nodes) bool tensor: ``[q, k]`` is True when node k is node q or one of its ancestors.

        Row q is exactly the causal mask its sequences give position ``depth[q]`` in their own rows, with each
        earlier position replaced by the node that holds it.
        """
        import torch

        mask = torch.zeros((self.nodes, self.nodes), dtype=torch.bool)
        for path in self.paths:  # each sequence's causal mask, written at its nodes (shared nodes agree)
            rows, cols = torch.tril_indices(len(path), len(path))
            nodes = torch.tensor(path, dtype=torch.long)
            mask[nodes[rows], nodes[cols]] = True
        return mask.to(device) if device is not None else mask


def build_prefix_tree(sequences: Sequence[Sequence[int]]) -> PrefixTree:
    """The prefix tree of ``sequences`` (token-ID lists): a node per distinct prefix, in insertion order.

    Two sequences share node n exactly when they agree on every token up to and including n's position.
    """
    tree = PrefixTree()
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for seq in sequences:
        path: list[int] = []
        node = -1
        for t, tok in enumerate(seq):
            nxt = children.get((node, tok))
            if nxt is None:
                nxt = len(tree.ids)
                children[(node, tok)] = nxt
                tree.ids.append(int(tok))
                tree.parent.append(node)
                tree.depth.append(t)
            path.append(nxt)
            node = nxt
        tree.paths.append(path)
    return tree


def tree_tokens(sequences: Sequence[Sequence[int]]) -> int:
    """Nodes of the prefix tree of ``sequences`` (what one tree forward over them holds), without building it."""
    return build_prefix_tree(sequences).nodes


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_budget(caller: str, max_tokens: Optional[int], max_rows: Optional[int]) -> None:
    """Raise :class:`ConfigError` naming ``caller`` where a micro-batch budget (``max_tokens``, ``max_rows``) is
    below 1; None is no budget."""
    for name, value in (("max_tokens", max_tokens), ("max_rows", max_rows)):
        if value is not None and value < 1:
            raise ConfigError(f"{caller}: {name}={value!r} must be None or an int >= 1")


def plan_tree_micro_batches(sequences: Sequence[Sequence[int]], max_tokens: Optional[int],
                            max_rows: Optional[int] = None) -> list[list[int]]:
    """Split ``sequences`` into micro-batches forwarded as prefix trees; returns lists of indices into ``sequences``.

    The sequences are sorted by their tokens (lexicographically, ties in index order), so sequences with a long
    common prefix are neighbours, and cut greedily: a micro-batch takes the next sequence while its tree stays
    within ``min(max_tokens, MAX_TREE_TOKENS)`` nodes and, when ``max_rows`` is set, ``max_rows`` sequences. In
    sorted order the nodes a sequence adds are its length minus its common prefix with the sequence before it,
    so the count is exact. A sequence longer than the budget gets a micro-batch of its own (never cut).
    ``max_tokens`` None: no token budget (only :data:`MAX_TREE_TOKENS` and ``max_rows``).

    Every index appears exactly once; the result depends only on the arguments. The split never changes the
    gradient (the trainer normalizes the loss over the whole mini-batch).

    Raises:
        ConfigError: ``max_tokens`` or ``max_rows`` below 1.
    """
    check_budget("plan_tree_micro_batches", max_tokens, max_rows)
    budget = MAX_TREE_TOKENS if max_tokens is None else min(max_tokens, MAX_TREE_TOKENS)
    order = sorted(range(len(sequences)), key=lambda i: (list(sequences[i]), i))
    plan: list[list[int]] = []
    nodes = 0
    for i in order:
        cur = plan[-1] if plan else None
        add = len(sequences[i]) - (_common_prefix(sequences[cur[-1]], sequences[i]) if cur else 0)
        if cur is not None and nodes + add <= budget and (max_rows is None or len(cur) < max_rows):
            cur.append(i)
            nodes += add
        else:
            plan.append([i])
            nodes = len(sequences[i])
    return plan


def tree_path(model: Any) -> str:
    """Whether a forward over a prefix tree can run on ``model``: ``"tree"``, or ``"padded: <reason>"`` (the trainer
    then forwards padded rows). ``model`` may be a ``peft.PeftModel``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    impl = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if impl not in TREE_ATTENTION:
        return f"padded: the attention implementation {impl!r} takes no dense 4-D mask (sdpa or eager do)"
    return "tree"


def tree_attention_mask(tree: PrefixTree, model: Any, device: Any) -> Any:
    """(1, 1, N, N) attention mask of ``tree`` in the form ``model``'s attention reads (:func:`tree_path` says it
    reads one): bool for sdpa (True = attend), additive in the model's dtype for eager (0, or the dtype's most
    negative value). transformers passes a 4-D mask to the attention as it is (``masking_utils``)."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    allowed_N_N = tree.attention_mask(device)
    if base.config._attn_implementation == "sdpa":
        return allowed_N_N[None, None]
    dtype = next(base.parameters()).dtype
    blocked = torch.full(allowed_N_N.shape, torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.where(allowed_N_N, torch.zeros((), dtype=dtype, device=device), blocked)[None, None]


def tree_token_budget(sequences: Sequence[Sequence[int]], budget: int) -> int:
    """A budget in sequence tokens for a micro-batcher that counts tokens, not tree nodes (verl's dynamic
    micro-batches): the sequences' tokens over the number of trees their prefix tree needs under ``budget`` nodes
    (``ceil(nodes / budget)``), and at least the longest sequence. A batch whose tree fits ``budget`` nodes is then
    one micro-batch; a larger one is cut into as many as its tree needs."""
    if not sequences:
        return budget
    tokens = sum(len(s) for s in sequences)
    parts = -(-tree_tokens(sequences) // max(budget, 1))
    return max(max(len(s) for s in sequences), -(-tokens // parts))
