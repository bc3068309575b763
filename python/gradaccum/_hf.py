"""What both Hugging Face adapters share (gradaccum.accelerate, gradaccum.transformers)."""
from typing import Any, Optional

import torch


def _float64_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                            num_items_in_batch: Any = None, ignore_index: int = -100,
                            shift_labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` for a float64 model, whose logits it
    would round to float32 (``logits.float()``): the same next-token
    cross-entropy, in float64. Other dtypes go to ``ForCausalLMLoss``."""
    if logits.dtype != torch.float64:
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                               ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device), ignore_index=ignore_index,
        reduction="sum" if num_items_in_batch is not None else "mean")
    if num_items_in_batch is not None:
        divisor = num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        loss = loss / divisor
    return loss


def keep_float64_causal_lm_loss(model: Any) -> bool:
    """Gives a float64 model whose loss is transformers' ``ForCausalLMLoss``
    the float64 equivalent (that function rounds logits to float32, which puts
    a window ~1e-8 from a float64 big batch); returns whether it did. Undo
    with ``del model._loss_function``."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False
    if getattr(model, "loss_function", None) is ForCausalLMLoss and any(
            p.dtype == torch.float64 for p in model.parameters()):
        model.loss_function = _float64_causal_lm_loss
        return True
    return False
