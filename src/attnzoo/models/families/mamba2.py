"""Mamba-2 -> :class:`~attnzoo.DecoderLM`: ``Mamba2ForCausalLM`` and ``Mamba2Model``
(Codestral Mamba's architecture).

Every layer is mixer-only (a block built with ``feed_forward=None``): ``x + mixer(norm(x))``, the
Mamba-2 SSD mixer of :mod:`attnzoo.models.families._mamba` (keys ``num_heads``, ``head_dim``,
``state_size``, ``n_groups``, ``conv_kernel``, ``expand``; every norm's epsilon
``layer_norm_epsilon``). Checkpoint names: ``backbone.embeddings`` (legacy ``embedding``),
``backbone.layers.{i}.norm`` / ``.mixer``, ``backbone.norm_f``, ``lm_head``.

``residual_in_fp32`` (transformers keeps the residual stream in float32 under a half dtype) is not
reproduced: in float32 the two agree; in bfloat16 attnzoo's residual stream is bfloat16.
"""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._mamba import MambaKeys, mamba_factory, put_mamba
from attnzoo.models.hf._state import HFConfig
from attnzoo.nn.mamba2 import Mamba2

__all__ = ["DISPATCH", "MAMBA2_KEYS", "backbone_names", "build_mamba2", "convert_mamba2"]

MAMBA2_KEYS = MambaKeys("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "expand",
                        "use_conv_bias", "use_bias", "layer_norm_epsilon")


def build_mamba2(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``Mamba2Config`` (random weights; see the module docstring)."""
    C, kw = hf.req("hidden_size"), {"device": device, "dtype": dtype}
    eps = hf.get("layer_norm_epsilon", 1e-5, float)
    mixer, norm = mamba_factory(hf, MAMBA2_KEYS, **kw), parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, mixer, None, norm) for _ in range(hf.req("num_hidden_layers"))]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, heads=hf.req("num_heads"), **kw)


def backbone_names(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """The checkpoint's names as the shared helpers read them: no ``backbone.`` prefix,
    ``embeddings`` (or the legacy ``embedding``) -> ``embed_tokens``, ``norm_f`` -> ``norm``."""
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        key = key.removeprefix("backbone.")
        for old, new in (("embeddings.", "embed_tokens."), ("embedding.", "embed_tokens."), ("norm_f.", "norm.")):
            if key.startswith(old):
                key = new + key[len(old):]
        out[key] = t
    return out


def convert_mamba2(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    model, plan, head_size = parts.start(hf, backbone_names(sd), build_mamba2, device=device, dtype=dtype)
    for i, block in enumerate(model.blocks):
        put_mamba(plan, f"blocks.{i}.attn.", f"layers.{i}.mixer.", cast(Mamba2, block.attn))
        plan.put(f"blocks.{i}.attn_norm.weight", f"layers.{i}.norm.weight")
    return parts.finish(plan, model, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"mamba2": parts.Dispatch("Mamba-2", convert_mamba2, ("Mamba2ForCausalLM", "Mamba2Model"))}
