"""The DeepSeek MLA lineage -> :class:`~attnzoo.DecoderLM`: transformers' ``deepseek_v3``
(DeepSeek-V3, R1, V3.1, Kimi K2), ``deepseek_v2`` (DeepSeek-V2, V2-Lite, V2.5) and their
descendants ``glm4_moe_lite``, ``mistral4``, ``minicpm5_moe``, ``deepseek_ocr2_text``, ``axk1`` (SK Telecom's A.X-K1) and
the DeepSeek-sparse-attention models ``deepseek_v32`` (DeepSeek-V3.2) and ``glm_moe_dsa`` (GLM-5's
DSA MoE), ``sarvam_mla`` (Sarvam-105B), the dense ``youtu`` (Youtu-LLM) and ``minicpm3`` (MiniCPM3),
``axk2`` (A.X-K2) and ``longcat_flash`` (Meituan's LongCat-Flash); the ``*ForCausalLM`` and base
``*Model`` classes of each.

Every layer is pre-norm (``input_layernorm``, ``post_attention_layernorm``: RMSNorms of
``rms_norm_eps``) around:

* Attention: :class:`~attnzoo.nn.mla.MultiHeadLatentAttention` with RoPE on its
  ``qk_rope_head_dim`` channels (``modeling_deepseek_v3.py`` 333-468, ``modular_deepseek_v2.py``
  232-365). The weights keep transformers' names except ``kv_a_proj_with_mqa -> kv_a_proj``,
  ``q_a_layernorm -> q_a_norm``, ``kv_a_layernorm -> kv_a_norm``, ``o_proj -> out_proj``; the
  latent RMSNorms use transformers' fixed epsilon 1e-6 (``DeepseekV3RMSNorm(q_lora_rank)``).
  ``q_lora_rank=None``: a full ``q_proj``. ``attention_bias``: biases on ``q_a_proj``,
  ``kv_a_proj_with_mqa`` and ``o_proj`` only. RoPE rotates adjacent channel pairs: ``rope_interleave``
  (``modeling_deepseek_v3.py`` 294-330), DeepSeek-V2's complex product on pairs ``(2i, 2i + 1)``
  (``modular_deepseek_v2.py`` 139-152, always interleaved); ``rope_interleave=False`` rotates split
  halves. YaRN and the other fixed-frequency rope types scale cos/sin by their attention factor and
  the softmax scale ``1 / sqrt(dn + dr)`` by ``mscale(factor, mscale_all_dim)^2``
  (``modeling_deepseek_v3.py`` 389, ``yarn_apply_mscale``).
* Feed-forward: a dense SwiGLU (``intermediate_size``) on the dense layers -- ``i <
  first_k_dense_replace`` (``modeling_deepseek_v3.py`` 470-480, ``modular_deepseek_v2.py`` 369), or
  ``mlp_layer_types[i] == "dense"`` (GLM-4-MoE-Lite, MiniCPM5-MoE; by default the first layer only,
  ``modular_glm4_moe_lite.py`` 125, 164) -- and a mixture of experts on the others, stacked as
  transformers holds them (``experts.gate_up_proj [E, 2F, C]`` rows ``[gate; up]``,
  ``experts.down_proj [E, C, F]``; saved folders with one tensor per expert load too), plus
  ungated shared experts (a SwiGLU of ``moe_intermediate_size * n_shared_experts``; none when 0):

  - DeepSeek-V3, GLM-4-MoE-Lite, MiniCPM5-MoE (``modeling_deepseek_v3.py`` 119-226):
    :func:`~._moe.deepseek_moe`: router logits in float32, sigmoid scores; the experts chosen by
    ``score + e_score_correction_bias`` among the ``topk_group`` best of ``n_group`` groups (a
    group's score: its two best biased scores), weighted by the unbiased scores, renormalised
    (``norm_topk_prob``, ``+ 1e-20``), times ``routed_scaling_factor``.
  - DeepSeek-V2 (``modular_deepseek_v2.py`` 159-209): :class:`SoftmaxGroupMoE`: float32 softmax
    scores, ``topk_method="greedy"`` the top ``num_experts_per_tok``, ``"group_limited_greedy"``
    the top among the ``topk_group`` groups of best *maximum* score (the others zeroed); never
    renormalised (transformers' V2 router drops ``norm_topk_prob``), times
    ``routed_scaling_factor``. ``mlp_bias`` puts biases on the dense MLP and the shared experts
    (``LlamaMLP``), not on the routed experts.
  - Mistral-4 (``modular_mistral4.py`` 65-96): :class:`SoftmaxGroupMoE` with softmax scores in the
    hidden states' dtype, groups scored by their two best, renormalised (``norm_topk_prob``).
* Mistral-4's attention (``modular_mistral4.py`` 106-160) also scales every query channel by
  ``1 + llama_4_scaling_beta * log(1 + floor(p / original_max_position_embeddings))``
  (:class:`PositionScaledLatentAttention`); ``p`` counts from a row's first real token, as
  transformers' ``generate`` computes it (its forward without ``position_ids`` counts left
  padding too). Its ``partial_rotary_factor`` is the rope channels' share of the query head
  (``configuration_mistral4.py`` 107-128: the absent ``rope_parameters`` default to that YaRN).
* MiniCPM5-MoE's attention is not latent (``modular_minicpm5_moe.py`` 174-227): grouped-query
  attention (``head_dim``, ``num_key_value_heads``) with split-half RoPE of ``rope_parameters`` and
  an element-wise sigmoid output gate: ``q_gate_proj`` rows ``[q_h; gate_h]`` per head go to the
  query rows of :class:`~attnzoo.MultiHeadAttention` and its ``output_gate="element"``.
* DeepSeek-OCR2's text model (``deepseek_ocr2_text``, ``modular_deepseek_ocr2.py`` 576-936; built only
  inside ``DeepseekOcr2ForConditionalGeneration``, the ``deepseek_ocr2`` wrapper) is DeepSeek-V2's layer
  with LLaMA's attention in place of the latent one: grouped-query q/k/v/o (all biased by
  ``attention_bias``), ``head_dim`` always ``hidden_size // num_attention_heads`` (its config overwrites
  a given one), split-half RoPE of ``rope_parameters``; DeepSeek-V2's softmax MoE (``topk_method``) on the
  ``sparse`` layers of ``mlp_layer_types``, which it requires (no default: its layers index it).
* A.X-K1 (``modular_axk1.py``) is DeepSeek-V3 (always a ``q_lora_rank``) whose MoE output is
  RMS-normalised (``post_mlp_layernorm``, ``rms_norm_eps``; l. 169-187): :class:`PostNormMoE`. Its
  layer kinds: ``mlp_layer_types``, else ``sparse`` where ``i >= first_k_dense_replace`` (default 1)
  and ``i % moe_layer_freq == 0`` (l. 137-143; this ``moe_layer_freq`` transformers honours). Its
  released checkpoints keep the norm on the layer (``layers.{i}.post_mlp_layernorm``, also on the dense
  layers, unused) and route without ``e_score_correction_bias`` (0 when absent): both load.
* DeepSeek-V3.2 and GLM-MoE-DSA (``modular_deepseek_v32.py``, ``modular_glm_moe_dsa.py`` of
  transformers 5.25): every layer's attention is DeepSeek-V3's latent attention (always a
  ``q_lora_rank``, always interleaved RoPE: their configs have no ``rope_interleave``, l. 303) in
  which each query attends only the ``index_topk`` keys its "lightning indexer" scores best
  (``DeepseekV32Indexer``, l. 172-267; the selection folded into the eager mask, l. 322-336):
  :class:`IndexedLatentAttention` with a :class:`LightningTopK` (``indexer.wq_b``, ``wk``,
  ``k_norm``, ``weights_proj`` under transformers' names). The indexer rotates the first
  ``qk_rope_head_dim`` channels of its queries and keys with the attention's cos/sin: split halves
  in V3.2 (l. 246), adjacent pairs in GLM-MoE-DSA (``modular_glm_moe_dsa.py`` 173). Its decode cache
  keeps every token's index key beside the latent. The feed-forward is DeepSeek-V3's, the layer kinds
  from ``mlp_layer_types`` (default: ``first_k_dense_replace = 3`` dense layers). Exact score ties at
  the top-k cut (keys scoring 0 after the ReLU, frequent with few index heads) are broken by
  ``torch.topk`` over the same row as transformers (the full forward: ``[B, N, M]`` rows with the
  invisible keys at the float32 minimum; a decode step: its one row), so attnzoo's full forward
  equals transformers' full forward and its cached decode transformers' cached decode; at such ties
  the two differ from each other, in transformers as here (measured on 2-4 index heads: 0.18-0.98
  relative on the logits; without ties they agree to ~1e-6). Packed sequences run one at a time.
* Sarvam-MLA (``sarvam_mla``: transformers builds its ``DeepseekV3ForCausalLM`` / ``DeepseekV3Model``
  from a ``SarvamMLAConfig``) is DeepSeek-V3 with its own defaults (a full query projection, one
  expert group, one dense layer); its original ``config.json`` names read as transformers'
  ``SarvamMLAConfig.__post_init__`` reads them (``configuration_sarvam_mla.py`` 129-153):
  ``num_experts`` / ``num_shared_experts`` / ``num_local_experts`` / ``num_mtp_layers`` under their
  DeepSeek names, ``rope_scaling.type = "deepseek_yarn"`` as YaRN, ``head_dim`` / ``q_head_dim`` derived.
* Youtu-LLM (``modular_youtu.py``) is DeepSeek-V3's latent attention (``rope_interleave``) in a dense
  LLaMA stack: every layer's feed-forward the SwiGLU of ``intermediate_size``, no experts; its head
  tied by default.
* MiniCPM3 (``modeling_minicpm3.py``) is the same dense latent-attention stack with split-half RoPE
  always (l. 322: no ``rope_interleave``), ``mlp_bias``, ``v_head_dim`` defaulting to
  ``hidden_size // num_attention_heads``, and MiniCPM's three multipliers: the token embeddings times
  ``scale_emb`` (a :class:`~attnzoo.models.parts.ScaledEmbedding`), every residual branch times
  ``scale_depth / sqrt(num_hidden_layers)`` (l. 364-393; folded into ``o_proj`` with its bias and the
  MLP's ``down_proj``), the final hidden states divided by ``hidden_size / dim_model_base`` before the
  LM head (l. 556; folded into the final norm's weight of a ``*ForCausalLM``, as Granite's
  ``logits_scaling``: a base ``*Model`` is unscaled). ``scale_depth`` / ``dim_model_base`` written as
  ``null`` mean no scaling (``sqrt(num_hidden_layers)``, ``hidden_size``), as its config reads them.
* A.X-K2 (``modular_axk2.py``, A.X-K1's successor) is DeepSeek-V3.2's indexed latent attention (split-half
  RoPE in the indexer) with three changes: the queries and a per-channel output gate come from one
  projection of the normalised and the raw query latent, ``q_gate_proj`` on ``[q_a_norm(c); c]``
  (no ``q_b_proj``; the heads' outputs times ``sigmoid(gate)`` before ``o_proj``, l. 265-397:
  :class:`GatedQueryLatentAttention`); ``input_layernorm`` on every layer and
  ``post_attention_layernorm`` on the MoE layers are RMSNorms gated by a low-rank MLP of their own
  output (``gated_norm_rank``, l. 193-207: :class:`SigmoidGatedRMSNorm`); the MoE is DeepSeek-V3's
  with no expert groups by default (``n_group = None``) and, with groups, the dropped groups' experts
  scored 0 rather than ``-inf`` (l. 219-237: :class:`ZeroFilledGroupsMoE`). Layer kinds as A.X-K1's.
  Saved folders keep the released names (``q_b_proj`` for ``q_gate_proj``, ``W_down`` / ``W_up`` for the
  gate MLP's ``fc1`` / ``fc2``, one tensor per expert): both load.
* LongCat-Flash (``modeling_longcat_flash.py``; :func:`convert_longcat`, :func:`build_longcat`) stacks
  ``num_layers`` :class:`LongcatLayer` s (``num_hidden_layers`` is twice that): two pre-norm latent
  attentions (always a ``q_lora_rank``, interleaved RoPE), each followed by a dense SwiGLU
  (``ffn_hidden_size``), and a shortcut :class:`ZeroExpertMoE` that reads the first MLP's input and
  joins after the second MLP. Its attention multiplies the queries by ``sqrt(hidden_size / q_lora_rank)``
  and the normalised latent by ``sqrt(hidden_size / kv_lora_rank)`` (l. 351-352, 394-396): folded into
  ``q_b_proj`` and ``kv_a_layernorm``'s weight. The MoE routes a float32 softmax over ``n_routed_experts
  + zero_expert_num`` experts, chooses by ``p + e_score_correction_bias``, weights by ``p *
  routed_scaling_factor`` (not renormalised); a zero-computation expert passes the token through
  (times its weight). The router's ``router_bias`` is never added by transformers (l. 143): its
  ``classifier.bias`` is not loaded. The multi-token-prediction module ``model.mtp.*`` is dropped.
* Multi-token-prediction layers (``layers.{j}`` with ``j >= num_hidden_layers``, V3's
  ``num_nextn_predict_layers``) are not part of the causal LM, and transformers drops them
  (``modeling_deepseek_v3.py`` 536). A DeepSeek-V3 / Sarvam-MLA checkpoint folder that holds them
  loads them as the model's ``mtp`` (:mod:`attnzoo.models.mtp`; each a MoE decoder layer with
  ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, as transformers' ``MtpModel`` builds them
  for ``generate(use_mtp=True)``); the other types' are dropped.

A ``config.json`` that leaves keys out reads them as :data:`DEFAULTS` (the config classes' defaults).

Refused by name: ``num_key_value_heads != num_attention_heads`` for latent attention (every head
reads the one latent), ``pretraining_tp != 1``, the ``dynamic`` / ``longrope`` rope types and a
``partial_rotary_factor`` other than the rope channels' (:func:`~attnzoo.models.hf.deepseek.mla_rope`;
MiniCPM5-MoE: other than 1), an activation other than SiLU in the experts (the dense layers take
any gated one), a ``topk_method`` other than ``greedy`` / ``group_limited_greedy`` (V2),
DeepSeek-OCR2's missing ``mlp_layer_types``, a width not a multiple of its heads and a
``partial_rotary_factor``, ``moe_layer_freq != 1`` (transformers ignores it: a checkpoint trained with it would run
differently there), expert groups that do not divide the experts (into groups of >= 2 where a
group is scored by its two best) or cannot hold ``num_experts_per_tok`` in the ``topk_group``
kept, MiniCPM5-MoE's ``attention_bias``; for the DSA models ``q_lora_rank=None`` (a ``config.json``
only: transformers' config rejects it; A.X-K2 too), ``index_head_dim < qk_rope_head_dim``, and GLM-MoE-DSA's
``shared`` layers (``indexer_types``, or as derived from ``index_topk_pattern`` /
``index_topk_freq`` / ``index_skip_topk_offset``: a layer reusing the previous layer's top-k); MiniCPM3's
``scale_emb <= 0`` and ``dim_model_base == 0``; LongCat-Flash's ``head_dim != qk_rope_head_dim``,
``qk_head_dim != qk_nope_head_dim + qk_rope_head_dim`` (transformers' shapes would not fit), a null
``q_lora_rank``, an activation other than SiLU, ``num_key_value_heads != num_attention_heads``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import FeedForward, make_norm
from attnzoo.masks import Mask
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import deepseek_moe, put_moe, put_per_expert, put_stacked_experts
from attnzoo.models.families.granitemoehybrid import finish_folded
from attnzoo.models.families.kimi_linear import mlp_types, put_mla
from attnzoo.models.families.qwen3_next import real_keys
from attnzoo.models.families.qwen4_exp import IndexerCache
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.deepseek import extra_layer, mla_rope
from attnzoo.models.mtp import MTPLayer, MultiTokenPredictor
from attnzoo.nn.cache import CacheList
from attnzoo.nn.mla import LatentCache, MLAOptions, MLASizes, MultiHeadLatentAttention
from attnzoo.nn.moe import MixtureOfExperts, Routing
from attnzoo.nn.parts import placed
from attnzoo.nn.positional import resolve_positions
from attnzoo.variants import build_attention

__all__ = ["CLASSES", "DEFAULTS", "DISPATCH", "GatedQueryLatentAttention", "IndexedLatentAttention", "LightningTopK",
           "LongcatLayer", "PositionScaledLatentAttention", "PostNormMoE", "SigmoidGatedRMSNorm", "SoftmaxGroupMoE",
           "SoftmaxRouting", "ZeroExpertMoE", "ZeroFilledGroupsMoE", "build_deepseek", "build_longcat", "canonical",
           "convert_deepseek", "convert_longcat", "indexed_attention", "moe_layers", "position_scaled_attention",
           "scale_planned"]

_COMMON: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "attention_dropout": 0.0, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "pretraining_tp": 1, "rope_theta": 10000.0,
}

#: the config classes' defaults of the keys read here (``DeepseekV3Config``, ``DeepseekV2Config``),
#: for a ``config.json`` that leaves them out
DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {**_COMMON, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "n_group": 8,
                    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
                    "max_position_embeddings": 4096, "rope_interleave": True},
    "deepseek_v2": {**_COMMON, "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
                    "moe_intermediate_size": 1407, "num_hidden_layers": 32, "num_attention_heads": 32,
                    "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0,
                    "first_k_dense_replace": 0, "max_position_embeddings": 2048, "topk_method": "greedy",
                    "mlp_bias": False},
    "glm4_moe_lite": {**_COMMON, "vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240,
                      "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
                      "n_shared_experts": 1, "n_routed_experts": 64, "routed_scaling_factor": 1.8, "q_lora_rank": 768,
                      "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1,
                      "num_experts_per_tok": 4, "norm_topk_prob": True, "max_position_embeddings": 202752,
                      "rms_norm_eps": 1e-5, "rope_interleave": True},
    "mistral4": {**_COMMON, "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 12288,
                 "moe_intermediate_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0, "kv_lora_rank": 256,
                 "q_lora_rank": 1024, "qk_nope_head_dim": 64, "n_group": 1, "topk_group": 1,
                 "num_experts_per_tok": 4, "first_k_dense_replace": 0, "norm_topk_prob": True,
                 "max_position_embeddings": 1048576, "rope_interleave": True},
    "minicpm5_moe": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
                     "attention_dropout": 0.0, "rope_theta": 5_000_000.0, "vocab_size": 130560, "hidden_size": 2048,
                     "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 32,
                     "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 524288,
                     "moe_intermediate_size": 512, "num_experts_per_tok": 16, "n_shared_experts": 1,
                     "n_routed_experts": 160, "routed_scaling_factor": 3.66, "n_group": 1, "topk_group": 1,
                     "norm_topk_prob": True},
    "axk1": {**_COMMON, "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
             "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64, "n_shared_experts": 1,
             "n_routed_experts": 192, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
             "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 32768,
             "rope_interleave": True},
    "deepseek_v32": {**_COMMON, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                     "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                     "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "n_group": 8,
                     "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
                     "max_position_embeddings": 163840, "index_topk": 2048, "index_head_dim": 128,
                     "index_n_heads": 64},
    "glm_moe_dsa": {**_COMMON, "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
                    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "q_lora_rank": 2048,
                    "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
                    "max_position_embeddings": 202752, "rms_norm_eps": 1e-5, "index_topk": 2048,
                    "index_head_dim": 128, "index_n_heads": 32},
    "sarvam_mla": {**_COMMON, "vocab_size": 262144, "hidden_size": 4096, "intermediate_size": 16384,
                   "moe_intermediate_size": 2048, "num_hidden_layers": 32, "num_attention_heads": 64,
                   "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 2.5, "q_lora_rank": None,
                   "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
                   "norm_topk_prob": True, "max_position_embeddings": 4096, "rope_interleave": True},
    "youtu": {**_COMMON, "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 6144,
              "num_hidden_layers": 32, "num_attention_heads": 16, "max_position_embeddings": 131072,
              "tie_word_embeddings": True, "rope_interleave": True},
    "minicpm3": {**_COMMON, "vocab_size": 73448, "hidden_size": 2560, "intermediate_size": 6400, "num_hidden_layers": 62,
                 "num_attention_heads": 40, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                 "tie_word_embeddings": True, "mlp_bias": False, "kv_lora_rank": 256, "q_lora_rank": 768,
                 "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": None, "scale_emb": 12,
                 "scale_depth": 1.4, "dim_model_base": 256},
    "axk2": {**_COMMON, "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 5120, "moe_intermediate_size": 512,
             "num_hidden_layers": 48, "num_attention_heads": 32, "n_shared_experts": 1, "n_routed_experts": 128,
             "routed_scaling_factor": 2.5, "kv_lora_rank": 128, "q_lora_rank": 384, "qk_rope_head_dim": 32,
             "v_head_dim": 64, "qk_nope_head_dim": 64, "num_experts_per_tok": 8, "norm_topk_prob": True,
             "max_position_embeddings": 131072, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 16,
             "gated_norm_rank": 16, "n_group": None, "topk_group": None},
    "deepseek_ocr2_text": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                           "attention_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1, "mlp_bias": False,
                           "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
                           "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
                           "moe_intermediate_size": 1407, "n_shared_experts": 2, "n_routed_experts": 64,
                           "routed_scaling_factor": 1.0, "topk_method": "greedy"},
    "longcat_flash": {**_COMMON, "vocab_size": 131072, "hidden_size": 6144, "num_layers": 28, "num_attention_heads": 64,
                      "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 10_000_000.0,
                      "ffn_hidden_size": 12288, "head_dim": 64, "moe_topk": 12, "n_routed_experts": 512,
                      "zero_expert_num": 256, "expert_ffn_hidden_size": 2048, "routed_scaling_factor": 6.0},
}

TOPK_METHODS = ("greedy", "group_limited_greedy")
#: the model types routing as DeepSeek-V3 (sigmoid scores, ``e_score_correction_bias``)
#: the types whose checkpoints' multi-token-prediction layers transformers' ``use_mtp`` reads (loaded here)
MTP = ("deepseek_v3", "sarvam_mla")
SIGMOID = ("deepseek_v3", "glm4_moe_lite", "minicpm5_moe", "deepseek_v32", "glm_moe_dsa", "axk1", "sarvam_mla",
           "axk2")
#: the dense model types: every layer's feed-forward the SwiGLU of ``intermediate_size``
DENSE = ("youtu", "minicpm3")
#: per model type, the config names transformers' ``attribute_map`` reads as others (alias -> name)
ALIASES: dict[str, dict[str, str]] = {
    "sarvam_mla": {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
                   "num_shared_experts": "n_shared_experts", "num_mtp_layers": "num_nextn_predict_layers"},
    "longcat_flash": {"num_local_experts": "n_routed_experts", "num_experts_per_tok": "moe_topk",
                      "intermediate_size": "ffn_hidden_size", "moe_intermediate_size": "expert_ffn_hidden_size"},
}
#: the model types whose layers list their kinds in ``mlp_layer_types`` (default: one dense layer;
#: DeepSeek-OCR2's has none: required)
LAYER_TYPED = ("glm4_moe_lite", "minicpm5_moe", "deepseek_v32", "glm_moe_dsa", "axk1", "axk2", "deepseek_ocr2_text")
#: the model types routing as DeepSeek-V2 (softmax, ``topk_method``, never renormalised)
V2_ROUTED = ("deepseek_v2", "deepseek_ocr2_text")
#: the model types whose attention is not latent: grouped-query attention with split-half RoPE
GQA = ("minicpm5_moe", "deepseek_ocr2_text")
#: the DeepSeek-sparse-attention model types (every layer an :class:`IndexedLatentAttention`)
DSA = ("deepseek_v32", "glm_moe_dsa", "axk2")
#: A.X-K1 and A.X-K2: layer kinds from ``first_k_dense_replace`` / ``moe_layer_freq`` when ``mlp_layer_types`` is absent
AXK = ("axk1", "axk2")


@dataclass(frozen=True)
class SoftmaxRouting:
    """The softmax routing of :class:`SoftmaxGroupMoE`.

    Attributes:
        scaling: ``routed_scaling_factor`` on the kept weights.
        groups: expert groups ``G`` (1: plain top-k).
        topk_groups: the groups a token's experts may come from.
        group_score: a group's score: ``"max"`` its best probability (DeepSeek-V2), ``"top2"`` the
            sum of its two best (Mistral-4).
        norm_topk_prob: renormalise the kept probabilities (``+ 1e-20``; Mistral-4; V2 never does).
        float32: the router's matmul in float32 (V2 keeps its router in float32; Mistral-4 routes
            in the hidden states' dtype).
    """

    scaling: float = 1.0
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    norm_topk_prob: bool = False
    float32: bool = True


class SoftmaxGroupMoE(MixtureOfExperts):
    """DeepSeek-V2's / Mistral-4's mixture of experts: softmax routing, optionally group-limited.

    Args:
        dim, hidden, num_experts, top_k: as :class:`~attnzoo.nn.moe.MixtureOfExperts`.
        routing: a :class:`SoftmaxRouting`.
        shared_expert: the ungated shared experts' module, or ``None``.
        device, dtype: of the parameters.

    Routing of ``x [T, C]``: ``p = softmax(x W_r^T)`` (``[T, E]``); with groups, the experts
    outside the ``topk_groups`` groups of best score get ``p = 0``; the weights are the top-``k``
    ``p`` (renormalised with ``norm_topk_prob``) times ``scaling``. Weights as
    :class:`~attnzoo.nn.moe.MixtureOfExperts` (no ``score_bias``).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, routing: SoftmaxRouting,
                 shared_expert: nn.Module | None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, hidden, num_experts, top_k, routing=Routing("softmax_topk", scaling=routing.scaling),
                         shared_expert=shared_expert, device=device, dtype=dtype)
        G, g, smallest = routing.groups, routing.topk_groups, 2 if routing.group_score == "top2" else 1
        if routing.group_score not in ("max", "top2"):
            raise ValueError(f"SoftmaxGroupMoE: group_score must be 'max' or 'top2', got {routing.group_score!r}")
        if G < 1 or num_experts % G or (G > 1 and num_experts // G < smallest) or not 1 <= g <= G \
                or top_k > g * (num_experts // G):
            raise ValueError(f"SoftmaxGroupMoE: groups={G} must divide num_experts={num_experts} (groups of >= "
                             f"{smallest}), 1 <= topk_groups={g} <= groups, and top_k={top_k} fit the kept groups")
        self.softmax_routing = routing

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(weights [T, k], experts [T, k], logits [T, E])`` of ``x [T, C]`` (see the class docstring)."""
        r = self.softmax_routing
        wide = torch.promote_types(x.dtype, torch.float32) if r.float32 else x.dtype
        logits = F.linear(x.to(wide), self.router.weight.to(wide))  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32)).to(wide)
        choice = probs
        if r.groups > 1:
            by_group = probs.unflatten(-1, (r.groups, -1))  # [T, G, E / G]
            score = by_group.amax(-1) if r.group_score == "max" else by_group.topk(2, dim=-1).values.sum(-1)  # [T, G]
            best = score.topk(r.topk_groups, dim=-1).indices  # [T, topk_groups]
            keep = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, best, True)  # [T, G]
            choice = by_group.masked_fill(~keep.unsqueeze(-1), 0.0).flatten(-2)
        experts = torch.topk(choice, self.top_k, dim=-1).indices  # [T, k]
        weights = probs.gather(-1, experts)
        if r.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * r.scaling).to(x.dtype), experts, logits

    def extra_repr(self) -> str:
        r = self.softmax_routing
        return (f"{super().extra_repr()}, groups={r.groups}, topk_groups={r.topk_groups}, "
                f"group_score={r.group_score!r}, norm_topk_prob={r.norm_topk_prob}")


class ScaledQueries:
    """A mixin for a :class:`~attnzoo.nn.mla.MultiHeadLatentAttention` whose queries (nope and rope
    channels) are multiplied by a factor of their position, ``_scale_of(pos)`` (``pos [N]`` or
    ``[B, N]`` -> broadcastable to ``[B, H, N, 1]``), in the materialised and absorbed forms."""

    _query_scale: Tensor | None = None
    #: the class's own factor of the positions (a method; checked when the class is defined)
    _scale_of: Callable[[Tensor], Tensor]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not callable(getattr(cls, "_scale_of", None)):
            raise TypeError(f"{cls.__name__}: a ScaledQueries class defines _scale_of(pos) -> its query factors")

    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        q_nope, q_pe = super()._queries(x)  # type: ignore[misc]  # [B, H, N, dn], [B, H, N, dr]
        if self._query_scale is None:
            return q_nope, q_pe
        f = self._query_scale.to(q_nope.dtype)
        return q_nope * f, q_pe * f

    def _attention(self, x: Tensor, mask: Tensor | Mask | None, cache: LatentCache | None, positions: Tensor | None,
                   return_weights: bool) -> tuple[Tensor, Tensor | None]:
        start = 0 if cache is None else cache.length
        self._query_scale = self._scale_of(resolve_positions(positions, x.shape[1], start, x.device, batch=x.shape[0]))
        try:
            return super()._attention(x, mask, cache, positions, return_weights)  # type: ignore[misc,no-any-return]
        finally:
            self._query_scale = None


class PositionScaledLatentAttention(ScaledQueries, MultiHeadLatentAttention):
    """Multi-head latent attention whose queries are scaled by their position (Mistral-4's
    ``llama_4_scaling_beta``, ``modeling_ministral3.py`` 105-107)::

        q(p) = q * (1 + beta * log(1 + floor(p / original_max_position_embeddings)))

    on every channel (nope and rope) before attention, in every form (materialised, absorbed, packed:
    positions restarting per sequence as the RoPE's).

    Args (``dim``, ``num_heads``, ``sizes``, ``bias``, ``options`` as for
    :class:`~attnzoo.nn.mla.MultiHeadLatentAttention`):
        beta: ``llama_4_scaling_beta``.
        original: ``original_max_position_embeddings`` (``> 0``).

    Build under ``with torch.device(...)`` for the device (or through :func:`position_scaled_attention`).
    """

    def __init__(self, dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions, beta: float,
                 original: int) -> None:
        super().__init__(dim, num_heads, kv_lora_rank=sizes.kv_lora_rank, qk_nope_head_dim=sizes.qk_nope_head_dim,
                         qk_rope_head_dim=sizes.qk_rope_head_dim, v_head_dim=sizes.v_head_dim,
                         q_lora_rank=sizes.q_lora_rank, bias=bias, rope=True, options=options)
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ValueError(f"PositionScaledLatentAttention: original must be an int >= 1, got {original!r}")
        self.beta, self.original = float(beta), original

    def _scale_of(self, pos: Tensor) -> Tensor:
        """``[..., 1, N, 1]`` factors of positions ``pos [N]`` or ``[B, N]``."""
        f = 1 + self.beta * torch.log1p(torch.floor(pos.to(torch.float64) / self.original))
        f = f[None, None] if f.dim() == 1 else f[:, None]  # [1 | B, 1, N]
        return f.unsqueeze(-1)

    def _packed(self, x: Tensor, cu_seqlens: Tensor) -> Tensor:
        t, cu = torch.arange(x.shape[1], device=x.device), cu_seqlens.to(x.device).long()
        self._query_scale = self._scale_of(t - cu[torch.searchsorted(cu[1:], t, right=True)])  # restarting per sequence
        try:
            return super()._packed(x, cu_seqlens)
        finally:
            self._query_scale = None

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, beta={self.beta}, original={self.original}"


def position_scaled_attention(dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions,
                              scaling: tuple[float, int], device: Any = None,
                              dtype: Any = None) -> PositionScaledLatentAttention:
    """A :class:`PositionScaledLatentAttention` (``scaling = (beta, original)``) on ``device`` in
    ``dtype`` (its rotary embedding kept in its own)."""
    with contextlib.nullcontext() if device is None else torch.device(device):
        module = PositionScaledLatentAttention(dim, num_heads, sizes, bias=bias, options=options, beta=scaling[0],
                                               original=scaling[1])
    placed(module, dtype, keep=(module.rope,))
    return module


# --------------------------------------------------------------------------- DeepSeek sparse attention
def _rotate_leading(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """RoPE on the first ``2 R`` channels of ``x [..., D]`` (``cos``, ``sin`` broadcastable to
    ``[..., R]``), the rest passed through. Split halves, or (``interleaved``) the adjacent pairs
    ``(2i, 2i + 1)`` rotated and laid out as split halves, as transformers' indexer leaves them
    (``apply_rotary_pos_emb_interleave``, ``modeling_deepseek_v3.py`` 294-330): the scores are the
    same, the layout keeps their float sums in transformers' order."""
    rd = 2 * cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., : rd // 2], rot[..., rd // 2:])
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


class LightningTopK(nn.Module):
    """DeepSeek-V3.2's DSA "lightning indexer" (``DeepseekV32Indexer``, ``modular_deepseek_v32.py``
    172-267; GLM-MoE-DSA's, ``modular_glm_moe_dsa.py`` 134-194, rotates interleaved pairs): per query
    the ``topk`` best visible keys by

        ``score[n, m] = sum_h w_h(x_n) H^-1/2 relu(q_{n,h} . k_m / sqrt(Di))``

    with ``q = RoPE(q_resid W_q)`` (``[B, N, H, Di]``, ``q_resid`` the attention's normalised query
    latent), ``k = RoPE(LayerNorm(x W_k))`` (``[B, M, Di]``, LayerNorm eps 1e-6), ``w = x W_w``; RoPE
    on the first ``qk_rope_head_dim`` channels with the attention's cos/sin. float32 scores; the cut
    is ``torch.topk`` over each query's row of ``M`` scores with the invisible keys at the float32
    minimum, exactly as transformers calls it (so exact ties at the cut -- keys scoring 0 after the
    ReLU -- are broken the same way). No gradient flows through the selection (transformers runs the
    indexer under ``no_grad``).

    Weights under transformers' names: ``wq_b [H Di, rq]``, ``wk [Di, C]``, ``k_norm`` (``[Di]``
    weight and bias), ``weights_proj [H, C]``.

    Args:
        dim: model width ``C``. q_rank: ``q_lora_rank``. heads, head_dim: ``index_n_heads``,
        ``index_head_dim``. topk: ``index_topk``. interleaved: RoPE on adjacent pairs (GLM-MoE-DSA).
    """

    def __init__(self, dim: int, q_rank: int, *, heads: int, head_dim: int, topk: int, interleaved: bool,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if min(heads, head_dim, topk) < 1:
            raise ValueError(f"LightningTopK: heads ({heads}), head_dim ({head_dim}) and topk ({topk}) must be >= 1")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.heads, self.head_dim, self.topk, self.interleaved = heads, head_dim, topk, bool(interleaved)
        self.wq_b = nn.Linear(q_rank, heads * head_dim, bias=False, **kw)
        self.wk = nn.Linear(dim, head_dim, bias=False, **kw)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6, **kw)
        self.weights_proj = nn.Linear(dim, heads, bias=False, **kw)

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The index keys ``[B, N, Di]`` of ``x [B, N, C]`` (``cos``, ``sin``: ``[1 | B, N, R]``)."""
        return _rotate_leading(self.k_norm(self.wk(x)), cos, sin, self.interleaved)

    def forward(self, x: Tensor, q_resid: Tensor, rope: tuple[Tensor, Tensor], keys: Tensor,
                visible: Tensor) -> Tensor:
        """``[B, 1, N, M]`` bool: the keys each of the ``N`` queries attends (selected and visible).
        ``keys [B, M, Di]`` (from :meth:`keys`), ``visible [B, N, M]``, ``rope``: the queries' ``(cos,
        sin)`` ``[1 | B, N, R]``."""
        B, N, _ = x.shape
        return self.select(x, self.rotated(self.wq_b(q_resid).view(B, N, self.heads, self.head_dim), rope), keys,
                           visible)

    def rotated(self, q: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """The index queries ``q [B, N, H, Di]`` with RoPE (``rope``: ``(cos, sin)`` ``[1 | B, N, R]``)."""
        cos, sin = rope
        return _rotate_leading(q, cos.unsqueeze(2), sin.unsqueeze(2), self.interleaved)

    def select(self, x: Tensor, q: Tensor, keys: Tensor, visible: Tensor) -> Tensor:
        """``[B, 1, N, M]`` bool from the rotated index queries ``q [B, N, H, Di]`` (the rest as
        :meth:`forward`)."""
        scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1)) * self.head_dim ** -0.5)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.heads ** -0.5  # [B, N, H]
        index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, N, M]
        index = index.masked_fill(~visible, torch.finfo(index.dtype).min)
        top = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(-1, top, True)
        return (chosen & visible).unsqueeze(1)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, topk={self.topk}, interleaved={self.interleaved}"


class IndexedLatentAttention(MultiHeadLatentAttention):
    """Multi-head latent attention over the keys a :class:`LightningTopK` selects (DeepSeek-V3.2's /
    GLM-MoE-DSA's attention, ``modular_deepseek_v32.py`` 270-360): the selection is a boolean mask on
    top of causality and padding, which equals attention over the selected keys alone (the ``indexer``
    runs under ``no_grad``; ``weights_proj`` computes in its own dtype, as transformers' l. 262).

    Args (``dim``, ``num_heads``, ``sizes``, ``bias``, ``options`` as for
    :class:`~attnzoo.nn.mla.MultiHeadLatentAttention`; ``sizes.q_lora_rank`` must be set):
        indexer: the layer's :class:`LightningTopK` (``indexer``).
        rope: ``False`` for a NoPE layer (``sizes.qk_rope_head_dim`` 0; a subclass then gives
            :meth:`_cos_sin` of no channels, so the indexer rotates nothing).

    Attention protocol (``forward(x [B, N, C], *, mask, cache, positions) -> [B, N, C]``, ``mask`` a
    key padding); the decode cache is a :class:`~attnzoo.nn.cache.CacheList` of the latent cache and
    the index keys (:class:`~attnzoo.models.families.qwen4_exp.IndexerCache`). Packed sequences run
    one at a time (no ``cu_seqlens`` path). Build under ``with torch.device(...)``.
    """

    #: the indexer's queries come from the query latent (a subclass overriding :meth:`_select` may not)
    needs_q_lora = True

    def __init__(self, dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions,
                 indexer: LightningTopK, rope: bool = True) -> None:
        super().__init__(dim, num_heads, kv_lora_rank=sizes.kv_lora_rank, qk_nope_head_dim=sizes.qk_nope_head_dim,
                         qk_rope_head_dim=sizes.qk_rope_head_dim, v_head_dim=sizes.v_head_dim,
                         q_lora_rank=sizes.q_lora_rank, bias=bias, rope=rope, options=options)
        if (self.needs_q_lora and sizes.q_lora_rank is None) or indexer.head_dim < sizes.qk_rope_head_dim:
            raise ValueError(f"IndexedLatentAttention: needs a q_lora_rank (got {sizes.q_lora_rank}) and an indexer "
                             f"head_dim ({indexer.head_dim}) >= qk_rope_head_dim ({sizes.qk_rope_head_dim})")
        self.indexer = indexer

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> CacheList:  # type: ignore[override]
        """The latent cache and the index keys' :class:`IndexerCache`."""
        p = self.indexer.wk.weight
        latent = super().init_cache(batch_size, max_len, device=device, dtype=dtype)
        return CacheList([latent, IndexerCache(batch_size, max_len, self.indexer.head_dim, device=device or p.device,
                                               dtype=dtype or p.dtype)])

    def forward(self, x: Tensor, context: Tensor | None = None, *,  # type: ignore[override]
                mask: Tensor | Mask | None = None, cache: CacheList | None = None,
                positions: Tensor | None = None) -> Tensor:
        if context is not None:
            raise ValueError("IndexedLatentAttention: no cross-attention (context)")
        B, N, _ = x.shape
        latent, index = (None, None) if cache is None else cache.layers
        past = 0 if index is None else index.length
        real = real_keys(mask, B, past + N, x.device)
        pos = resolve_positions(positions, N, past, x.device, batch=B)
        with torch.no_grad():
            cos, sin = (t[:, 0] for t in self._cos_sin(pos, torch.float32))  # [1 | B, N, R]
            keys = self.indexer.keys(x, cos, sin)
            if index is not None:
                keys = index.update(keys, pos.expand(B, N))[0]
            causal = torch.arange(past + N, device=x.device) <= torch.arange(past, past + N, device=x.device)[:, None]
            allowed = self._select(x, pos, (cos, sin), keys, real[:, None] & causal)
        kw: dict[str, Any] = {} if positions is None else {"positions": positions}
        return super().forward(x, mask=allowed, cache=latent, **kw)  # type: ignore[return-value]


    def _select(self, x: Tensor, pos: Tensor, rope: tuple[Tensor, Tensor], keys: Tensor, visible: Tensor) -> Tensor:
        """The indexer's ``[B, 1, N, M]`` selection for ``x [B, N, C]`` at positions ``pos`` (``[N]``
        or ``[B, N]``): its queries from the normalised query latent."""
        return self.indexer(x, self.q_a_norm(self.q_a_proj(x)), rope, keys, visible)


def indexed_attention(dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions,
                      indexer: dict[str, Any], cls: type[IndexedLatentAttention] = IndexedLatentAttention,
                      device: Any = None, dtype: Any = None) -> IndexedLatentAttention:
    """An :class:`IndexedLatentAttention` (or its subclass ``cls``) with a :class:`LightningTopK` of
    ``indexer``'s arguments on ``device`` in ``dtype`` (its rotary embedding kept in its own; in
    float16 the indexer's ``weights_proj`` kept float32, as transformers'
    ``from_pretrained(dtype=torch.float16)`` keeps it)."""
    with contextlib.nullcontext() if device is None else torch.device(device):
        module = cls(dim, num_heads, sizes, bias=bias, options=options,
                     indexer=LightningTopK(dim, int(sizes.q_lora_rank or 0), **indexer))
    # transformers keeps ``indexer.weights_proj`` float32 in float16 (``_keep_in_fp32_modules``; not in bfloat16)
    placed(module, dtype, keep=(module.rope, *([module.indexer.weights_proj] if dtype == torch.float16 else [])))
    return module


class GatedQueryLatentAttention(IndexedLatentAttention):
    """A.X-K2's attention (``AXK2Attention``, ``modular_axk2.py`` 265-397): DeepSeek-V3.2's indexed
    latent attention whose queries and a per-channel output gate come from one projection of both
    the normalised and the raw query latent, ``q_gate_proj [H (dn + dr + dv), 2 rq]`` on ``[q_a_norm(c);
    c]`` (``c = q_a_proj(x)``; no ``q_b_proj``): per head the rows ``[q_h; gate_h]``; the heads' outputs
    ``o [B, H, N, dv]`` are multiplied by ``sigmoid(gate)`` (in float32) before ``out_proj``.

    Args and attention protocol: as :class:`IndexedLatentAttention` (``sizes.q_lora_rank`` set).
    Build under ``with torch.device(...)`` (or through :func:`indexed_attention` with ``cls=``).
    """

    def __init__(self, dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions,
                 indexer: LightningTopK) -> None:
        super().__init__(dim, num_heads, sizes, bias=bias, options=options, indexer=indexer)
        s, p = self.sizes, self.q_a_proj.weight
        del self.q_b_proj
        self.q_gate_proj = nn.Linear(2 * int(s.q_lora_rank or 0), num_heads * (s.qk_head_dim + s.v_head_dim), bias=False,
                                     device=p.device, dtype=p.dtype)
        self._gate: Tensor | None = None  # [B, H, N, dv]: from _queries to merge_heads of one call

    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``q_nope [B, H, N, dn]``, ``q_pe [B, H, N, dr]``; the output gate kept for :meth:`merge_heads`."""
        s = self.sizes
        c = self.q_a_proj(x)  # [B, N, rq]
        qg = self.q_gate_proj(torch.cat((self.q_a_norm(c), c), dim=-1))  # [B, N, H (dn + dr + dv)]
        B, N, _ = qg.shape
        q, self._gate = qg.view(B, N, self.num_heads, -1).transpose(1, 2).split((s.qk_head_dim, s.v_head_dim), -1)
        return q[..., : s.qk_nope_head_dim], q[..., s.qk_nope_head_dim:]

    def merge_heads(self, out: Tensor) -> Tensor:
        """``[B, H, N, dv]`` times ``sigmoid(gate)`` -> ``out_proj`` -> ``[B, N, C]``."""
        gate, self._gate = self._gate, None
        if gate is None:
            raise RuntimeError("GatedQueryLatentAttention: merge_heads before the queries of the same call")
        return super().merge_heads((out * torch.sigmoid(gate.float())).to(out.dtype))


class SigmoidGatedRMSNorm(nn.Module):
    """A.X-K2's ``AXK2GatedRMSNorm`` (``modular_axk2.py`` 193-207): an RMSNorm whose output is gated by
    a low-rank MLP of itself, ``y * sigmoid(fc2(silu(fc1(y))))`` with ``y = norm(x)`` (the sigmoid in
    float32).

    Args:
        dim: ``C``. rank: ``gated_norm_rank``. eps: the RMSNorm's epsilon.

    Weights: ``norm.weight [C]``, ``mlp.up_proj [rank, C]`` (transformers' ``mlp.fc1``),
    ``mlp.down_proj [C, rank]`` (``mlp.fc2``). Shapes: ``[..., C] -> [..., C]``.
    """

    def __init__(self, dim: int, rank: int, eps: float, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.norm = make_norm("rms", dim, eps, device=device, dtype=dtype)
        self.mlp = FeedForward(dim, rank, "silu", bias=False, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        y = self.norm(x)
        return (y * torch.sigmoid(self.mlp(y).float())).to(y.dtype)


class ZeroFilledGroupsMoE(MixtureOfExperts):
    """DeepSeek-V3's mixture of experts as A.X-K2 routes it (``AXK2TopkRouter.apply_group_scoring``,
    ``modular_axk2.py`` 219-237): the experts outside a token's kept groups get the choice score 0
    instead of DeepSeek-V3's ``-inf``, so a kept expert whose biased score ``sigmoid + bias`` is
    negative loses to them. One group: as :class:`~attnzoo.nn.moe.MixtureOfExperts`."""

    @classmethod
    def of(cls, moe: MixtureOfExperts) -> ZeroFilledGroupsMoE:
        """``moe`` (built by :func:`~attnzoo.models.families._moe.deepseek_moe`) routing so, in place."""
        moe.__class__ = cls
        return moe  # type: ignore[return-value]

    def _in_best_groups(self, choice: Tensor) -> Tensor:
        kept = super()._in_best_groups(choice)
        return kept if self.groups == 1 else kept.masked_fill(torch.isneginf(kept), 0.0)


class PostNormMoE(nn.Module):
    """A.X-K1's mixture of experts (``AXK1MoE``, ``modular_axk1.py`` 169-187): DeepSeek-V3's MoE (with
    its shared experts) followed by an RMSNorm of its output, ``post_mlp_layernorm(moe(x))``.

    Args:
        moe: the mixture of experts (``moe``). norm: the RMSNorm (``post_mlp_layernorm``, ``[C]``).

    Shapes: ``[..., C] -> [..., C]``.
    """

    def __init__(self, moe: nn.Module, norm: nn.Module) -> None:
        super().__init__()
        self.moe, self.post_mlp_layernorm = moe, norm

    def forward(self, x: Tensor) -> Tensor:
        return self.post_mlp_layernorm(self.moe(x))


def canonical(hf: HFConfig, model_type: str) -> HFConfig:
    """``hf`` as transformers reads it (:data:`DEFAULTS` where a key is absent); refuses what has
    no equivalent (see the module docstring)."""
    hf = _derived(_legacy(hf, model_type), model_type)
    H = hf.req("num_attention_heads")
    if model_type == "minicpm3":
        parts.unsupported_keys(hf, {"scale_emb": lambda v: _number(v) and v > 0, "dim_model_base": lambda v: _number(v) and v != 0,
                                    "scale_depth": _number})
    if model_type == "minicpm5_moe":
        parts.unsupported_keys(hf, {"attention_bias": lambda v: not v, "use_gated_attention": lambda v: v is not False,
                                    "partial_rotary_factor": lambda v: v in (None, 1, 1.0)})
    elif model_type == "deepseek_ocr2_text":
        _check_ocr2(hf)
    else:
        parts.unsupported_keys(hf, {"num_key_value_heads": lambda v: v in (None, H)})
    parts.unsupported_keys(hf, {"pretraining_tp": lambda v: v in (None, 1), "moe_layer_freq": lambda v: v in (None, 1)})
    if model_type in V2_ROUTED:
        parts.unsupported_keys(hf, {"topk_method": lambda v: v in TOPK_METHODS})
    if model_type in (*DSA, "axk1") and hf.get("q_lora_rank", None) is None:
        raise hf.unsupported(f"q_lora_rank=None ({model_type}'s attention always has the query latent)")
    if model_type in DSA:
        _check_dsa(hf, model_type)
    if any(moe_layers(hf, model_type)):
        parts.unsupported_keys(hf, {"hidden_act": lambda v: v in ("silu", "swish")})
        (groups, topk_groups), E = _groups(hf, model_type), hf.req("n_routed_experts")
        smallest = 1 if model_type in V2_ROUTED else 2  # the others score a group by its two best
        if groups > 1 and (E % groups or E // groups < smallest or not 1 <= topk_groups <= groups
                           or hf.req("num_experts_per_tok") > topk_groups * (E // groups)):
            raise hf.unsupported(f"n_group={groups} with topk_group={topk_groups} (groups of >= {smallest} of the "
                                 f"n_routed_experts={E} experts holding num_experts_per_tok={hf.raw('num_experts_per_tok')})")
    return hf


def _check_ocr2(hf: HFConfig) -> None:
    """DeepSeek-OCR2's text config as ``DeepseekOcr2TextConfig`` builds it: ``mlp_layer_types`` given
    (its layers index it; no default), the width a multiple of the heads (its ``head_dim`` is always
    ``hidden_size // num_attention_heads``), no ``partial_rotary_factor`` (its default RoPE rotates the
    whole head whatever the key says; the scaled types would read it)."""
    if hf.get("mlp_layer_types", None, list) is None:
        raise hf.unsupported("mlp_layer_types=None (DeepSeek-OCR2's layers need their kinds: 'dense' / 'sparse' "
                             "per layer)")
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    if C % H:
        raise hf.unsupported(f"hidden_size={C} with num_attention_heads={H} (supported: a multiple)")
    parts.unsupported_keys(hf, {"partial_rotary_factor": lambda v: v in (None, 1, 1.0)})
    if parts.rope_params(hf).get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise hf.unsupported(f"partial_rotary_factor={parts.rope_params(hf)['partial_rotary_factor']} in "
                             f"rope_parameters (supported: 1)")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _legacy(hf: HFConfig, model_type: str) -> HFConfig:
    """A ``config.json``'s other names and values as transformers' config class translates them on
    load: the ``attribute_map`` aliases (:data:`ALIASES`), Sarvam's ``rope_scaling.type =
    "deepseek_yarn"`` (YaRN, ``configuration_sarvam_mla.py`` 129-153), LongCat's ``num_hidden_layers``
    (twice ``num_layers``)."""
    data = dict(hf.data)
    for alias, name in ALIASES.get(model_type, {}).items():
        value = data.pop(alias, None)
        if value is not None and data.get(name) is None:
            data[name] = value
    rope = data.get("rope_scaling")
    if model_type == "sarvam_mla" and isinstance(rope, dict) and "deepseek_yarn" in (rope.get("type"),
                                                                                      rope.get("rope_type")):
        del data["rope_scaling"]
        data["rope_parameters"] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "yarn"}
    if model_type == "longcat_flash" and data.get("num_layers") is None and _number(data.get("num_hidden_layers")):
        data["num_layers"] = data["num_hidden_layers"] // 2  # LongcatFlashConfig's num_hidden_layers setter
    return HFConfig(data, hf.source, hf.arch)


def _derived(hf: HFConfig, model_type: str) -> HFConfig:
    """:data:`DEFAULTS` where a key is absent, then what each config class derives: a null
    ``q_lora_rank`` (a full query projection), Mistral-4's rope, A.X-K1's layer kinds, MiniCPM3's
    ``v_head_dim`` (``hidden_size // num_attention_heads``) and its null multipliers (no scaling)."""
    full = hf.with_defaults(DEFAULTS[model_type])
    if "q_lora_rank" in hf.data and hf.data["q_lora_rank"] is None:  # null: a full query projection
        full = HFConfig({**full.data, "q_lora_rank": None}, hf.source, hf.arch)
    if model_type == "minicpm3":
        C, H, depth = full.req("hidden_size"), full.req("num_attention_heads"), full.req("num_hidden_layers")
        null = {k for k in ("scale_depth", "dim_model_base") if k in hf.data and hf.data[k] is None}
        derived = {"v_head_dim": full.get("v_head_dim", C // H), "scale_depth": math.sqrt(depth),
                   "dim_model_base": C}
        full = HFConfig({**full.data, **{k: v for k, v in derived.items() if k == "v_head_dim" or k in null}},
                        hf.source, hf.arch)
    if model_type == "deepseek_ocr2_text":  # DeepseekOcr2TextConfig.__post_init__ sets it, whatever was given
        full = HFConfig({**full.data, "head_dim": full.req("hidden_size") // full.req("num_attention_heads")},
                        hf.source, hf.arch)
    return _mistral4_defaults(full) if model_type == "mistral4" else _axk1_kinds(full) if model_type in AXK else full


def _check_dsa(hf: HFConfig, model_type: str) -> None:
    """Refuse the DSA options without an equivalent: ``index_head_dim < qk_rope_head_dim``, and
    GLM-MoE-DSA's ``shared`` ``indexer_types`` (a layer reusing the previous layer's selection)."""
    if hf.req("index_head_dim") < hf.req("qk_rope_head_dim") or min(hf.req("index_n_heads"), hf.req("index_topk")) < 1:
        raise hf.unsupported(f"index_head_dim={hf.raw('index_head_dim')} (>= qk_rope_head_dim), "
                             f"index_n_heads={hf.raw('index_n_heads')}, index_topk={hf.raw('index_topk')} (>= 1)")
    types = _indexer_types(hf) if model_type == "glm_moe_dsa" else []
    if any(t != "full" for t in types):
        raise hf.unsupported(f"indexer_types={types!r} (a 'shared' layer reusing the previous layer's top-k)")


def _axk1_kinds(hf: HFConfig) -> HFConfig:
    """A.X-K1's ``mlp_layer_types`` as ``AXK1Config`` derives them when absent
    (``modular_axk1.py`` 137-143): ``sparse`` where ``i >= first_k_dense_replace`` (default 1) and
    ``i % moe_layer_freq == 0``; the two legacy keys are then spent."""
    data = {k: v for k, v in hf.data.items() if k not in ("first_k_dense_replace", "moe_layer_freq")}
    if hf.get("mlp_layer_types", None, list) is None:
        first, freq = hf.get("first_k_dense_replace", 1), max(hf.get("moe_layer_freq", 1) or 1, 1)
        data["mlp_layer_types"] = ["sparse" if i >= first and i % freq == 0 else "dense"
                                   for i in range(hf.req("num_hidden_layers"))]
    return HFConfig(data, hf.source, hf.arch)


def _indexer_types(hf: HFConfig) -> list[str]:
    """GLM-MoE-DSA's ``indexer_types`` as ``GlmMoeDsaConfig`` derives them when absent
    (``modular_glm_moe_dsa.py`` 109-124): from ``index_topk_pattern`` (``"F"``/``"S"`` per layer), else
    ``full`` where ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0``."""
    types = hf.get("indexer_types", None, list)
    if types is not None:
        return list(types)
    pattern = hf.data.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(hf.get("index_topk_freq", 1) or 1, 1), hf.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(hf.req("num_hidden_layers"))]


def _mistral4_defaults(hf: HFConfig) -> HFConfig:
    """``rope_parameters`` as ``Mistral4Config`` fills them when absent (``configuration_mistral4.py``
    107-128): YaRN x128 from 8192 positions, ``llama_4_scaling_beta`` 0.1."""
    if hf.has("rope_parameters") or hf.has("rope_scaling"):
        return hf
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
    return HFConfig({**hf.data, "rope_parameters": rope}, hf.source, hf.arch)


def _query_scaling(hf: HFConfig) -> tuple[HFConfig, tuple[float, int] | None]:
    """Mistral-4's rope dict split: ``(hf without the keys that are not the rotary's, (beta,
    original_max_position_embeddings) or None)``. Its ``partial_rotary_factor`` must be the rope
    channels' share ``qk_rope_head_dim / (qk_nope_head_dim + qk_rope_head_dim)`` (the rotary's
    width is then ``qk_rope_head_dim``, as MLA rotates)."""
    key = "rope_parameters" if hf.has("rope_parameters") else "rope_scaling"
    rope = dict(hf.get(key, {}, dict))
    dr, dn = hf.req("qk_rope_head_dim"), hf.req("qk_nope_head_dim")
    share = rope.pop("partial_rotary_factor", None)
    if share is not None and abs(share - dr / (dn + dr)) > 1e-9:
        raise hf.unsupported(f"partial_rotary_factor={share} (MLA rotates the qk_rope_head_dim channels: "
                             f"{dr / (dn + dr)})")
    beta = rope.pop("llama_4_scaling_beta", None)
    rope.pop("max_position_embeddings", None)
    original = rope.get("original_max_position_embeddings")
    scaling = None if not beta else (float(beta), int(original or parts.max_positions(hf)))
    return HFConfig({**hf.data, key: rope}, hf.source, hf.arch), scaling


def moe_layers(hf: HFConfig, model_type: str) -> list[bool]:
    """Per layer: a mixture of experts (``i >= first_k_dense_replace``; GLM-4-MoE-Lite:
    ``mlp_layer_types[i] == "sparse"``, by default every layer but the first) or the dense MLP."""
    depth = hf.req("num_hidden_layers")
    if model_type in DENSE:
        return [False] * depth
    if model_type in LAYER_TYPED:
        return [t == "sparse" for t in mlp_types(hf, depth)]
    first = hf.get("first_k_dense_replace", 0)
    return [i >= first for i in range(depth)]


def _groups(hf: HFConfig, model_type: str) -> tuple[int, int]:
    """``(n_group, topk_group)`` as the router uses them (V2's ``greedy`` ignores them: 1 group)."""
    if model_type in V2_ROUTED and hf.get("topk_method", "greedy", str) == "greedy":
        return 1, 1
    return hf.get("n_group", 1) or 1, hf.get("topk_group", 1) or 1


def _interleaved(hf: HFConfig, model_type: str) -> bool:
    """Whether the latent attention's RoPE rotates adjacent pairs: always in DeepSeek-V2, the DSA
    models and LongCat-Flash, never in MiniCPM3 (none reads ``rope_interleave``), else ``rope_interleave``."""
    if model_type in ("deepseek_v2", *DSA, "longcat_flash", "minicpm3"):
        return model_type != "minicpm3"
    return bool(hf.get("rope_interleave", True, bool))


def _attention(hf: HFConfig, model_type: str, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """The factory of a layer's :class:`~attnzoo.nn.mla.MultiHeadLatentAttention` (Mistral-4's with
    ``llama_4_scaling_beta``: a :class:`PositionScaledLatentAttention`)."""
    query_scaling = None
    if model_type in GQA:  # MiniCPM5-MoE's with its element-wise output gate
        params = parts.rope_params(hf)
        if params.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
            raise hf.unsupported(f"partial_rotary_factor={params['partial_rotary_factor']}")
        C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
        rope = parts.rotary(hf, params, hf.get("head_dim", C // H))
        gate = "element" if model_type == "minicpm5_moe" else None
        return parts.attention_factory(hf, window=None, rope=rope, output_gate=gate, **kw)
    if model_type == "mistral4":
        hf, query_scaling = _query_scaling(hf)
    base, scaling = mla_rope(hf)
    akw: dict[str, Any] = {
        "kv_lora_rank": hf.req("kv_lora_rank"), "q_lora_rank": hf.get("q_lora_rank", None),
        "qk_nope_head_dim": hf.req("qk_nope_head_dim"), "qk_rope_head_dim": hf.req("qk_rope_head_dim"),
        "v_head_dim": hf.req("v_head_dim"), "bias": hf.get("attention_bias", False, bool), "rope_base": base,
        "rope_interleave": _interleaved(hf, model_type), "norm_eps": 1e-6,
        "dropout": hf.get("attention_dropout", 0.0, float)}
    if scaling is not None:
        akw.update(rope_scaling=scaling, max_position_embeddings=parts.max_positions(hf))
    if model_type in DSA:
        sizes = MLASizes(**{k: akw.pop(k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                      "v_head_dim", "q_lora_rank")})
        bias = akw.pop("bias")
        indexer = {"heads": hf.req("index_n_heads"), "head_dim": hf.req("index_head_dim"),
                   "topk": hf.req("index_topk"), "interleaved": model_type == "glm_moe_dsa"}
        cls = GatedQueryLatentAttention if model_type == "axk2" else IndexedLatentAttention
        return functools.partial(indexed_attention, hf.req("hidden_size"), hf.req("num_attention_heads"), sizes,
                                 bias=bias, options=MLAOptions(**akw), indexer=indexer, cls=cls, **kw)
    if query_scaling is not None:
        sizes = MLASizes(**{k: akw.pop(k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                      "v_head_dim", "q_lora_rank")})
        bias = akw.pop("bias")
        return functools.partial(position_scaled_attention, hf.req("hidden_size"), hf.req("num_attention_heads"),
                                 sizes, bias=bias, options=MLAOptions(**akw), scaling=query_scaling, **kw)
    return functools.partial(build_attention, "mla", hf.req("hidden_size"), hf.req("num_attention_heads"), **akw,
                             **kw)


def _moe(hf: HFConfig, model_type: str, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """The factory of a mixture-of-experts layer (V3: :func:`~._moe.deepseek_moe`; V2: :class:`SoftmaxGroupMoE`)."""
    C, F_ = hf.req("hidden_size"), hf.req("moe_intermediate_size")
    n_shared, bias = hf.get("n_shared_experts", 0) or 0, hf.get("mlp_bias", False, bool)
    shared = functools.partial(FeedForward, activation="swiglu", bias=bias, **kw)
    if model_type == "axk1":
        moe = functools.partial(deepseek_moe, hf, shared_expert=shared, keep_router_float32=True, **kw)
        norm = parts.rms_norm(C, hf.get("rms_norm_eps", 1e-6, float), **kw)
        return lambda: PostNormMoE(moe(), norm())
    if model_type in SIGMOID:
        sigmoid = functools.partial(deepseek_moe, hf, shared_expert=shared, keep_router_float32=True, **kw)
        return (lambda: ZeroFilledGroupsMoE.of(sigmoid())) if model_type == "axk2" else sigmoid
    groups, topk_groups = _groups(hf, model_type)
    v2 = model_type in V2_ROUTED
    routing = SoftmaxRouting(hf.get("routed_scaling_factor", 1.0, float), groups, topk_groups,
                             "max" if v2 else "top2", not v2 and hf.get("norm_topk_prob", True, bool), v2)

    def make() -> nn.Module:
        moe = SoftmaxGroupMoE(C, F_, hf.req("n_routed_experts"), hf.req("num_experts_per_tok"), routing=routing,
                              shared_expert=shared(C, F_ * n_shared) if n_shared else None, **kw)
        return moe.keep_router_in_float32() if v2 else moe  # V2 keeps gate.weight float32, Mistral 4 not
    return make


def build_deepseek(hf: HFConfig, model_type: str, *, head_size: int | None = None, device: Any = None,
                   dtype: Any = None, mtp: int = 0) -> DecoderLM:
    """The decoder of a ``DeepseekV3Config`` / ``DeepseekV2Config`` (``model_type``; random weights;
    see the module docstring), with ``mtp`` multi-token-prediction depths (each a MoE block, as
    transformers' ``get_mtp_config`` builds them)."""
    hf = canonical(hf, model_type)
    C, eps = hf.req("hidden_size"), hf.get("rms_norm_eps", 1e-6, float)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    attention, norm = _attention(hf, model_type, kw), parts.rms_norm(C, eps, **kw)
    dense = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"),
                            bias=hf.get("mlp_bias", False, bool), **kw)
    kinds = moe_layers(hf, model_type)
    moe = _moe(hf, model_type, kw) if any(kinds) else dense
    if model_type == "axk2":  # the gated norm before every attention and every MoE, a plain one before a dense MLP
        gated = functools.partial(SigmoidGatedRMSNorm, C, hf.req("gated_norm_rank"), eps, **kw)
        blocks = [parts.block(C, attention, moe if sparse else dense, gated) for sparse in kinds]
        for block, sparse in zip(blocks, kinds, strict=True):
            block.ffn_norm = block.ffn_norm if sparse else norm()
    else:
        blocks = [parts.block(C, attention, moe if sparse else dense, norm) for sparse in kinds]
    scale = hf.get("scale_emb", 1.0, float) if model_type == "minicpm3" else 1.0
    predictor = MultiTokenPredictor([  # MoE blocks: transformers' get_mtp_config sets first_k_dense_replace=0
        MTPLayer(C, parts.block(C, attention, _moe(hf, model_type, kw), norm), norm, **kw)
        for _ in range(mtp)]) if mtp else None
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embed_scale=None if scale == 1.0 else scale,
                         mtp=predictor, **kw)


def _put_moe(plan: Plan, ours: str, theirs: str, hf: HFConfig) -> None:
    """A mixture-of-experts layer: the router, its correction bias (V3; A.X-K1's checkpoints route
    without one: 0 when absent), the stacked or per-expert experts, the shared experts (with
    ``mlp_bias``'s biases) when ``n_shared_experts > 0``; A.X-K1's ``post_mlp_layernorm`` (saved
    folders: on the layer, ``layers.{i}.post_mlp_layernorm``)."""
    if hf.raw("model_type") == "axk1":
        layer = theirs[: -len("mlp.")]
        saved = f"{layer}post_mlp_layernorm.weight"
        plan.put(f"{ours}post_mlp_layernorm.weight", saved if plan.src.has(saved) else f"{theirs}post_mlp_layernorm.weight")
        ours = f"{ours}moe."
    put_moe(plan, ours, theirs, "stacked")
    bias = f"{theirs}gate.e_score_correction_bias"
    if hf.raw("model_type") == "axk1" and not plan.src.has(bias):
        plan.put_tensor(f"{ours}score_bias", torch.zeros(hf.req("n_routed_experts")), f"{bias} (absent: 0)")
    elif hf.raw("model_type") in SIGMOID:
        plan.put(f"{ours}score_bias", bias)
    if hf.get("n_shared_experts", 0):
        parts.put_mlp(plan, f"{ours}shared_expert.", f"{theirs}shared_experts.", bias=hf.get("mlp_bias", False, bool))


def _put_gated_attention(plan: Plan, ours: str, theirs: str, hf: HFConfig) -> None:
    """MiniCPM5-MoE's attention: ``q_gate_proj`` (saved folders: ``q_proj``) rows ``[q_h; gate_h]``
    per head (``D`` each) -> the
    query rows of ``qkv_proj`` (with ``k_proj``, ``v_proj``) and the element-wise output gate."""
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    D = hf.get("head_dim", C // H)
    fused = "q_gate_proj" if plan.src.has(f"{theirs}q_gate_proj.weight") else "q_proj"  # saved folders: q_proj
    qg, k, v = (plan.src.take(f"{theirs}{n}.weight") for n in (fused, "k_proj", "v_proj"))
    if qg is not None and k is not None and v is not None:
        q, gate = (t.reshape(H * D, -1) for t in qg.reshape(H, 2 * D, -1).split(D, dim=1))
        where = f"{plan.src.prefix}{theirs}{fused}.weight"
        plan.put_tensor(f"{ours}.qkv_proj.weight", torch.cat([q, k, v]), f"{where} (query rows) + k_proj + v_proj")
        plan.put_tensor(f"{ours}.frontier.gate_proj.weight", gate, f"{where} (gate rows)")
    plan.put(f"{ours}.out_proj.weight", f"{theirs}o_proj.weight")


def _put_axk2_layer(plan: Plan, ours: str, theirs: str, hf: HFConfig, sparse: bool) -> None:
    """A.X-K2's attention (:class:`GatedQueryLatentAttention`: ``q_gate_proj`` in place of ``q_b_proj``,
    the biases of ``attention_bias`` on ``q_a_proj``, ``kv_a_proj_with_mqa``, ``o_proj``) and its
    norms (:class:`SigmoidGatedRMSNorm` ``input_layernorm``, and ``post_attention_layernorm`` on a
    ``sparse`` layer; a plain RMSNorm on a dense one). Saved folders keep the released names, which
    transformers renames on load and back on save (``conversion_mapping.py``): ``q_b_proj`` for
    ``q_gate_proj``, ``W_down`` / ``W_up`` for the gate MLP's ``mlp.fc1`` / ``mlp.fc2``."""
    a, t = f"{ours}attn.", f"{theirs}self_attn."
    fused = "q_gate_proj" if plan.src.has(f"{t}q_gate_proj.weight") else "q_b_proj"
    plan.put_pairs(a, t, [("q_a_norm", "q_a_layernorm"), ("q_gate_proj", fused),
                          ("kv_a_norm", "kv_a_layernorm"), ("kv_b_proj", "kv_b_proj")], bias=False)
    plan.put_pairs(a, t, [("q_a_proj", "q_a_proj"), ("kv_a_proj", "kv_a_proj_with_mqa"), ("out_proj", "o_proj")],
                   bias=hf.get("attention_bias", False, bool))
    fc1, fc2 = ("mlp.fc1", "mlp.fc2") if plan.src.has(f"{theirs}input_layernorm.mlp.fc1.weight") else ("W_down", "W_up")
    gated = [("norm", "norm"), ("mlp.up_proj", fc1), ("mlp.down_proj", fc2)]
    plan.put_pairs(f"{ours}attn_norm.", f"{theirs}input_layernorm.", gated, bias=False)
    if sparse:
        plan.put_pairs(f"{ours}ffn_norm.", f"{theirs}post_attention_layernorm.", gated, bias=False)
    else:
        plan.put(f"{ours}ffn_norm.weight", f"{theirs}post_attention_layernorm.weight")


def _put_mtp(plan: Plan, ours: str, theirs: str, hf: HFConfig) -> None:
    """A multi-token-prediction layer from ``layers.{j}`` (``j >= num_hidden_layers``): the parts
    around the block (:func:`~attnzoo.models.families._common.put_mtp`) and a MoE decoder layer."""
    parts.put_mtp(plan, ours, theirs)
    put_mla(plan, f"{ours}block.attn.", f"{theirs}self_attn.", hf)
    _put_moe(plan, f"{ours}block.ffn.", f"{theirs}mlp.", hf)
    plan.put_pairs(f"{ours}block.", theirs, parts.PRE_NORMS, bias=False)


def _convert(model_type: str, hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; the MTP layers of
    :data:`MTP` types loaded, the others dropped)."""
    hf = canonical(HFConfig({**hf.data, "model_type": model_type}, hf.source, hf.arch), model_type)
    prefix, depth = parts.head_size_of(hf, sd)[0], hf.req("num_hidden_layers")
    mtp = parts.mtp_depths(hf, sd, lambda k: f"{prefix}layers.{depth + k}.eh_proj.weight") if model_type in MTP else 0
    sd = {k: v for k, v in sd.items() if not extra_layer(k, prefix, depth + mtp)}
    build = functools.partial(build_deepseek, model_type=model_type, mtp=mtp)
    model, plan, head_size = parts.start(hf, sd, build, device=device, dtype=dtype)
    for k in range(mtp):
        _put_mtp(plan, f"mtp.layers.{k}.", f"layers.{depth + k}.", hf)
    for i, sparse in enumerate(moe_layers(hf, model_type)):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if model_type == "minicpm5_moe":
            _put_gated_attention(plan, f"{o}attn", f"{h}self_attn.", hf)
        elif model_type == "deepseek_ocr2_text":
            parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=hf.get("attention_bias", False, bool))
        elif model_type == "axk2":
            _put_axk2_layer(plan, o, h, hf, sparse)
        else:
            put_mla(plan, f"{o}attn.", f"{h}self_attn.", hf)
        if model_type in DSA:
            for name in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
                plan.put(f"{o}attn.indexer.{name}", f"{h}self_attn.indexer.{name}")
        if sparse:
            _put_moe(plan, f"{o}ffn.", f"{h}mlp.", hf)
        else:
            parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.", bias=hf.get("mlp_bias", False, bool))
        if model_type != "axk2":
            plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    if model_type == "minicpm3":
        return _finish_minicpm3(plan, model, hf, head_size)
    unused = [] if hf.get("n_shared_experts", 0) else [r"(model\.)?layers\.\d+\.mlp\.shared_experts\..*"]
    unused += parts.mtp_copies(depth, mtp)
    if model_type == "axk1":  # the released checkpoints store the norm on the dense layers too, unused
        unused.append(r"(model\.)?layers\.\d+\.(mlp\.)?post_mlp_layernorm\..*")
    return parts.finish(plan, model, head_size, ignore=unused)


def _finish_minicpm3(plan: Plan, model: DecoderLM, hf: HFConfig, head_size: int | None) -> DecoderLM:
    """MiniCPM3's residual scale ``scale_depth / sqrt(num_hidden_layers)`` folded into the weights
    writing into the residual stream (``o_proj`` with its bias, ``down_proj`` with its bias) and
    ``1 / (hidden_size / dim_model_base)`` into the final norm of an LM head, through Granite's
    :func:`~attnzoo.models.families.granitemoehybrid.finish_folded`."""
    writes = [f"blocks.{i}.{n}.{w}" for i in range(model.depth) for n in ("attn.out_proj", "ffn.down_proj")
              for w in ("weight", "bias")]
    residual = hf.req("scale_depth", float) / math.sqrt(hf.req("num_hidden_layers"))
    logits = hf.req("hidden_size") / hf.req("dim_model_base", float)
    multipliers = HFConfig({"residual_multiplier": residual, "logits_scaling": logits}, hf.source, hf.arch)
    return finish_folded(plan, model, multipliers, head_size, writes)


def convert_deepseek(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """A model of the lineage, by the config's ``model_type`` (see the module docstring): DeepSeek-V3 /
    V2 / V3.2, GLM-4-MoE-Lite, GLM-MoE-DSA, Mistral 4, MiniCPM5-MoE, A.X-K1 / K2, Sarvam-MLA, Youtu-LLM, MiniCPM3,
    LongCat-Flash (:func:`convert_longcat`)."""
    model_type = str(hf.raw("model_type"))
    if model_type not in DEFAULTS:
        raise ValueError(f"convert_deepseek: model_type must be one of {list(DEFAULTS)}, got {model_type!r}")
    if model_type == "longcat_flash":
        return convert_longcat(hf, sd, device=device, dtype=dtype)
    return _convert(model_type, hf, sd, device=device, dtype=dtype)


# --------------------------------------------------------------------------- LongCat-Flash
class ZeroExpertMoE(MixtureOfExperts):
    """LongCat-Flash's mixture of experts (``LongcatFlashMoE`` / ``LongcatFlashTopkRouter``,
    ``modeling_longcat_flash.py`` 129-229): ``E`` SwiGLU experts beside ``Z`` zero-computation experts
    (the identity). Per token ``x [C]``: ``p = softmax(W_r x)`` over all ``E + Z`` (float32; transformers
    never adds the router's bias), the ``k`` experts of largest ``p + score_bias`` (``score_bias [E + Z]``,
    transformers' ``e_score_correction_bias``), each weighted by its ``p`` times ``scaling`` (not
    renormalised); a zero expert ``e >= E`` contributes ``weight * x``.

    Args:
        dim, hidden, num_experts (``E``), top_k (``k <= E + Z``): as :class:`~attnzoo.nn.moe.MixtureOfExperts`.
        zero_experts: ``Z``. scaling: ``routed_scaling_factor``.
        keep_router_float32, device, dtype: as :class:`~attnzoo.nn.moe.MixtureOfExperts`.

    Weights: ``router [E + Z, C]``, the experts' ``gate_proj`` / ``up_proj [E, F, C]``, ``down_proj [E, C, F]``;
    buffer ``score_bias [E + Z]`` (float32). Shapes: ``[..., C] -> [..., C]``.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, zero_experts: int, top_k: int, *, scaling: float,
                 keep_router_float32: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, hidden, num_experts, min(top_k, num_experts), routing=Routing(scaling=scaling),
                         device=device, dtype=dtype)
        if isinstance(zero_experts, bool) or not isinstance(zero_experts, int) or zero_experts < 0 \
                or not 1 <= top_k <= num_experts + zero_experts:
            raise ValueError(f"ZeroExpertMoE: zero_experts must be an int >= 0 and 1 <= top_k <= num_experts + "
                             f"zero_experts, got zero_experts={zero_experts!r}, top_k={top_k!r}")
        self.top_k, self.zero_experts = top_k, zero_experts
        self.router = nn.Linear(dim, num_experts + zero_experts, bias=False, device=device, dtype=dtype)
        del self.score_bias
        self.register_buffer("score_bias", torch.zeros(num_experts + zero_experts, device=device, dtype=torch.float32))
        if keep_router_float32:
            self.keep_router_in_float32()

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(weights [T, k], experts [T, k], logits [T, E + Z])`` of ``x [T, C]`` (see the class docstring)."""
        wide = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(wide), self.router.weight.to(wide))  # [T, E + Z]
        probs = torch.softmax(logits, dim=-1)
        experts = torch.topk(probs + self.score_bias.to(wide), self.top_k, dim=-1).indices  # [T, k]
        return (probs.gather(-1, experts) * self.routed_scaling).to(x.dtype), experts, logits

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.dim)  # [T, C]
        weights, experts, _ = self.route(flat)
        zero = experts >= self.num_experts  # [T, k]: the zero-computation experts
        out = torch.zeros_like(flat)
        for e in torch.unique(experts[~zero]).tolist():
            token, slot = torch.nonzero(experts == e, as_tuple=True)
            out.index_add_(0, token, (self.expert(e, flat[token]) * weights[token, slot, None]).to(out.dtype))
        identity = weights.masked_fill(~zero, 0.0).sum(dim=-1, keepdim=True)  # [T, 1]
        return (out + (flat * identity).to(out.dtype)).view(x.shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, zero_experts={self.zero_experts}"


class LongcatLayer(nn.Module):
    """One LongCat-Flash layer (``LongcatFlashDecoderLayer``, ``modeling_longcat_flash.py`` 433-512): two
    pre-norm attention sub-layers, each followed by a dense MLP, and one mixture of experts reading the
    first MLP's input whose output joins at the very end (the shortcut)::

        h = x + attn_0(norm_0(x));   m = ffn_norm_0(h)
        h = h + mlp_0(m);            s = moe(m)
        h = h + attn_1(norm_1(h))
        out = h + mlp_1(ffn_norm_1(h)) + s

    Args:
        dim: ``C``. attention, mlp, norm, moe: factories of the sub-layers' modules.

    Weights: ``sublayers.{j}`` (mixer-only :class:`~attnzoo.blocks.TransformerBlock`: ``attn_norm``,
    ``attn``), ``ffn_norms.{j}``, ``mlps.{j}``, ``moe``. The decode cache: a
    :class:`~attnzoo.nn.cache.CacheList` of the two attentions'. Block protocol as
    :class:`~attnzoo.blocks.TransformerBlock` (``key_padding``, ``cache``, ``positions``, ``cu_seqlens``;
    no cross-attention). Shapes: ``[B, N, C] -> [B, N, C]``.
    """

    def __init__(self, dim: int, *, attention: Callable[[], nn.Module], mlp: Callable[[], nn.Module],
                 norm: Callable[[], nn.Module], moe: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.dim = dim
        self.sublayers = nn.ModuleList([parts.block(dim, attention, None, norm) for _ in range(2)])
        self.ffn_norms = nn.ModuleList([norm() for _ in range(2)])
        self.mlps = nn.ModuleList([mlp() for _ in range(2)])
        self.moe = moe()

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> CacheList:
        return CacheList([s.init_cache(batch_size, max_len, device=device, dtype=dtype) for s in self.sublayers])

    def forward(self, x: Tensor, context: Tensor | None = None, *, key_padding: Tensor | None = None,
                context_mask: Any = None, cache: CacheList | None = None, positions: Tensor | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor:
        if context is not None or context_mask is not None:
            raise ValueError("LongcatLayer: no cross-attention (context)")
        caches = [None, None] if cache is None else list(cache)
        kw: dict[str, Any] = {"key_padding": key_padding, "positions": positions, "cu_seqlens": cu_seqlens}
        h = self.sublayers[0](x, cache=caches[0], **kw)
        m = self.ffn_norms[0](h)
        shortcut = self.moe(m)
        h = h + self.mlps[0](m)
        h = self.sublayers[1](h, cache=caches[1], **kw)
        return h + self.mlps[1](self.ffn_norms[1](h)) + shortcut


def _longcat(hf: HFConfig) -> HFConfig:
    """A ``LongcatFlashConfig`` as transformers reads it (aliases, :data:`DEFAULTS`); refuses what
    has no equivalent: ``num_key_value_heads != num_attention_heads``, a rope width ``head_dim`` or a
    ``qk_head_dim`` other than MLA's (``qk_rope_head_dim``, ``qk_nope_head_dim + qk_rope_head_dim``:
    transformers' shapes would not fit), a null ``q_lora_rank``, an activation other than SiLU (experts)."""
    hf = _derived(_legacy(hf, "longcat_flash"), "longcat_flash")
    dn, dr, H = hf.req("qk_nope_head_dim"), hf.req("qk_rope_head_dim"), hf.req("num_attention_heads")
    parts.unsupported_keys(hf, {"num_key_value_heads": lambda v: v in (None, H), "head_dim": lambda v: v in (None, dr),
                                "qk_head_dim": lambda v: v in (None, dn + dr), "q_lora_rank": lambda v: v is not None,
                                "hidden_act": lambda v: v in ("silu", "swish"),
                                "routed_scaling_factor": lambda v: _number(v) and v > 0})
    return hf


def build_longcat(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``LongcatFlashConfig`` (random weights; see :class:`LongcatLayer`): ``num_layers``
    layers of two interleaved-RoPE latent attentions (the query / latent scales folded into weights
    at conversion), two SwiGLU MLPs (``ffn_hidden_size``) and a :class:`ZeroExpertMoE`."""
    hf = _longcat(hf)
    C, eps, kw = hf.req("hidden_size"), hf.get("rms_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    moe = functools.partial(ZeroExpertMoE, C, hf.req("expert_ffn_hidden_size"), hf.req("n_routed_experts"),
                            hf.get("zero_expert_num", 0), hf.req("moe_topk"),
                            scaling=hf.get("routed_scaling_factor", 1.0, float),
                            keep_router_float32=dtype == torch.float16, **kw)  # _keep_in_fp32_modules: float16 only
    layer = functools.partial(LongcatLayer, C, attention=_attention(hf, "longcat_flash", kw), moe=moe,
                              mlp=parts.gated_mlp(C, hf.req("ffn_hidden_size"), "swiglu", **kw),
                              norm=parts.rms_norm(C, eps, **kw))
    return parts.decoder(hf, [layer() for _ in range(hf.req("num_layers"))], head_size=head_size, norm_eps=eps, **kw)


def scale_planned(plan: Plan, name: str, factor: float, why: str) -> None:
    """The planned tensor ``name`` times ``factor`` (computed in at least float32)."""
    if name in plan.values:
        t, key = plan.values[name]
        plan.values[name] = (t.to(torch.promote_types(t.dtype, torch.float32)) * factor, f"{key} x {why}")


def _put_longcat_layer(plan: Plan, ours: str, theirs: str, hf: HFConfig) -> None:
    """One :class:`LongcatLayer` from ``LongcatFlashDecoderLayer``: each ``self_attn.{j}`` (with
    ``sqrt(hidden_size / q_lora_rank)`` folded into ``q_b_proj`` and ``sqrt(hidden_size / kv_lora_rank)``
    into ``kv_a_layernorm``: ``LongcatFlashMLA`` multiplies the queries and the normalised latent by
    them, l. 351-352, 394-396), the norms, ``mlps.{j}``, the MoE (``router.classifier``, the correction
    bias, stacked or per-expert experts)."""
    C = hf.req("hidden_size")
    for j in range(2):
        a = f"{ours}sublayers.{j}."
        put_mla(plan, f"{a}attn.", f"{theirs}self_attn.{j}.", hf)
        scale_planned(plan, f"{a}attn.q_b_proj.weight", math.sqrt(C / hf.req("q_lora_rank")), "mla_scale_q_lora")
        scale_planned(plan, f"{a}attn.kv_a_norm.weight", math.sqrt(C / hf.req("kv_lora_rank")), "mla_scale_kv_lora")
        plan.put(f"{a}attn_norm.weight", f"{theirs}input_layernorm.{j}.weight")
        plan.put(f"{ours}ffn_norms.{j}.weight", f"{theirs}post_attention_layernorm.{j}.weight")
        parts.put_mlp(plan, f"{ours}mlps.{j}.", f"{theirs}mlps.{j}.")
    moe, theirs_moe = f"{ours}moe.", f"{theirs}mlp."
    plan.put(f"{moe}router.weight", f"{theirs_moe}router.classifier.weight")
    plan.put(f"{moe}score_bias", f"{theirs_moe}router.e_score_correction_bias")
    if plan.src.has(f"{theirs_moe}experts.0.gate_proj.weight"):  # saved folders: one tensor per expert
        put_per_expert(plan, moe, theirs_moe)
    else:
        put_stacked_experts(plan, moe, theirs_moe)


def convert_longcat(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """LongCat-Flash (``LongcatFlashForCausalLM`` / ``LongcatFlashModel``): build and copy the weights
    (the head follows them); the multi-token-prediction module (``model.mtp.*``) is dropped, as
    transformers drops it, and the router's bias (``router_bias``) is unused there and here."""
    hf = _longcat(hf)
    model, plan, head_size = parts.start(hf, sd, build_longcat, device=device, dtype=dtype)
    for i in range(model.depth):
        _put_longcat_layer(plan, f"blocks.{i}.", f"layers.{i}.", hf)
    return parts.finish(plan, model, head_size,
                        ignore=[r"(model\.)?mtp\..*", r"(model\.)?layers\.\d+\.mlp\.router\.classifier\.bias"])


#: per ``model_type``: its name and the prefix of its transformers classes (``{prefix}ForCausalLM``,
#: ``{prefix}Model``; Sarvam-MLA's are DeepSeek-V3's)
CLASSES = {"deepseek_v3": ("DeepSeek-V3", "DeepseekV3"), "deepseek_v2": ("DeepSeek-V2", "DeepseekV2"),
           "glm4_moe_lite": ("GLM-4-MoE-Lite", "Glm4MoeLite"), "mistral4": ("Mistral-4", "Mistral4"),
           "minicpm5_moe": ("MiniCPM5-MoE", "MiniCPM5Moe"), "axk1": ("A.X-K1", "AXK1"),
           "deepseek_v32": ("DeepSeek-V3.2", "DeepseekV32"), "glm_moe_dsa": ("GLM-MoE-DSA", "GlmMoeDsa"),
           "sarvam_mla": ("Sarvam-MLA", "DeepseekV3"), "youtu": ("Youtu-LLM", "Youtu"), "minicpm3": ("MiniCPM3", "MiniCPM3"),
           "axk2": ("A.X-K2", "AXK2"), "longcat_flash": ("LongCat-Flash", "LongcatFlash")}

#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {t: parts.Dispatch(name, convert_deepseek, (f"{prefix}ForCausalLM", f"{prefix}Model"))
            for t, (name, prefix) in CLASSES.items()}
#: DeepSeek-OCR2's text model: only inside its wrapper (``deepseek_ocr2`` in ``models/hf/wrappers.py``)
DISPATCH["deepseek_ocr2_text"] = parts.Dispatch("DeepSeek-OCR2 text", convert_deepseek, ("DeepseekOcr2TextModel",))
