"""AdamW with float32 master weights for a model held in bfloat16.

Why: bfloat16 keeps 8 significant bits, so a weight of magnitude ``w`` moves only by
steps of about ``w / 128``. AdamW's step is about ``lr`` per weight (2e-5 by default), far
under half a step for nearly every weight, so a plain ``AdamW`` on bfloat16 weights rounds
almost every update away and the model does not learn (measured in
``tests/test_device.py``). Mixed-precision training (Micikevicius et al. 2018, "Mixed
Precision Training"; verl's FSDP ``param_dtype=bf16`` with float32 parameters) keeps a
float32 copy: gradients computed in bfloat16 are applied to the float32 master, and the
model's bfloat16 weights are the master rounded, so small steps accumulate.

Memory per parameter: 2 bytes (model) + 2 (its gradient) + 4 (master) + 8 (AdamW's two
moments), plus 4 for the master gradient during :meth:`step`; 16 in all, as float32 training.
The saving of bfloat16 is in activations and speed (tensor cores), not in weights.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

__all__ = ["MasterWeightAdamW", "make_optimizer"]


class MasterWeightAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` over float32 copies of ``params``; :meth:`step` writes them back rounded.

    Its ``param_groups`` hold the master tensors (edit ``lr`` there as for any optimizer;
    LR schedulers work). Gradient clipping is done on the model's parameters before
    :meth:`step`, as usual. :meth:`state_dict` carries the masters (``"master"``: a list of
    float32 tensors in parameter order), so a resumed run continues from the same float32
    weights; a state dict without them (saved by a float32 run) re-seeds them from the model.
    """

    def __init__(self, params: Iterable[Any], **adamw_kwargs: Any) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        masters = [p.detach().to(torch.float32).clone().requires_grad_(True) for p in self.model_params]
        super().__init__(masters, **adamw_kwargs)
        self.master_params = masters

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Any:
        """Apply the model's gradients to the float32 masters, then copy the masters into the model."""
        for p, m in zip(self.model_params, self.master_params):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
        loss = super().step(closure)
        for p, m in zip(self.model_params, self.master_params):
            m.grad = None  # free the float32 gradients at once
            p.copy_(m)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (the masters' are freed in :meth:`step`)."""
        super().zero_grad(set_to_none)
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def sync_from_model(self) -> None:
        """Re-seed the masters from the model's weights (after the model's weights were loaded)."""
        with torch.no_grad():
            for p, m in zip(self.model_params, self.master_params):
                m.copy_(p)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["master"] = [m.detach().clone() for m in self.master_params]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        masters = state.pop("master", None)
        super().load_state_dict(state)
        if masters is None:
            self.sync_from_model()
            return
        with torch.no_grad():
            for m, saved, p in zip(self.master_params, masters, self.model_params):
                m.copy_(saved)
                p.copy_(m)


def make_optimizer(params: Iterable[Any], *, dtype: str, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The trainer's AdamW: plain for float32 weights, :class:`MasterWeightAdamW` for bfloat16 ones."""
    if dtype == "bfloat16":
        return MasterWeightAdamW(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
