"""DeepSeek's multi-head latent attention helpers shared by the families that use it
(:mod:`attnzoo.models.families.deepseek` — DeepSeek-V3 with its mixture-of-experts layers, V2,
GLM-4-MoE-Lite, Mistral 4 —, Bailing-hybrid, GLM-5-Next): the rope settings of an MLA config
(:func:`mla_rope`: ``rope_interleave`` served by the module's interleaved RoPE, YaRN and the other
fixed-frequency types passed as ``rope_scaling`` with DeepSeek's ``mscale_all_dim`` softmax scale)
and the multi-token-prediction layers a checkpoint holds after the last one (:func:`extra_layer`).
"""

from __future__ import annotations

from typing import Any

from attnzoo.models.hf._state import HFConfig

__all__ = ["extra_layer", "mla_rope"]


def mla_rope(hf: HFConfig) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling dict or None)`` from ``rope_parameters`` / ``rope_scaling``."""
    params = dict(hf.get("rope_scaling", {}, dict))
    params.update(hf.get("rope_parameters", {}, dict))
    base = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0, float)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type in ("dynamic", "longrope"):
        raise hf.unsupported(f"rope_type={rope_type!r} with multi-head latent attention")
    if params.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        raise hf.unsupported(f"partial_rotary_factor={params['partial_rotary_factor']}")
    return base, None if rope_type == "default" else params


def extra_layer(key: str, prefix: str, depth: int) -> bool:
    """A multi-token-prediction layer's key (``layers.{j}`` with ``j >= num_hidden_layers``): unused."""
    head = prefix + "layers."
    index = key[len(head):].split(".", 1)[0] if key.startswith(head) else ""
    return index.isdigit() and int(index) >= depth
