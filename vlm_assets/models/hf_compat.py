"""The transformers calls whose names moved within 5.x, made once: the GPU machine runs 5.17, this
project's pin is the newest 5.x, and the newer names warn (FutureWarning) under the old ones."""

import inspect

import torch.nn as nn


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft wrapper


def cache_argument(model: nn.Module) -> str:
    """The keyword ``model.forward`` takes its KV cache by: ``cache``, or ``past_key_values`` before it."""
    return "cache" if "cache" in inspect.signature(_base(model).forward).parameters else "past_key_values"


def set_activation_checkpointing(model: nn.Module, on: bool = True) -> None:
    """Recompute ``model``'s layer activations in backward (non-reentrant ``torch.utils.checkpoint``), or stop."""
    model = _base(model)
    new = hasattr(model, "activation_checkpointing_enable")
    if not on:
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()
    elif new:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
