"""Models from config dicts saved before issue 32, when :class:`DecoderConfig` carried every
family's options as fields (33 of them): the removed fields become the parts they now are.

::

    old = json.loads(Path("decoder.json").read_text())     # a DecoderConfig.to_dict() of then
    model = decoder_from_dict(old)                           # same weights' names, same logits
    model.load_state_dict(torch.load("decoder.pt"))

:meth:`DecoderConfig.from_dict` is the config-only half: it translates the rope fields and
refuses (naming them) the fields that now describe parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from attnzoo.blocks import BlockConfig
from attnzoo.models._common import init_weights
from attnzoo.models.config import LEGACY_DECODER_FIELDS, DecoderConfig, legacy_rope
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.parts import DecoderParts, ScaledEmbedding, head_for

__all__ = ["decoder_from_dict"]

#: The old fields that were block settings (they change the blocks DecoderLM builds).
_BLOCK_OPTIONS = ("norm_first", "cross_attention", "context_dim", "qk_norm", "attn_softcap", "sublayer_norm",
                  "layer_windows")


def _block_change(old: Mapping[str, Any], cfg: DecoderConfig) -> Any:
    """``(BlockConfig, layer) -> BlockConfig``: the old block options applied to a layer."""
    owner = "decoder_from_dict"
    if (old["qk_norm"] is not None or old["attn_softcap"] is not None or old["layer_windows"] is not None) \
            and cfg.attention not in ("mha", "sliding"):
        raise ValueError(f"{owner}: qk_norm, attn_softcap and layer_windows need attention='mha' or 'sliding', "
                         f"got {cfg.attention!r}")
    windows = old["layer_windows"]
    if windows is not None and (not isinstance(windows, (list, tuple)) or len(windows) != cfg.depth):
        raise ValueError(f"{owner}: layer_windows must hold depth={cfg.depth} entries, got {windows!r}")

    def change(block: BlockConfig, layer: int) -> BlockConfig:
        akw = dict(block.attention_kwargs or {})
        if windows is not None:
            akw.pop("window", None)
            if windows[layer] is not None:
                akw["window"] = windows[layer]
        if old["qk_norm"] is not None:
            akw["qk_norm"], akw["qk_norm_eps"] = old["qk_norm"], old["qk_norm_eps"]
        if old["attn_softcap"] is not None:
            akw["softcap"] = old["attn_softcap"]
        return block.replace(attention_kwargs=akw or None, cross_attention=old["cross_attention"],
                             context_dim=old["context_dim"], norm_first=old["norm_first"],
                             sublayer_norm=old["sublayer_norm"])

    return change


def _parts(old: Mapping[str, Any], cfg: DecoderConfig, device: Any, dtype: Any) -> DecoderParts:
    """The embedding, final norm and head of the old ``embed_scale``, ``final_norm`` and
    ``head_size``/``logit_softcap`` (``None`` where the default part is the same)."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    V, C = cfg.vocab_size, cfg.dim
    embedding = None if old["embed_scale"] is None else ScaledEmbedding(V, C, scale=old["embed_scale"], **kw)
    use_final = old["norm_first"] if old["final_norm"] is None else old["final_norm"]
    if old["head_size"] is not None and old["logit_softcap"] is not None:
        raise ValueError(f"decoder_from_dict: logit_softcap={old['logit_softcap']} on a head of head_size="
                         f"{old['head_size']} has no part (LMHead caps the vocabulary logits only)")
    head = head_for(C, V, old["head_size"], softcap=old["logit_softcap"], **kw)
    parts = DecoderParts(embedding=embedding, norm=None if use_final else nn.Identity(), head=head)
    for part in (parts.embedding, parts.head):
        if part is not None:
            init_weights(part)  # as the model initialised them then
    return parts


def decoder_from_dict(values: Mapping[str, Any], *, device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None) -> DecoderLM:
    """The :class:`~attnzoo.DecoderLM` a (possibly pre-issue-32) ``DecoderConfig`` dict describes:
    ``rope_*`` -> ``rope``; ``embed_scale`` -> :class:`~attnzoo.models.parts.ScaledEmbedding`;
    ``logit_softcap`` / ``head_size`` -> the head (:func:`~attnzoo.models.parts.head_for`);
    ``final_norm`` -> ``nn.Identity`` for none; ``norm_first``, ``cross_attention``,
    ``context_dim``, ``sublayer_norm``, ``qk_norm``/``qk_norm_eps``, ``attn_softcap``,
    ``layer_windows`` -> the blocks (:meth:`DecoderLM.with_blocks`). Weight names are unchanged,
    so the state dict saved with the dict loads into the result."""
    if not isinstance(values, Mapping):
        raise TypeError(f"decoder_from_dict: values must be a dict, got {type(values).__name__}")
    old = {k: values.get(k, d) for k, d in LEGACY_DECODER_FIELDS.items()}
    core = {k: v for k, v in values.items() if k not in LEGACY_DECODER_FIELDS}
    if "rope" not in core:
        core["rope"] = legacy_rope(old)
    cfg = DecoderConfig.from_dict(core)
    parts = _parts(old, cfg, device, dtype)
    if all(old[k] == LEGACY_DECODER_FIELDS[k] for k in _BLOCK_OPTIONS):
        return DecoderLM(config=cfg, parts=parts, device=device, dtype=dtype)
    return DecoderLM.with_blocks(cfg, _block_change(old, cfg), parts=parts, device=device, dtype=dtype)
