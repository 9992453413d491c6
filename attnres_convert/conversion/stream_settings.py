"""Base-model settings that act on the residual stream between decoder layers, outside the layers.

A converted layer hands the next one a depth-attention state, not a tensor, so a base model whose own loop
does arithmetic on the hidden states between its layers cannot run that arithmetic on it. Two base models do,
at inference only, for reasons of range or memory rather than of the function they compute; their converted
models run with the setting off, which computes the same function:

* RWKV halves its stream every `rescale_every` layers and divides the later layers' output weights to match, so
  that fp16 stays in range. Every reader of the stream is a LayerNorm, which the halving does not change (up to
  its eps). The converted model keeps the stream and the weights as trained.
* xLSTM runs a prompt longer than `max_inference_chunksize` chunk by chunk, writing each chunk's hidden states
  into one tensor. The converted model runs the prompt whole (the recurrent state it hands on is the same).

`settle` turns the setting off on a base model before it is traced and converted; the converted config keeps
it off, so the folder loads that way anywhere.
"""

from __future__ import annotations

from torch import nn

# model type -> (config attribute, the value the converted model runs with)
SETTINGS: dict[str, tuple[str, int]] = {"rwkv": ("rescale_every", 0), "xlstm": ("max_inference_chunksize", 2**31 - 1)}


def settle(model: nn.Module) -> None:
    """Turn MODEL's stream setting off (see the module docstring), in place, undoing what the base model has
    already done under it: RWKV divides its weights in place at its first inference forward, and multiplies
    them back only in training mode."""
    config = model.config
    setting = SETTINGS.get(getattr(config, "model_type", None))
    if setting is None:
        return
    for module in model.modules():
        if getattr(module, "layers_are_rescaled", False):
            was_training = module.training
            module.train()
            module._rescale_layers()  # in training mode: multiplies the divided weights back
            module.train(was_training)
    attribute, value = setting
    setattr(config, attribute, value)
