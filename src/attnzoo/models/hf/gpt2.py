"""GPT-2 (``GPT2LMHeadModel``, ``GPT2Model``) -> :class:`~attnzoo.DecoderLM`.

GPT-2 stores projections as ``Conv1D`` with weights ``[in, out]``: transposed into
``nn.Linear``'s ``[out, in]``. ``c_attn`` rows (after the transpose) are ``[q; k; v]``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype, transpose
from attnzoo.models.hf.bert import ACTIVATIONS

__all__ = ["convert_gpt2", "gpt2_config"]


def gpt2_config(hf: HFConfig, *, has_head: bool) -> DecoderConfig:
    """The :class:`DecoderConfig` of a GPT-2 config (``has_head``: the checkpoint has its own
    ``lm_head.weight``)."""
    if hf.get("scale_attn_by_inverse_layer_idx", False, bool):
        raise hf.unsupported("scale_attn_by_inverse_layer_idx=True")
    if hf.get("add_cross_attention", False, bool):
        raise hf.unsupported("add_cross_attention=True")
    C = hf.req("n_embd")
    akw = None if hf.get("scale_attn_weights", True, bool) else {"scale": 1.0}
    return DecoderConfig(
        hf.req("vocab_size"), C, hf.req("n_layer"), hf.req("n_head"), attention="mha", attention_kwargs=akw,
        max_seq_len=hf.get("n_positions", 1024), pos="learned", norm="layer",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5, float), ffn=hf.activation("activation_function", ACTIVATIONS),
        ffn_hidden=hf.get("n_inner", 4 * C), tie_embeddings=hf.get("tie_word_embeddings", True, bool) or not has_head,
        bias=True)


def convert_gpt2(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (``transformer.`` prefix of the LM-head class)."""
    cfg = gpt2_config(hf, has_head="lm_head.weight" in sd)
    model = DecoderLM.from_config(cfg, device=device, dtype=dtype or float_dtype(sd))
    prefix = "transformer." if any(k.startswith("transformer.") for k in sd) else ""
    plan = Plan(Source(sd, prefix), "GPT-2")
    plan.put("tok_emb.weight", "wte.weight")
    plan.put("pos_emb.weight", "wpe.weight")
    for i in range(cfg.depth):
        h, o = f"h.{i}.", f"blocks.{i}."
        plan.put_pairs(o, h, [("attn_norm", "ln_1"), ("ffn_norm", "ln_2")])
        for ours, theirs in (("attn.qkv_proj", "attn.c_attn"), ("attn.out_proj", "attn.c_proj"),
                             ("ffn.up_proj", "mlp.c_fc"), ("ffn.down_proj", "mlp.c_proj")):
            plan.put(f"{o}{ours}.weight", f"{h}{theirs}.weight", transpose)  # Conv1D [in, out]
            plan.put(f"{o}{ours}.bias", f"{h}{theirs}.bias")
    plan.put_pairs("", "", [("norm", "ln_f")])
    ignore = [r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)"]
    plan.head(cfg.tie_embeddings, ignore)
    plan.apply(model, ignore=ignore)
    return model
