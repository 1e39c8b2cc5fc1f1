"""kvtrace.jit's cross-attention inputs (Mllama's text decoder): what a call's image inputs mean, checked.

    cross_attention_states        [B, N, hidden]  new image features
    cross_attention_mask          [B, 1, T, X]    prepared additive mask over the X image tokens attended
    full_text_row_masked_out_mask [B, 1, T, 1]

T = new tokens, N = new image tokens, X = image tokens the cross layers attend (N_c cached + N new).
"""

from __future__ import annotations

import torch

from kvtrace._errors import UsageError

# Cross-attention inputs (models that take them), after the _SEQ_DIM ones in program order: their shapes.
# T = new tokens, N = new image tokens, X = image tokens the cross layers attend (N_c cached + N new).
_CROSS = {
    "cross_attention_states": "[B, N, hidden]",
    "cross_attention_mask": "[B, 1, T, X]",
    "full_text_row_masked_out_mask": "[B, 1, T, 1]",
}


def _image_tokens(given: dict[str, torch.Tensor], cross_len: int) -> int | None:
    """X: image tokens the cross-attention layers attend in this call (the N_c cached plus the N given);
    None when they do not run (no image features given, none cached): eager skips them."""
    states = given.get("cross_attention_states")  # [B, N, hidden]
    if states is None and not cross_len:
        return None
    return cross_len + (states.shape[1] if states is not None and states.dim() == 3 else 0)


def _unmasked_cross(given: dict[str, torch.Tensor], image: int | None, t_len: int) -> str:
    """CallKey.unmasked_cross: which graph cross layers attending without a mask take (see CallKey)."""
    if image is None or "cross_attention_mask" in given:
        return ""
    return "one-token" if t_len == 1 else "causal"


def _check_cross_inputs(given: dict[str, torch.Tensor], batch: int, t_len: int, hidden: int,
                        image: int | None) -> None:
    """Shapes of the cross-attention inputs against the call (before any tracing)."""
    states = given.get("cross_attention_states")
    if states is not None and (states.dim() != 3 or states.shape[0] != batch or states.shape[1] < 1
                               or states.shape[2] != hidden):
        raise UsageError(
            f"cross_attention_states has shape {list(states.shape)}; expected [B, N, hidden] = [{batch}, N >= 1, "
            f"{hidden}] (batch of the inputs, the text model's hidden_size {hidden})"
        )
    x = "X" if image is None else image
    for name, want in (("cross_attention_mask", [batch, 1, t_len, x]),
                       ("full_text_row_masked_out_mask", [batch, 1, t_len, 1])):
        t = given.get(name)
        if t is None:
            continue
        found = list(t.shape)
        if len(found) != 4 or any(w != "X" and f != w for f, w in zip(found, want, strict=True)):
            raise UsageError(
                f"{name} has shape {found}; expected {_CROSS[name]} = {want} (T = {t_len} new tokens"
                + ("" if image is None else f", X = {image} image tokens the cross-attention layers attend")
                + "): the prepared 4D mask, as MllamaForConditionalGeneration passes it"
            )
