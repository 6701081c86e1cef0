"""The sparse-MoE decoders of the LLaMA line -> :class:`~attnzoo.DecoderLM`: Mixtral
(``MixtralForCausalLM`` / ``MixtralModel``), Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5 (``glm4_moe``),
MiniMax-M2, and the second batch: dots.llm1 (``dots1``), ERNIE-4.5-MoE (``ernie4_5_moe``),
Hunyuan-A13B (``hunyuan_v1_moe``), EXAONE-MoE (``exaone_moe``), Solar-Open (``solar_open``), AFMoE
(``afmoe``), HY-V3 (``hy_v3``), GraniteMoE (``granitemoe``) and PhiMoE (``phimoe``; line numbers of
its ``modular_phimoe.py``). Line numbers are transformers 5.25's ``models/<family>/modeling_<family>.py``
(``configuration_<family>.py`` where it says so); the third batch (Mellum, Flint, Kolibri-1) cites
``modular_<family>.py``; the fourth: GraniteMoeShared (``granitemoeshared``), FlexOlmo (``flex_olmo``),
Param2-MoE (``param2moe``), Sarvam-MoE (``sarvam_moe``), Cohere2-MoE (``cohere2_moe``), DBRX (``dbrx``),
Kolibri 1.1 (``kolibri1_1``); Dory, once a row here, is its own module (``families/dory.py``).

Every layer is LLaMA's pre-norm layer (RMSNorm, GQA with RoPE on the whole head, no residual
scaling) whose feed-forward is, on the *sparse* layers, a
:class:`~attnzoo.nn.moe.MixtureOfExperts` in transformers' stacked layout (router ``gate.weight [E,
C]``, experts ``gate_up_proj [E, 2F, C]`` with rows ``[gate; up]``, ``down_proj [E, C, F]``): a
softmax over every expert in float32, the top ``num_experts_per_tok``, renormalised to sum 1 when
``norm_topk_prob``, SwiGLU experts weighted by them. What each family adds:

* **Mixtral** (``mixtral``; modeling 47-130, 150-250): the top-k always renormalised (l. 94); the
  experts' hidden width is ``intermediate_size``; a causal window of ``sliding_window - 1`` keys on
  every layer when ``sliding_window`` is set (l. 322, 444). Saved folders in Mistral's names
  (``block_sparse_moe``, experts ``w1``/``w3``/``w2``) load too.
* **Qwen2-MoE** (``qwen2_moe``; modeling 209-360): q/k/v biases (``qkv_bias``, ``o_proj`` has none);
  a shared SwiGLU expert of ``shared_expert_intermediate_size`` gated by ``sigmoid(shared_expert_gate
  (x))`` added to every sparse layer (l. 331-350); the layer is sparse iff it is not in
  ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (l. 358-361), else a dense SwiGLU MLP
  of ``intermediate_size``; ``layer_types`` by default alternate sliding (even ``i`` below
  ``max_window_layers``) and full when ``use_sliding_window`` (configuration 107-116).
* **Qwen3-VL-MoE text** (``qwen3_vl_moe_text``; ``models/qwen3_vl_moe/modeling_qwen3_vl_moe.py``
  114-170, 352-357): Qwen3-MoE's layer and experts, the top-k always renormalised (no
  ``norm_topk_prob``), no window; its multimodal RoPE is the 1-D RoPE on text (three equal position
  streams; ``models/hf/llama.py``). Its checkpoints store the experts transposed (``gate_up_proj
  [E, C, 2F]``, ``down_proj [E, F, C]``; transformers' ``conversion_mapping`` transposes them at load):
  both layouts load. The ``qwen3_vl_moe`` wrapper converts to it.
* **Qwen3-MoE** (``qwen3_moe``; modeling 122-320): Qwen3's per-head QK RMSNorm (l. 147-148), the
  experts of ``moe_intermediate_size``, the same sparse-layer rule, one window on every layer when
  ``use_sliding_window`` (configuration 106-107).
* **OLMoE** (``olmoe``; modeling 197-345): OLMo 2's QK RMSNorm over all the heads of a token
  (l. 222-240), experts of ``intermediate_size`` on every layer.
* **GLM-4.5 / 4.6 / 4.7** (``glm4_moe``; modeling 46-130, 180-410): q/k/v biases
  (``attention_bias``; ``o_proj`` none), per-head QK RMSNorm when ``use_qk_norm``, rotary on the first
  ``partial_rotary_factor`` (default 0.5) of each head (split-half pairs), dense SwiGLU layers below
  ``first_k_dense_replace``, then DeepSeek-V3's MoE (:func:`~attnzoo.models.families._moe.deepseek_moe`:
  sigmoid scores in float32, group-limited top-k of ``scores + e_score_correction_bias``,
  ``norm_topk_prob``, ``routed_scaling_factor``, ``n_shared_experts`` ungated shared experts). The
  checkpoints' multi-token-prediction layers (``layers.{j >= num_hidden_layers}``) are not part of
  the causal LM (transformers drops them); a checkpoint folder that holds them loads them as the
  model's ``mtp`` (:mod:`attnzoo.models.mtp`: each a MoE layer with ``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.norm``, as transformers' ``MtpModel`` builds them).
* **GLM-4.5V text** (``glm4v_moe_text``; ``models/glm4v_moe/modeling_glm4v_moe.py`` 200-460): GLM-4.5's
  layer and MoE without QK norms, q/k/v biases by default, rotary on half of each head (split
  halves); its multimodal RoPE is the 1-D RoPE on text (three equal position streams). The
  ``glm4v_moe`` wrapper converts to it; its MTP layers are dropped.
* **MiniMax-M2** (``minimax_m2``; modeling 46-127, 276-340): QK RMSNorm over all heads, rotary on the
  first ``rotary_dim`` channels (the released checkpoints' key; ``partial_rotary_factor`` otherwise),
  theta 5e6 by default; every layer a MoE of ``intermediate_size`` experts routed by the top-k of
  ``sigmoid(logits) + e_score_correction_bias`` (the buffer on the MoE block), weighted by the
  sigmoids renormalised to sum 1 (no epsilon, no scaling, no shared expert).

The second batch (each row: what it changes; "DeepSeek-V3's MoE" as for GLM-4.5, its shared
experts ungated, of ``moe_intermediate_size * n_shared_experts`` (or ``num_shared_experts``)):

* **dots.llm1** (``dots1``; 183-270, 272-400): Qwen3's attention (per-head QK RMSNorm before RoPE,
  biases on q/k/v/o by ``attention_bias``), dense layers below ``first_k_dense_replace`` (default 0),
  DeepSeek-V3's MoE (``norm_topk_prob`` default False); ``layer_types`` by default sliding from
  ``max_window_layers`` on when ``sliding_window`` is set (configuration 111-121).
* **ERNIE-4.5-MoE** (``ernie4_5_moe``; 130-166, 269-410): RoPE on adjacent channel pairs (l. 130-166:
  ``rotate_half`` over ``0::2`` / ``1::2``); the MoE on layer ``i`` iff ``moe_layer_start_index <= i
  <= moe_layer_end_index`` and ``(i + 1) % moe_layer_interval == 0`` (l. 396-402); router in float32
  (l. 336-358): the top ``moe_k`` of ``softmax + e_score_correction_bias`` (``moe_statics``, ``[1,
  E]``) pick, their softmax probabilities weight, divided by ``max(sum, moe_norm_min)``
  (:class:`Float32RouterMoE`); ``moe_num_shared_experts`` ungated shared experts; tied embeddings by
  default. A checkpoint folder's MTP layer (``mtp_block.0``, ``mtp_emb_norm.0``, ``mtp_hidden_norm.0``,
  ``mtp_linear_proj.0``; its post norm the final ``norm``, one module) loads as the model's ``mtp``.
* **Hunyuan-A13B** (``hunyuan_v1_moe``; 153-300, 380-440): per-head ``query_layernorm`` /
  ``key_layernorm`` *after* RoPE (l. 196-200, :class:`PostRopeNormAttention`: the logits then depend
  on absolute positions, counted from each row's first token as ``generate`` counts them); every
  layer a MoE whose experts and always-on ungated ``shared_mlp`` have ``intermediate_size``, routed
  by a float32 softmax top-``moe_topk``, always renormalised (l. 225-245); ``rope_type="dynamic"``
  with ``alpha``: the base ``theta * alpha ** (D / (D - 2))`` (l. 381-440).
* **EXAONE-MoE** (``exaone_moe``; 137-210, 309-380): per-head QK RMSNorm, no attention biases, RoPE
  on the sliding layers only when ``sliding_window`` is set (the full layers are NoPE, l. 184-186);
  ``layer_types`` by default full every ``sliding_window_pattern``-th layer (configuration 122-135);
  dense layers by ``mlp_layer_types`` (default below ``first_k_dense_replace``); DeepSeek-V3's MoE
  (``routed_scaling_factor`` 2.5 by default). The checkpoints' ``mtp`` layers are dropped.
* **Solar-Open** (``solar_open``; 184-345): LLaMA's attention with q/k/v biases by ``attention_bias``
  and none on ``o_proj`` (l. 279-301), GLM-4.5's MoE on every layer, full RoPE (theta 1e6).
* **AFMoE** (``afmoe``; 95-460): four OLMo-2 RMSNorms a layer (before and after the attention and the
  MLP, l. 388-452: ``sublayer_norm="both"``, the weights applied and kept in float32), per-head QK
  RMSNorm, an element-wise output gate ``sigmoid(gate_proj(x))`` before ``o_proj`` (l. 383), RoPE
  on the sliding layers only (l. 359-361; full every ``global_attn_every_n_layers``-th, configuration
  112-120), embeddings times ``sqrt(hidden_size)`` when ``mup_enabled`` (l. 567); dense layers below
  ``num_dense_layers``; a MoE routed by the top-k of ``sigmoid + expert_bias``, renormalised,
  times ``route_scale`` (l. 126-160), with ``num_shared_experts`` ungated shared experts.
* **HY-V3** (``hy_v3``; 199-400): per-head QK RMSNorm, biases on q/k/v/o by ``attention_bias``, dense
  MLPs and shared experts with ``mlp_bias``, dense layers by ``mlp_layer_types`` (default: the first),
  the MoE routed as MiniMax-M2 (the block's ``e_score_correction_bias``) with ``1e-20`` and
  ``router_scaling_factor`` (l. 271-300). Its ``enable_moe_fp32_combine`` (routed + shared summed in
  float32) changes nothing in float32; in half precision attnzoo sums in the model's dtype.
* **GraniteMoE** (``granitemoe``; 113-190, 263-365, 394-450, 545-620): Granite's multipliers (the
  embeddings times ``embedding_multiplier`` l. 447, scores times ``attention_multiplier`` l. 272,
  sub-layer outputs times ``residual_multiplier`` l. 359/363, logits divided by ``logits_scaling``
  l. 559), q/k/v/o biases by ``attention_bias``; every layer Granite 4.0-H's experts without a
  shared MLP (``block_sparse_moe``: ``router.weight``, the top-k of the logits then a softmax over
  them, l. 128-132; saved as ``router.layer`` / ``input_linear`` / ``output_linear``). The residual
  multiplier and ``1 / logits_scaling`` are folded into the weights at load
  (:func:`~attnzoo.models.families.granitemoehybrid.finish_folded`).
* **PhiMoE** (Phi-3.5-MoE, ``phimoe``; modular 74-76, 137-255, 258-330): Mixtral's layer and
  experts with LayerNorms (weights and biases, eps ``rms_norm_eps``; 310-316, 327-330), q/k/v/o
  biases by ``attention_bias``, an LM-head bias by ``lm_head_bias`` (335), one window of
  ``sliding_window - 1`` keys on every layer; routed by the *sparsemixer* (137-255, eval branch;
  :class:`SparseMixerMoE`): always two experts, the first the top logit ``m1`` weighted by the
  softmax over the logits ``s`` with ``(m1 - s) / max(|s|, m1) <= 2 * router_jitter_noise`` (the
  others masked), the second the top of the rest ``m2`` weighted likewise (``m2`` in place of
  ``m1``, the first expert masked). transformers' training branch samples the experts (Gumbel) and
  rescales the gradients (Heun's estimator): attnzoo trains through the deterministic choice with
  plain autograd gradients. Saved folders (``block_sparse_moe.gate``, experts ``w1``/``w3``/``w2``)
  load too.

The third batch:

* **Mellum** (``mellum``; modular 39-160): Qwen3-MoE's attention (per-head QK RMSNorm, biases on
  q/k/v/o by ``attention_bias``) and experts (float32 softmax top-k, ``norm_topk_prob`` True by
  default) on Laguna's layer and model: a window of ``sliding_window - 1`` keys on the
  ``sliding_attention`` layers of ``layer_types`` (default: all full, l. 88-89, 126-129), each layer
  kind its own RoPE ``rope_parameters[kind]`` (thetas 5e5 full / 1e4 sliding, l. 93-97, 122), dense
  SwiGLU layers by ``mlp_layer_types`` (default: all sparse, l. 90-91; 136-139). A checkpoint folder's MTP layer
  (``mtp.layers.0``, ``mtp.fc``, ``mtp.pre_fc_norm_*``, ``mtp.norm``) loads as the model's ``mtp``.
* **Flint** (``flint``; modular 47-250): Qwen3-MoE's attention with a learnable sink logit per head
  (l. 170-171, 182: ``sinks``, saved as ``softmax_offset``), RoPE on the sliding layers only
  (the full ones NoPE, l. 200-203); ``layer_types`` by default full on layers 0, 1, every
  ``i % 4 == 1`` and the last (l. 98-102), the rest a window of ``sliding_window - 1``; dense layers
  in ``mlp_only_layers`` (default ``[0, 1]``, l. 103-104) and Qwen-MoE's ``decoder_sparse_step`` rule; the MoE
  routed by the top-k of ``sigmoid(logits)`` (float32, no bias), renormalised when
  ``norm_topk_prob`` (l. 116-132), plus an always-on *ungated* shared expert of
  ``shared_expert_intermediate_size`` (l. 135-147); the router weight kept float32 (l. 236);
  GPT-OSS's RMSNorms (the weight applied in float32, l. 108: the blocks' and the final norm; in half
  precision attnzoo's per-head QK norms round before the weight).
* **Kolibri-1** (``kolibri1``; modular 38-170): GLM-4's layer (l. 147-150: RMSNorms before and after both
  sub-layers: ``post_self_attn_layernorm``, ``post_mlp_layernorm``; saved as ``post_attn_norm`` /
  ``post_ffn_norm``), EXAONE-4's attention (l. 101-104: per-head QK RMSNorm, no biases, RoPE only on the sliding
  layers when a ``sliding_window`` is set); ``layer_types`` by default full every fifth layer (l.
  89-93); every layer a MoE (:class:`LogitBiasSigmoidMoE`) routed by the top-k of ``logits +
  e_score_correction_bias`` (float32; saved as ``moe.router.expert_bias``), weighted by the
  sigmoids of those logits, renormalised when ``norm_topk_prob`` (default False; l. 115-137), plus
  an ungated shared expert of ``shared_expert_intermediate_size`` (DeepSeek-V3's block, l. 140-144).
  (Without a ``sliding_window`` transformers' own model cannot run: it always builds the sliding
  mask.)

The fourth batch (``modeling_<family>.py`` line numbers):

* **GraniteMoeShared** (``granitemoeshared``; 97-115, 340-385): GraniteMoE's layer (multipliers
  folded as there) whose MoE output is added to an always-on SwiGLU ``shared_mlp`` of
  ``shared_intermediate_size`` (``input_linear [2S, C]`` rows ``[gate; up]``, ``output_linear``;
  none when 0, the default; l. 344, 377-383): Granite 4.0-H's ``put_feed_forward``.
* **FlexOlmo** (``flex_olmo``; 46-60, 197-390): OLMoE's attention (QK RMSNorm over all heads of a
  token, biases on q/k/v/o by ``attention_bias``) and experts (softmax in float32 over every
  expert, top-k, ``norm_topk_prob``) on OLMo 2's layer: RMSNorms on the sub-layer *outputs* only
  (``post_attention_layernorm`` / ``post_feedforward_layernorm``, l. 378, 384), the weight applied in
  float32 (l. 55-60); every layer sparse; theta 5e5 by default.
* **Param2-MoE** (``param2moe``) and **Sarvam-MoE** (``sarvam_moe``): transformers builds both as
  ``Glm4MoeForCausalLM`` from their own configs (``configuration_param2moe.py`` /
  ``configuration_sarvam_moe.py``, identical but for the defaults): GLM-4.5's model with the rotary
  over the whole head (``partial_rotary_factor`` 1.0 by default, l. 124-127), per-head QK norms by
  default (``use_qk_norm`` True), routed scaling 2.5; their original config names (``use_qkv_bias``,
  ``num_shared_experts``, ``num_mtp_layers``; the configs' ``attribute_map``) read too. Their saved
  folders keep the original checkpoints' names (``conversion_mapping.py``: ``word_embeddings``,
  ``attention.query_key_value`` rows ``[q; k; v]``, ``attention.dense``,
  ``query_layernorm`` / ``key_layernorm``, ``mlp.gate.expert_bias``): both load.
* **Cohere2-MoE** (``cohere2_moe``; 46-205, 330-420): Cohere2's *parallel* layer (one norm, then
  the attention and the MLP / MoE of the same normed input added to the residual together, l.
  411-413): here a :class:`~attnzoo.nn.parallel.ParallelMixers` of the attention and the
  feed-forward (:class:`FeedForwardMixer`) in a block without a feed-forward; the norms bias-free
  LayerNorms (``layer_norm_eps``; weight in float32) or RMSNorms when ``rms_norm_eps`` is set (l.
  394-398); interleaved RoPE (adjacent pairs) on the sliding layers and, when
  ``prefix_dense_sliding_window_pattern == 1``, on the dense layers (``force_rope``, l. 325-327), none
  on the other full layers; a window of ``sliding_window - 1`` keys; biases on q/k/v/o by
  ``attention_bias``; dense layers by ``mlp_layer_types`` (default the first ``first_k_dense_replace``,
  ``prefix_dense_intermediate_size`` wide) and ``layer_types`` (configuration 128-150); the MoE
  (:func:`_cohere_moe`): the top-k logits then a softmax over them, or their sigmoids renormalised
  by ``norm_topk_prob`` (``expert_selection_fn``), experts of ``intermediate_size``,
  ``num_shared_experts`` ungated shared experts summed with the routed output or averaged
  (``shared_expert_combination_strategy``; the ``/ 2`` folded into both down projections at load:
  exact); the logits times ``logit_scale`` (folded into the final norm of an LM head); tied
  embeddings by default.
* **DBRX** (``dbrx``; 170-440): its own names (``transformer.wte``, ``blocks.{i}.norm_attn_norm.
  {norm_1, attn.Wqkv, attn.out_proj, norm_2}``, ``blocks.{i}.ffn.{router.layer, experts.mlp.{w1,
  v1, w2}}``, ``norm_f``) and nested config (``d_model`` / ``n_heads`` / ``n_layers`` /
  ``max_seq_len``; ``attn_config``: ``kv_n_heads`` default 1, ``clip_qkv``, ``attn_pdrop``;
  ``ffn_config``: ``ffn_hidden_size``, ``moe_num_experts``, ``moe_top_k``,
  ``moe_normalize_expert_weights``, ``ffn_act_fn``); bias-free LayerNorms (eps 1e-5); the fused
  q/k/v clamped to ``[-clip_qkv, clip_qkv]`` before RoPE (:class:`ClippedAttention`); every layer
  :class:`NormalizedTopKMoE` (a softmax in the logits' dtype, the top-k divided by their
  ``moe_normalize_expert_weights``-norm; experts ``w1`` / ``v1`` / ``w2`` ``[E F, C]``: gate, up and
  the transposed down); ``resid_pdrop`` on both sub-layer outputs while training; ``emb_pdrop``
  is stored but never applied by transformers (nor here). transformers reads the RoPE base from
  ``rope_parameters`` (default 1e4) and ignores ``attn_config.rope_theta`` (the released
  checkpoints put 5e5 there; attnzoo follows transformers), and its attention cannot run without a
  ``clip_qkv`` (``clamp(None, None)``); attnzoo runs both.
* **Dory** (``dory``): no MoE (an nGPT decoder whose middle layers run several times): its own
  module, ``families/dory.py``.
* **Kolibri 1.1** (``kolibri1_1``; 43-189, 259-560): Kolibri-1's layer (GLM-4's four norms) and
  MoE (:class:`LogitBiasSigmoidMoE` + ungated shared expert) with ``mlp_only_layers`` (default the
  first two) dense SwiGLUs of ``mlp_only_intermediate_size``; ``layer_types`` ``sliding_attention``
  (RoPE, a window of ``sliding_window - 1`` keys, per-head QK norms) and ``indexed_attention``
  (default every fifth layer; :class:`IndexedAttention`): NoPE, per-head QK norms, over the keys a
  weightless indexer selects (:class:`KolibriIndex`: the ``index_topk`` best of a pool of
  ``index_pool_size`` keys picked by blocks of ``index_compression``, plus the first
  ``index_num_sink_tokens`` and the last ``index_num_local_tokens``, scored by ReLU logits of the
  first ``index_num_heads`` query heads against key head 0, NVFP4-rounded), the keys and values
  rounded to NVFP4 (:func:`nvfp4`, a straight-through gradient); a layer of ``index_layers`` picks
  a new pool, the others use the latest one; ``kv_source_layers``: a layer reading an earlier
  indexed layer's keys and values (no ``k_proj`` / ``v_proj`` / ``k_norm`` of its own; gemma4's
  :class:`~attnzoo.models.families.gemma4.SharedKV`). The model is a :class:`Kolibri11LM` (a
  :class:`~attnzoo.models.loop.LayerLoopLM`): packed sequences run one at a time. The selection is
  exact against transformers' (same float32 scores, ties to the earlier keys); its cached decode
  equals its full forward (every query's selection depends on its own row only).
* **ERNIE-4.5-VL text** (``ernie4_5_vl_moe_text``; ``models/ernie4_5_vl_moe/modeling_ernie4_5_vl_moe.py``
  62-131, 306-482): ERNIE-4.5-MoE's layer, router and shared experts; its MoE runs the text experts
  (``mlp.text_moe``) on text tokens and the vision experts (``mlp.vision_moe``) on image / video tokens
  (l. 452-478): on text only the text experts, of ``moe_intermediate_size[0]`` (the shared experts
  ``moe_num_shared_experts`` times it); dense layers by ``mlp_layer_types`` (default the first). Its 3-D
  RoPE (the h / w frequencies pre-permuted, l. 101-107, re-interleaved per call, l. 124-131) is ERNIE's
  adjacent-pair 1-D RoPE on text (equal position streams). The released layout (``conversion_mapping``:
  ``mlp.gate.weight [C, E]``, ``mlp.moe_statics.e_score_correction_bias [2, E]``, experts ``0 .. 2E-1``
  text then vision) loads its text half. The ``ernie4_5_vl_moe`` wrapper converts to it, dropping the
  vision experts by name.

Refused by name: ``router_jitter_noise`` > 0 (Mixtral multiplies the MoE input by noise while
training, l. 124: not reproduced), OLMoE's ``clip_qkv`` (a clamp of q, k and v that attnzoo's
attention does not have), ``hidden_act`` other than SiLU in the experts; ERNIE's ``use_bias``
(biases on every projection and on the LM head); Hunyuan's per-layer ``num_experts`` list (its
``moe_topk`` may be one per layer); ``mlp_layer_types`` entries other than ``"dense"`` /
``"sparse"``; EXAONE-MoE's string ``sliding_window_pattern`` without ``layer_types``; PhiMoE's ``num_experts_per_tok`` other than 2
(the sparsemixer picks two, whatever it says), ``input_jitter_noise`` > 0 (training noise on the MoE
input) and ``rope_type`` other than ``"default"`` (its rotary switches between ``short_mscale`` and
``long_mscale`` by the longest position of each call, modular 57-71); Mellum's
``partial_rotary_factor`` other than 1 (its Qwen3 rotation covers the whole head: transformers'
own model fails on it). Fourth batch: GraniteMoeShared's Granite options as GraniteMoE's; Cohere2-MoE's
``expert_selection_fn`` other than ``"softmax"`` / ``"sigmoid"``, ``shared_expert_combination_strategy``
other than ``"average"`` / ``"sum"``, scaled RoPE types (interleaved pairs); DBRX's
``moe_jitter_eps`` (training noise on the router input), ``ffn_act_fn`` other than SiLU,
``moe_normalize_expert_weights`` <= 0, ``clip_qkv`` <= 0; Kolibri 1.1's layer types other than
``sliding_attention`` / ``indexed_attention`` and more than 10 indexed layers without
``kv_source_layers`` (its default covers 10; transformers' config refuses them too); ERNIE-4.5-VL's
``mrope_section`` other than ``[h, h, t]`` with ``2h + t == head_dim / 2`` (transformers' rotary cannot build
them) and ``moe_intermediate_size`` other than two widths.
"""

from __future__ import annotations

import functools
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
import attnzoo.models.families.granitemoehybrid as granite
from attnzoo.blocks import BlockLayers, FeedForward, TransformerBlock
from attnzoo.functional.softmax.varlen import attention_varlen
from attnzoo.models._common import LayerCaches
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import (
    deepseek_moe,
    moe_from_config,
    put_moe,
    put_per_expert,
    put_stacked_experts,
)
from attnzoo.models.families.gemma4 import Gemma4Attention, KVSharing, SharedKV, SharedKVCounter
from attnzoo.models.families.kimi_linear import saved_names
from attnzoo.models.families.qwen3_next import real_keys
from attnzoo.models.hf._state import HFConfig, Plan, float_dtype, load_qkv_into
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.models.loop import LayerLoopLM
from attnzoo.models.mtp import MTPLayer, MultiTokenPredictor
from attnzoo.models.parts import DecoderParts, LMHead, head_for
from attnzoo.nn.attention import MultiHeadAttention, build_softmax
from attnzoo.nn.frontier import packed_cu_seqlens, packed_positions
from attnzoo.nn.moe import MixtureOfExperts, Routing
from attnzoo.nn.parallel import ParallelMixers
from attnzoo.nn.positional import RotaryEmbedding, resolve_positions

__all__ = ["DISPATCH", "MOE_KEYS", "VARIANTS", "Float32RouterMoE", "IndexPool", "IndexedAttention", "Kolibri11LM",
           "KolibriIndex", "LogitBiasSigmoidMoE", "PostRopeNormAttention", "SparseMixerMoE", "Variant",
           "build_sparse_moe", "convert_sparse_moe", "kolibri1_1_layout", "layer_kinds", "nvfp4", "sparse_layers",
           "top_k_lowest", "window_of_layers"]


@dataclass(frozen=True)
class Variant:
    """What a family changes in the shared layer (see the module docstring), with its name and the
    transformers classes that convert."""

    name: str
    classes: tuple[str, ...]
    qk_norm: str | None = None  # "head" / "all", or None; "head_if_flag": per head when use_qk_norm;
    #                             "head_after_rope": per head after the rotation (Hunyuan)
    qkv_bias: str | None = None  # the key whose value puts biases on q/k/v but none on o_proj
    routing: str = "softmax"  # "softmax" (stacked top-k), "deepseek" (GLM-4.5 ...), "sigmoid" (MiniMax-M2),
    #                           "ernie" / "hunyuan" (:class:`Float32RouterMoE`)
    width: str = "moe_intermediate_size"  # the experts' hidden width key
    shared: bool = False  # Qwen2-MoE's sigmoid-gated shared expert
    renorm: bool = False  # the top-k always renormalised (Mixtral)
    keys: str | None = None  # batch 2: the MoE block's tensor names, a key of ``MOE_KEYS``
    scaling: str = "routed_scaling_factor"  # the key of the routed weights' factor (routing "deepseek")
    rope_layers: str = "all"  # "sliding" (AFMoE: full layers NoPE), "sliding_if_window" (EXAONE-MoE)
    interleaved: bool = False  # RoPE on adjacent channel pairs (ERNIE-4.5)
    sandwich: bool = False  # AFMoE: RMSNorms before and after the attention and the MLP, an output gate
    float32_router: bool = False  # the router weight kept float32 (transformers' _keep_in_fp32_modules_strict)
    granite: bool = False  # Granite's multipliers (GraniteMoE; routing "granite": its experts)
    layer_norm: bool = False  # LayerNorms with biases and an LM-head bias by lm_head_bias (PhiMoE)
    rope_by_kind: bool = False  # each layer kind its own ``rope_parameters[kind]`` (Mellum)
    sinks: bool = False  # a learnable sink logit per head (Flint)
    glm4_norms: bool = False  # GLM-4's RMSNorms after the attention and the MLP too (Kolibri-1)
    float32_norms: bool = False  # the RMSNorms apply their weight in float32, then round (Flint: GPT-OSS's)
    olmo2_norms: bool = False  # OLMo 2's RMSNorms on the sub-layer outputs only (FlexOlmo)
    aliases: tuple[tuple[str, str], ...] = ()
    parallel: bool = False  # Cohere2-MoE: the attention and the MoE side by side on one normed input
    indexed: bool = False  # Kolibri 1.1: sliding and indexed layers (:class:`IndexedAttention`), KV sharing  # (a config's other name, the key read here), as attribute_map maps them


#: Param2-MoE's / Sarvam-MoE's original config names (their configs' ``attribute_map``)
_GLM_ALIASES = (("use_qkv_bias", "attention_bias"), ("num_shared_experts", "n_shared_experts"),
                ("num_mtp_layers", "num_nextn_predict_layers"))
VARIANTS: dict[str, Variant] = {
    "mixtral": Variant("Mixtral", ("MixtralForCausalLM", "MixtralModel"),
                       width="intermediate_size", renorm=True),
    "qwen2_moe": Variant("Qwen2-MoE", ("Qwen2MoeForCausalLM", "Qwen2MoeModel"),
                         qkv_bias="qkv_bias", shared=True),
    "qwen3_moe": Variant("Qwen3-MoE", ("Qwen3MoeForCausalLM", "Qwen3MoeModel"),
                         qk_norm="head"),
    "qwen3_vl_moe_text": Variant("Qwen3-VL-MoE text", ("Qwen3VLMoeTextModel",), qk_norm="head", renorm=True),
    "olmoe": Variant("OLMoE", ("OlmoeForCausalLM", "OlmoeModel"),
                     qk_norm="all", width="intermediate_size"),
    "glm4_moe": Variant("GLM-4.5", ("Glm4MoeForCausalLM", "Glm4MoeModel"),
                        qk_norm="head_if_flag", qkv_bias="attention_bias", routing="deepseek", float32_router=True),
    "glm4v_moe_text": Variant("GLM-4.5V text", ("Glm4vMoeTextModel",),
                              qk_norm="head_if_flag", qkv_bias="attention_bias", routing="deepseek", float32_router=True),
    "minimax_m2": Variant("MiniMax-M2", ("MiniMaxM2ForCausalLM", "MiniMaxM2Model"),
                          qk_norm="all", routing="sigmoid", width="intermediate_size"),
    "dots1": Variant("dots.llm1", ("Dots1ForCausalLM", "Dots1Model"),
                     qk_norm="head", routing="deepseek", keys="gate", float32_router=True),
    "ernie4_5_moe": Variant("ERNIE-4.5-MoE", ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeModel"),
                            routing="ernie", keys="ernie", interleaved=True),
    "hunyuan_v1_moe": Variant("Hunyuan-MoE", ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Model"),
                              qk_norm="head_after_rope", routing="hunyuan", width="intermediate_size", keys="hunyuan"),
    "exaone_moe": Variant("EXAONE-MoE", ("ExaoneMoeForCausalLM", "ExaoneMoeModel"),
                          qk_norm="head", routing="deepseek", keys="gate", rope_layers="sliding_if_window", float32_router=True),
    "solar_open": Variant("Solar-Open", ("SolarOpenForCausalLM", "SolarOpenModel"),
                          qkv_bias="attention_bias", routing="deepseek", keys="gate", float32_router=True),
    "afmoe": Variant("AFMoE", ("AfmoeForCausalLM", "AfmoeModel"),
                     qk_norm="head", routing="deepseek", keys="afmoe", scaling="route_scale", rope_layers="sliding", sandwich=True),
    "hy_v3": Variant("HY-V3", ("HYV3ForCausalLM", "HYV3Model"),
                     qk_norm="head", routing="deepseek", keys="block", scaling="router_scaling_factor", float32_router=True),
    "granitemoe": Variant("GraniteMoE", ("GraniteMoeForCausalLM", "GraniteMoeModel"),
                          routing="granite", width="intermediate_size", granite=True),
    "phimoe": Variant("PhiMoE", ("PhimoeForCausalLM", "PhimoeModel"),
                      routing="sparsemixer", width="intermediate_size", layer_norm=True),
    "mellum": Variant("Mellum", ("MellumForCausalLM", "MellumModel"), qk_norm="head", rope_by_kind=True),
    "flint": Variant("Flint", ("FlintForCausalLM", "FlintModel"), qk_norm="head", routing="sigmoid_shared",
                     rope_layers="sliding", float32_router=True, sinks=True, float32_norms=True),
    "kolibri1": Variant("Kolibri-1", ("Kolibri1ForCausalLM", "Kolibri1Model"), qk_norm="head", routing="kolibri",
                        keys="gate", rope_layers="sliding_if_window", glm4_norms=True),
    "kolibri1_1": Variant("Kolibri-1.1", ("Kolibri1_1ForCausalLM", "Kolibri1_1Model"), qk_norm="head",
                          routing="kolibri", keys="gate", glm4_norms=True, indexed=True),
    "cohere2_moe": Variant("Cohere2-MoE", ("Cohere2MoeForCausalLM", "Cohere2MoeModel"), routing="cohere",
                           width="intermediate_size", keys="cohere", interleaved=True, parallel=True),
    "dbrx": Variant("DBRX", ("DbrxForCausalLM", "DbrxModel"), routing="dbrx", width="intermediate_size",
                    aliases=(("d_model", "hidden_size"), ("n_heads", "num_attention_heads"),
                             ("n_layers", "num_hidden_layers"), ("max_seq_len", "max_position_embeddings"))),
    "granitemoeshared": Variant("GraniteMoeShared", ("GraniteMoeSharedForCausalLM", "GraniteMoeSharedModel"),
                                routing="granite", width="intermediate_size", granite=True),
    "flex_olmo": Variant("FlexOlmo", ("FlexOlmoForCausalLM", "FlexOlmoModel"), qk_norm="all", width="intermediate_size",
                         float32_norms=True, olmo2_norms=True),
    "param2moe": Variant("Param2-MoE", ("Glm4MoeForCausalLM", "Glm4MoeModel"), qk_norm="head_if_flag",
                         qkv_bias="attention_bias", routing="deepseek", float32_router=True, aliases=_GLM_ALIASES),
    "sarvam_moe": Variant("Sarvam-MoE", ("Glm4MoeForCausalLM", "Glm4MoeModel"), qk_norm="head_if_flag",
                          qkv_bias="attention_bias", routing="deepseek", float32_router=True, aliases=_GLM_ALIASES),
    "ernie4_5_vl_moe_text": Variant("ERNIE-4.5-VL text", ("Ernie4_5_VLMoeTextModel",), routing="ernie", keys="ernie",
                                    interleaved=True),
}
#: batch 2's MoE block names, each as the names it may have (transformers' module first, then a
#: saved folder's: EXAONE-MoE / HY-V3 / ERNIE-4.5 save their original checkpoints' names):
#: (router weight, expert-choice bias, shared experts' module)
MOE_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "gate": (("gate.weight",), ("gate.e_score_correction_bias", "e_score_correction_bias"), ("shared_experts",)),
    "block": (("gate.weight", "router.gate.weight"), ("e_score_correction_bias", "expert_bias"),
              ("shared_experts", "shared_mlp")),
    "afmoe": (("router.gate.weight",), ("expert_bias",), ("shared_experts",)),
    "ernie": (("gate.weight",), ("gate.moe_statics.e_score_correction_bias", "moe_statics.e_score_correction_bias"),
              ("shared_experts",)),
    "hunyuan": (("gate.wg.weight",), (), ("shared_mlp",)),
    "cohere": (("gate.weight",), (), ("shared_experts",)),
}
#: transformers' defaults of the keys read here, per family (a ``config.json`` may leave them out;
#: ``num_experts`` stands for ``num_local_experts`` too)
#: what Param2-MoE and Sarvam-MoE share of their defaults (GLM-4.5's model, full rotation, QK norms)
_GLM_DERIVED: dict[str, Any] = {
    "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "use_qk_norm": True, "head_dim": 64, "rms_norm_eps": 1e-6, "attention_bias": False, "hidden_act": "silu"}
DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_experts": 8, "num_experts_per_tok": 2, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                "rope_theta": 1e6, "hidden_act": "silu"},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "num_key_value_heads": 16, "rms_norm_eps": 1e-6,
                  "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "qkv_bias": True,
                  "hidden_act": "silu"},
    "qwen3_vl_moe_text": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                          "num_key_value_heads": 16, "rms_norm_eps": 1e-6, "decoder_sparse_step": 1,
                          "tie_word_embeddings": True, "hidden_act": "silu"},
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "use_sliding_window": False, "hidden_act": "silu"},
    "olmoe": {"num_experts": 64, "num_experts_per_tok": 8, "rms_norm_eps": 1e-5, "hidden_act": "silu"},
    "glm4_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
                 "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "attention_bias": False, "use_qk_norm": False,
                 "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                 "routed_scaling_factor": 1.0, "norm_topk_prob": True, "hidden_act": "silu"},
    "glm4v_moe_text": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
                       "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "attention_bias": True,
                       "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                       "routed_scaling_factor": 1.0, "norm_topk_prob": True, "hidden_act": "silu",
                       "max_position_embeddings": 65536},
    "minimax_m2": {"num_experts": 256, "num_experts_per_tok": 8, "num_key_value_heads": 8, "head_dim": 128,
                   "rms_norm_eps": 1e-6, "rope_theta": 5e6, "hidden_act": "silu"},
    "dots1": {"num_experts": None, "num_key_value_heads": 32, "rms_norm_eps": 1e-6, "first_k_dense_replace": 0,
              "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
              "sliding_window": 4096, "max_window_layers": 62, "attention_bias": False, "hidden_act": "silu"},
    "ernie4_5_moe": {"num_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1536,
                     "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": -1,
                     "moe_layer_interval": 1, "moe_norm_min": 1e-12, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
                     "rope_theta": 5e5, "tie_word_embeddings": True, "use_bias": False, "hidden_act": "silu"},
    "hunyuan_v1_moe": {"num_experts": 1, "num_experts_per_tok": 1, "rms_norm_eps": 1e-5, "attention_bias": False,
                       "hidden_act": "silu"},
    "exaone_moe": {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 1024, "num_shared_experts": 1,
                   "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
                   "first_k_dense_replace": 1, "num_key_value_heads": 32, "rms_norm_eps": 1e-5, "sliding_window": 4096,
                   "sliding_window_pattern": 4, "hidden_act": "silu"},
    "solar_open": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1280, "n_shared_experts": 1,
                   "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                   "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                   "attention_bias": False, "hidden_act": "silu"},
    "afmoe": {"num_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408, "num_shared_experts": 2,
              "route_scale": 1.0, "num_dense_layers": 1, "head_dim": 128, "rms_norm_eps": 1e-5,
              "global_attn_every_n_layers": 4, "sliding_window": 1024, "mup_enabled": False, "attention_bias": False,
              "hidden_act": "silu"},
    "hy_v3": {"num_experts": 192, "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "num_shared_experts": 1,
              "router_scaling_factor": 2.826, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
              "rope_theta": 11158840.0, "attention_bias": False, "mlp_bias": False, "first_k_dense_replace": 1,
              "hidden_act": "silu"},
    "granitemoe": {"num_experts": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-6,
                   "attention_bias": False, "hidden_act": "silu"},
    "phimoe": {"num_experts": 16, "num_local_experts": 16, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
               "num_key_value_heads": 8, "router_jitter_noise": 0.01, "input_jitter_noise": 0.0,
               "attention_bias": False, "lm_head_bias": False, "max_position_embeddings": 131072, "rope_theta": 1e6,
               "hidden_act": "silu"},
    "mellum": {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 896, "num_key_value_heads": 4,
               "head_dim": 128, "rms_norm_eps": 1e-6, "sliding_window": 1024, "norm_topk_prob": True,
               "attention_bias": False, "max_position_embeddings": 131072, "hidden_act": "silu",
               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "flint": {"num_experts": 256, "num_experts_per_tok": 6, "moe_intermediate_size": 512,
              "shared_expert_intermediate_size": 1024, "num_key_value_heads": 4, "head_dim": 128,
              "attention_bias": False, "sliding_window": 513, "norm_topk_prob": True, "mlp_only_layers": [0, 1],
              "decoder_sparse_step": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "hidden_act": "silu"},
    "kolibri1": {"num_experts": 384, "num_experts_per_tok": 6, "moe_intermediate_size": 512,
                 "shared_expert_intermediate_size": 512, "num_key_value_heads": 4, "head_dim": 128,
                 "sliding_window": 513, "norm_topk_prob": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
                 "hidden_act": "silu"},
    "kolibri1_1": {"num_experts": 384, "num_experts_per_tok": 6, "moe_intermediate_size": 512,
                   "shared_expert_intermediate_size": 512, "num_key_value_heads": 4, "head_dim": 128,
                   "sliding_window": 513, "norm_topk_prob": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
                   "hidden_act": "silu", "index_topk": 2048, "index_pool_size": 16384, "index_compression": 16,
                   "index_num_heads": 12, "index_num_local_tokens": 128, "index_num_sink_tokens": 8,
                   "mlp_only_intermediate_size": 3584},
    "cohere2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "head_dim": 128, "layer_norm_eps": 1e-5,
                    "logit_scale": 0.0625, "tie_word_embeddings": True, "sliding_window": 4096, "attention_bias": False,
                    "num_shared_experts": 0, "shared_expert_combination_strategy": "average",
                    "expert_selection_fn": "softmax", "norm_topk_prob": True, "sliding_window_pattern": 4,
                    "prefix_dense_sliding_window_pattern": 1, "max_position_embeddings": 8192, "hidden_act": "silu"},
    "dbrx": {"num_experts": 4, "hidden_size": 2048, "num_attention_heads": 16, "num_hidden_layers": 24, "max_position_embeddings": 2048,
             "tie_word_embeddings": False, "resid_pdrop": 0.0},
    "granitemoeshared": {"num_experts": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-6,
                         "attention_bias": False, "shared_intermediate_size": 0, "hidden_act": "silu"},
    "flex_olmo": {"num_experts": 7, "num_experts_per_tok": 5, "rms_norm_eps": 1e-6, "norm_topk_prob": False,
                  "attention_bias": False, "max_position_embeddings": 4096, "hidden_act": "silu",
                  "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "param2moe": {**_GLM_DERIVED, "num_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
                  "n_shared_experts": 2, "num_key_value_heads": 8, "intermediate_size": 9216,
                  "tie_word_embeddings": True, "max_position_embeddings": 32768,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 1.0}},
    "sarvam_moe": {**_GLM_DERIVED, "num_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1024,
                   "n_shared_experts": 1, "num_key_value_heads": 4, "intermediate_size": 8192,
                   "tie_word_embeddings": False, "max_position_embeddings": 131072,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 8000000.0, "partial_rotary_factor": 1.0}},
    "ernie4_5_vl_moe_text": {"num_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": [1536, 512],
                             "moe_num_shared_experts": 2, "moe_norm_min": 1e-12, "num_key_value_heads": 4,
                             "rms_norm_eps": 1e-5, "rope_theta": 5e5, "tie_word_embeddings": True, "use_bias": False,
                             "hidden_act": "silu", "max_position_embeddings": 131072},
}
#: the families whose every layer attends to the whole causal past (no window)
_FULL = ("qwen3_vl_moe_text", "glm4v_moe_text", "olmoe", "glm4_moe", "minimax_m2", "ernie4_5_moe", "hunyuan_v1_moe", "solar_open", "hy_v3", "granitemoe",
         "granitemoeshared", "flex_olmo", "param2moe", "sarvam_moe", "ernie4_5_vl_moe_text")
TYPES = ("full_attention", "sliding_attention")
#: the families whose windows follow ``layer_types`` (or their own default rule of layer kinds)
_BY_TYPE = ("dots1", "exaone_moe", "afmoe", "mellum", "flint", "kolibri1")
#: AFMoE's four RMSNorms per layer (before/after the attention, before/after the MLP)
SANDWICH = (("attn_norm", "input_layernorm"), ("attn_out_norm", "post_attention_layernorm"),
            ("ffn_norm", "pre_mlp_layernorm"), ("ffn_out_norm", "post_mlp_layernorm"))
#: GLM-4's four RMSNorms per layer (Kolibri-1)
GLM4_NORMS = (("attn_norm", "input_layernorm"), ("attn_out_norm", "post_self_attn_layernorm"),
              ("ffn_norm", "post_attention_layernorm"), ("ffn_out_norm", "post_mlp_layernorm"))
#: the blocks' ``sublayer_norm`` by (four norms a layer: AFMoE, Kolibri-1; OLMo 2's output norms: FlexOlmo)
#: the types transformers builds with GLM-4.5's classes, whose MTP layers (``layers.{j >= depth}``) ``use_mtp`` reads
_GLM_MTP = ("glm4_moe", "param2moe", "sarvam_moe")
_SUBLAYER_NORM = {(False, False): "input", (True, False): "both", (False, True): "output"}
#: OLMo 2's RMSNorms on the sub-layer outputs (FlexOlmo)
OLMO2_NORMS = (("attn_out_norm", "post_attention_layernorm"), ("ffn_out_norm", "post_feedforward_layernorm"))
#: Mistral's saved names of Mixtral's MoE (``block_sparse_moe``, experts ``w1/w3/w2``)
_SAVED = tuple((re.compile(p), r) for p, r in (
    (r"\.block_sparse_moe\.", ".mlp."), (r"(\.experts\.\d+\.)w1\.", r"\1gate_proj."),
    (r"(\.experts\.\d+\.)w3\.", r"\1up_proj."), (r"(\.experts\.\d+\.)w2\.", r"\1down_proj.")))
#: a released ERNIE-4.5-VL expert's key and index (``layers.3.mlp.experts.70.up_proj.weight``)
_ERNIE_VL_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
#: Kolibri-1's saved names (its original checkpoints'): the post-norms and the expert-choice bias
_SAVED_KOLIBRI = _SAVED + tuple((re.compile(p), r) for p, r in (
    (r"\.post_attn_norm\.", ".post_self_attn_layernorm."), (r"\.post_ffn_norm\.", ".post_mlp_layernorm."),
    (r"\.moe\.router\.expert_bias$", ".mlp.gate.e_score_correction_bias")))
#: Param2-MoE's / Sarvam-MoE's saved names (their original checkpoints', Ling's): the attention's
#: (q/k/v fused by rows in ``query_key_value``, split by :func:`_split_fused_qkv`), the embedding, the choice bias
_SAVED_LING = _SAVED + tuple((re.compile(p), r) for p, r in (
    (r"(^|\.)word_embeddings\.", r"\1embed_tokens."), (r"\.attention\.", ".self_attn."),
    (r"\.self_attn\.dense\.", ".self_attn.o_proj."), (r"\.self_attn\.query_layernorm\.", ".self_attn.q_norm."),
    (r"\.self_attn\.key_layernorm\.", ".self_attn.k_norm."), (r"\.mlp\.gate\.expert_bias$", ".mlp.gate.e_score_correction_bias")))
#: the saved-name tables by ``model_type`` (the others: :data:`_SAVED`)
_SAVED_BY_TYPE = {"kolibri1": _SAVED_KOLIBRI, "kolibri1_1": _SAVED_KOLIBRI, "param2moe": _SAVED_LING, "sarvam_moe": _SAVED_LING}


def sparse_layers(hf: HFConfig, depth: int) -> list[bool]:
    """Which layers have the MoE: EXAONE-MoE's / HY-V3's ``mlp_layer_types`` (``"dense"`` /
    ``"sparse"``) when given; else all of them (Mixtral, OLMoE, MiniMax-M2, Solar-Open, Hunyuan),
    those from ``first_k_dense_replace`` (GLM-4.5, dots.llm1) / ``num_dense_layers`` (AFMoE) /
    ``moe_layer_start_index`` to ``moe_layer_end_index`` (ERNIE-4.5) on, Qwen-MoE's rule (not in
    ``mlp_only_layers``, ``(i + 1) % decoder_sparse_step == 0``; ERNIE's ``moe_layer_interval``), and
    ``num_experts > 0``."""
    types = hf.get("mlp_layer_types", None, list)
    if types is not None:
        if len(types) != depth:
            raise CheckpointFormatError(f"{hf.source}: mlp_layer_types has {len(types)} entries for {depth} layers")
        for t in types:
            if t not in ("dense", "sparse"):
                raise hf.unsupported(f"mlp_layer_types entry {t!r} (supported: 'dense', 'sparse')")
        return [t == "sparse" for t in types]
    first = hf.first(("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"), 0)
    last = hf.get("moe_layer_end_index", -1)
    last = depth - 1 if last == -1 else last
    step = hf.first(("decoder_sparse_step", "moe_layer_interval"), 1)
    dense = set(hf.get("mlp_only_layers", None, list) or [])
    if step < 1:
        key = "decoder_sparse_step" if hf.has("decoder_sparse_step") else "moe_layer_interval"
        raise hf.unsupported(f"{key}={step} (expected an int >= 1)")
    experts = hf.first(("num_experts", "num_local_experts"), 0) or 0
    return [experts > 0 and first <= i <= last and i not in dense and (i + 1) % step == 0 for i in range(depth)]


def layer_kinds(hf: HFConfig, model_type: str, depth: int) -> list[str]:
    """Each layer's attention kind (``"sliding_attention"`` / ``"full_attention"``) of the families
    that name them: ``layer_types`` when given, else dots.llm1's rule (sliding from
    ``max_window_layers`` on, when ``sliding_window`` is set), EXAONE-MoE's (full every
    ``sliding_window_pattern``-th layer; none without ``sliding_window``), AFMoE's (full every
    ``global_attn_every_n_layers``-th), Flint's (full on layers 0, 1, every ``i % 4 == 1`` and the
    last), Kolibri-1's (full every fifth); full everywhere for the other families (Mellum without ``layer_types``)."""
    if hf.has("layer_types") and model_type in _BY_TYPE:
        return parts.layer_types(hf, depth, TYPES)
    if model_type == "flint":  # full on the first two, every fourth from 1 and the last (modular 98-102)
        return [TYPES[not (i < 2 or i % 4 == 1 or i == depth - 1)] for i in range(depth)]
    if model_type == "kolibri1":  # full every fifth layer (modular 89-93)
        return [TYPES[(i + 1) % 5 != 0] for i in range(depth)]
    window = hf.get("sliding_window", None)
    if model_type == "dots1":
        first = hf.get("max_window_layers", 62)
        return [TYPES[window is not None and i >= first] for i in range(depth)]
    if model_type == "exaone_moe" and window is not None:
        pattern = hf.raw("sliding_window_pattern", 4)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise hf.unsupported(f"sliding_window_pattern={pattern!r} without layer_types (supported: an int >= 1)")
        return [TYPES[(i + 1) % pattern != 0] for i in range(depth)]
    if model_type == "afmoe":
        every = hf.get("global_attn_every_n_layers", 4)
        return [TYPES[(i + 1) % every != 0] for i in range(depth)]
    return [TYPES[0]] * depth


def window_of_layers(hf: HFConfig, model_type: str, depth: int) -> list[int | None]:
    """Each layer's left window (``sliding_window - 1``) or ``None``, as each family's config
    post-processing decides it (see the module docstring)."""
    window = hf.get("sliding_window", None)
    if model_type in _FULL or not window:
        return [None] * depth
    if model_type in ("mixtral", "phimoe"):
        return [window - 1] * depth
    if model_type in _BY_TYPE:
        return parts.sliding_windows(hf, layer_kinds(hf, model_type, depth))
    if not hf.get("use_sliding_window", False, bool):
        return [None] * depth
    if model_type == "qwen3_moe":
        return [window - 1] * depth
    first = hf.get("max_window_layers", 28)
    kinds = hf.get("layer_types", None, list) or [
        "sliding_attention" if (i + 1) % 2 and i < first else "full_attention" for i in range(depth)]
    kinds = parts.layer_types(hf.with_defaults({"layer_types": kinds}), depth, TYPES)
    return parts.sliding_windows(hf, kinds)


def _rotates(hf: HFConfig, variant: Variant, kinds: list[str]) -> list[bool]:
    """Which layers rotate: all, or the sliding ones only (AFMoE; EXAONE-MoE when it has a
    ``sliding_window``): the full layers are NoPE."""
    if variant.rope_layers == "all" or (variant.rope_layers == "sliding_if_window" and not hf.has("sliding_window")):
        return [True] * len(kinds)
    return [k == "sliding_attention" for k in kinds]


def _read(hf: HFConfig) -> tuple[HFConfig, str]:
    """``(hf with its family's defaults, model_type)``, the options it cannot reproduce refused."""
    model_type = str(hf.raw("model_type"))
    if model_type not in VARIANTS:
        raise ValueError(f"sparse_moe: model_type must be one of {list(VARIANTS)}, got {model_type!r}")
    if isinstance(hf.raw("num_experts"), list):  # Hunyuan's original per-layer expert counts
        raise hf.unsupported(f"num_experts={hf.raw('num_experts')!r} (a list per layer; supported: one int)")
    aliased = {key: hf.raw(alias) for alias, key in VARIANTS[model_type].aliases if hf.has(alias) and not hf.has(key)}
    hf = hf.with_defaults(aliased) if aliased else hf
    hf = _dbrx_canonical(hf) if model_type == "dbrx" else hf
    defaults = dict(DEFAULTS[model_type])  # the expert count under either name (Qwen3-MoE saves num_local_experts)
    defaults["num_experts"] = hf.first(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
                                       defaults["num_experts"])
    topk = hf.raw("moe_topk")  # Hunyuan's: one int, or one per layer (read by _top_ks)
    defaults["num_experts_per_tok"] = hf.first(("num_experts_per_tok", "moe_k"),
                                               topk if isinstance(topk, int) else defaults.get("num_experts_per_tok"))
    scaling = VARIANTS[model_type].scaling
    if scaling != "routed_scaling_factor":  # AFMoE's route_scale, HY-V3's router_scaling_factor
        defaults["routed_scaling_factor"] = hf.get(scaling, defaults[scaling], float)
    hf = hf.with_defaults(defaults)
    phimoe = VARIANTS[model_type].routing == "sparsemixer"  # its router_jitter_noise is the sparsemixer's epsilon
    parts.unsupported_keys(hf, {"router_jitter_noise": lambda v: phimoe or not v, "clip_qkv": lambda v: v is None,
                                "pretraining_tp": lambda v: v in (None, 1), "use_bias": lambda v: not v})
    if phimoe:
        _refuse_phimoe(hf)
    if VARIANTS[model_type].granite:
        parts.unsupported_keys(hf, granite.CHECKS)
        granite.refuse_partial_rotary(hf)
    if model_type == "ernie4_5_vl_moe_text":
        hf = _ernie_vl_text(hf)
    return hf, model_type


def _ernie_vl_text(hf: HFConfig) -> HFConfig:
    """ERNIE-4.5-VL's text config read as ERNIE-4.5-MoE's on text-only input: the text experts' width
    (``moe_intermediate_size`` is ``[text, vision]``; the shared experts are ``moe_num_shared_experts``
    times the text width), transformers' default ``mlp_layer_types`` (the first layer dense); its
    multimodal RoPE (``mrope_section [h, w, t]`` of the rotated pairs, the ``h`` / ``w`` frequencies
    pre-permuted and re-interleaved per call) is ERNIE's 1-D rotation of adjacent pairs when the three
    position streams are equal, for every section transformers can build (``h == w``, ``h + w + t ==
    head_dim / 2``): others refused by name."""
    widths = hf.raw("moe_intermediate_size")  # an int: the text width already read (build after convert)
    widths = [widths, widths] if isinstance(widths, int) and not isinstance(widths, bool) else widths
    if not (isinstance(widths, list) and len(widths) == 2 and all(isinstance(w, int) and w > 0 for w in widths)):
        raise hf.unsupported(f"moe_intermediate_size={widths!r} (supported: [text width, vision width], two ints)")
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    section = parts.rope_params(hf).get("mrope_section", [22, 22, 20])
    half = hf.get("head_dim", C // H) // 2
    if not (isinstance(section, list) and len(section) == 3 and section[0] == section[1] and sum(section) == half):
        raise hf.unsupported(f"mrope_section={section!r} (supported: [h, h, t] with h + h + t == head_dim / 2 "
                             f"== {half}, the sections transformers' ERNIE-4.5-VL rotary can build)")
    data = {**hf.data, "moe_intermediate_size": widths[0]}
    data.setdefault("mlp_layer_types", ["dense"] + ["sparse"] * (depth - 1))
    return HFConfig(data, hf.source, hf.arch)


def _ernie_vl_text_experts(sd: dict[str, Tensor], hf: HFConfig) -> dict[str, Tensor]:
    """``sd`` with ERNIE-4.5-VL's text experts in ERNIE-4.5-MoE's names: transformers' in-memory
    ``mlp.text_moe.*`` as ``mlp.*``; the released layout (``conversion_mapping.py``: ``mlp.gate.weight
    [C, E]`` transposed, ``mlp.moe_statics.e_score_correction_bias [2, E]`` rows text / vision, experts
    ``0 .. E-1`` text and ``E .. 2E-1`` vision) as the text half, ``[E, C]`` and ``[1, E]``. The vision
    experts (``mlp.vision_moe.*``, ``mlp.gate.weight_1``, experts from ``E`` on) are left out: they act on
    image and video tokens only (the wrapper drops them first, naming them; the text model alone: a warning)."""
    E = hf.req("num_experts")
    out: dict[str, Tensor] = {}
    vision = 0
    for key, t in sd.items():
        expert = _ERNIE_VL_EXPERT.search(key)
        if ".mlp.vision_moe." in key or key.endswith(".mlp.gate.weight_1") or (expert and int(expert[1]) >= E):
            vision += 1
            continue
        if ".mlp.text_moe." in key:
            out[key.replace(".mlp.text_moe.", ".mlp.")] = t
        elif key.endswith(".mlp.gate.weight"):
            out[key] = t.transpose(0, 1)
        elif key.endswith(".mlp.moe_statics.e_score_correction_bias"):
            out[key] = t[:1]
        else:
            out[key] = t
    if vision:
        warnings.warn(f"{hf.source}: ERNIE-4.5-VL's text decoder is converted; its {vision} tensors of vision experts "
                      "(layers.*.mlp), which act on image and video tokens only, are dropped", stacklevel=4)
    return out


def _refuse_phimoe(hf: HFConfig) -> None:
    """PhiMoE's options attnzoo does not reproduce, by name (module docstring)."""
    rope_type = parts.rope_params(hf).get("rope_type", "default")
    if rope_type != "default":
        raise hf.unsupported(f"rope_type={rope_type!r} (PhiMoE switches short_mscale / long_mscale by the longest "
                             f"position of each call; supported: 'default')")
    parts.unsupported_keys(hf, {"num_experts_per_tok": lambda v: v == 2, "input_jitter_noise": lambda v: not v})


def _rotary(hf: HFConfig, variant: Variant, head_dim: int, kind: str | None = None) -> Any:
    """The rotary embedding, on the first ``rotary_dim`` channels of a head (MiniMax-M2's key) or
    ``partial_rotary_factor`` of them (GLM-4.5: 0.5 by default); ERNIE-4.5's on adjacent pairs;
    Hunyuan's ``alpha`` (``rope_type="dynamic"``) stretches the base to ``theta * alpha ** (D / (D - 2))``;
    ``kind``: Mellum's ``rope_parameters[kind]`` of one layer kind."""
    params = parts.rope_params(hf, kind)
    if variant.rope_by_kind and params.get("partial_rotary_factor", 1.0) != 1.0:
        raise hf.unsupported(f"partial_rotary_factor={params['partial_rotary_factor']!r} for {kind} (Mellum rotates "
                             f"the whole head whatever it says; supported: 1.0)")
    if params.get("alpha") is not None and params.get("rope_type", params.get("type")) == "dynamic":
        D = hf.get("head_dim", head_dim)
        return RotaryEmbedding(D, base=float(params["rope_theta"]) * float(params["alpha"]) ** (D / (D - 2)))
    if variant.interleaved:
        if params.get("rope_type", "default") != "default":
            raise hf.unsupported(f"rope_type={params.get('rope_type')!r} with ERNIE's interleaved RoPE "
                                 f"(supported: 'default')")
        return RotaryEmbedding(head_dim, base=float(params["rope_theta"]), interleaved=True)
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5 if hf.raw("model_type") in
                                                         ("glm4_moe", "glm4v_moe_text") else 1.0, float))
    rot = hf.get("rotary_dim", int(head_dim * factor))
    return parts.rotary(hf, params, head_dim, rotary_dim=rot if rot != head_dim else None)


def _moe(hf: HFConfig, variant: Variant, kw: dict[str, Any]) -> Any:
    """The factory of a sparse layer's :class:`~attnzoo.nn.moe.MixtureOfExperts` (SwiGLU experts only)."""
    if hf.get("hidden_act", "silu", str) not in ("silu", "swish"):
        raise hf.unsupported(f"hidden_act={hf.raw('hidden_act')!r} in the experts (supported: 'silu')")
    if variant.routing == "deepseek":  # HY-V3's shared experts carry mlp_bias
        shared = functools.partial(FeedForward, activation="swiglu", bias=hf.get("mlp_bias", False, bool), **kw)
        return functools.partial(deepseek_moe, hf, shared_expert=shared, keep_router_float32=variant.float32_router,
                                 **kw)
    if variant.routing == "granite":  # GraniteMoeShared: its always-on shared_mlp of shared_intermediate_size
        width = hf.get("shared_intermediate_size", 0)
        return granite.experts_factory(hf, parts.gated_mlp(hf.req("hidden_size"), width, "swiglu", **kw) if width else None,
                               **kw)
    if variant.routing == "sparsemixer":
        return functools.partial(SparseMixerMoE, hf.req("hidden_size"), hf.req("intermediate_size"),
                                 hf.req("num_experts"), eps=hf.req("router_jitter_noise", float), **kw)
    if variant.routing in ("ernie", "hunyuan"):
        return functools.partial(_float32_moe, hf, variant.routing == "ernie", **kw)
    if variant.routing == "sigmoid_shared":
        return functools.partial(_shared_sigmoid_moe, hf, **kw)
    if variant.routing == "kolibri":
        return functools.partial(_kolibri_moe, hf, **kw)
    if variant.routing == "cohere":
        return functools.partial(_cohere_moe, hf, **kw)
    if variant.routing == "sigmoid":
        routing = Routing("sigmoid_topk", norm_topk_prob=True, norm_eps=0.0)
        return functools.partial(MixtureOfExperts, hf.req("hidden_size"), hf.req(variant.width), hf.req("num_experts"),
                                 hf.req("num_experts_per_tok"), routing=routing, **kw)
    view = hf.with_defaults({"moe_intermediate_size": hf.req(variant.width), "norm_topk_prob": variant.renorm,
                             "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 0)
                             if variant.shared else 0})
    return functools.partial(moe_from_config, view, "stacked", **kw)


def _shared_sigmoid_moe(hf: HFConfig, *, device: Any = None, dtype: Any = None) -> MixtureOfExperts:
    """Flint's MoE (modular 116-147): the top ``num_experts_per_tok`` of ``sigmoid(logits)`` (no
    choice bias), renormalised to sum 1 (no epsilon) when ``norm_topk_prob``, plus an always-on
    (ungated) SwiGLU shared expert of ``shared_expert_intermediate_size``."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    C = hf.req("hidden_size")
    routing = Routing("sigmoid_topk", norm_topk_prob=hf.get("norm_topk_prob", True, bool), norm_eps=0.0)
    shared = FeedForward(C, hf.req("shared_expert_intermediate_size"), "swiglu", bias=False, **kw)
    return MixtureOfExperts(C, hf.req("moe_intermediate_size"), hf.req("num_experts"), hf.req("num_experts_per_tok"),
                            routing=routing, shared_expert=shared, keep_router_float32=True, **kw)


def _kolibri_moe(hf: HFConfig, *, device: Any = None, dtype: Any = None) -> LogitBiasSigmoidMoE:
    """Kolibri-1's MoE (modular 140-150): :class:`LogitBiasSigmoidMoE` plus an always-on (ungated)
    SwiGLU shared expert of ``shared_expert_intermediate_size``, on every layer."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    C = hf.req("hidden_size")
    shared = FeedForward(C, hf.req("shared_expert_intermediate_size"), "swiglu", bias=False, **kw)
    return LogitBiasSigmoidMoE(C, hf.req("moe_intermediate_size"), hf.req("num_experts"), hf.req("num_experts_per_tok"),
                               norm_topk_prob=hf.get("norm_topk_prob", False, bool), shared_expert=shared, **kw)


def _float32_moe(hf: HFConfig, ernie: bool, *, device: Any = None, dtype: Any = None) -> Float32RouterMoE:
    """ERNIE-4.5's MoE (experts of ``moe_intermediate_size``, the choice bias, ``moe_norm_min``,
    ``moe_num_shared_experts`` ungated shared experts) or Hunyuan's (experts and one ungated
    shared MLP of ``intermediate_size``)."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    C, E, k = hf.req("hidden_size"), hf.req("num_experts"), hf.req("num_experts_per_tok")
    if not ernie:
        F_ = hf.req("intermediate_size")
        return Float32RouterMoE(C, F_, E, k, choice_bias=False, norm_min=0.0,
                                shared_expert=FeedForward(C, F_, "swiglu", bias=False, **kw), **kw)
    F_, n = hf.req("moe_intermediate_size"), hf.get("moe_num_shared_experts", 0)
    shared = FeedForward(C, F_ * n, "swiglu", bias=False, **kw) if n else None
    return Float32RouterMoE(C, F_, E, k, choice_bias=True, norm_min=hf.get("moe_norm_min", 1e-12, float),
                            shared_expert=shared, **kw)


def _qk_norm(hf: HFConfig, variant: Variant) -> str | None:
    if variant.qk_norm == "head_if_flag":
        return "head" if hf.get("use_qk_norm", False, bool) else None
    return variant.qk_norm


def _attention(hf: HFConfig, variant: Variant, window: int | None, rope: Any, kw: dict[str, Any]) -> Any:
    """The factory of one layer's attention (``rope=None``: a NoPE layer)."""
    qk_norm = _qk_norm(hf, variant)
    if qk_norm == "head_after_rope":
        C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
        return functools.partial(
            build_softmax, PostRopeNormAttention, C, H, num_kv_heads=hf.get("num_key_value_heads", H),
            head_dim=hf.get("head_dim", C // H), bias=hf.get("attention_bias", False, bool), causal=True,
            window=window, rope=rope, dropout=hf.get("attention_dropout", 0.0, float), qk_norm="head",
            qk_norm_eps=hf.get("rms_norm_eps", 1e-6, float), **kw)
    attn_cfg = hf.with_defaults({"attention_bias": _qkv_bias(hf, variant)}) if variant.qkv_bias else hf
    return parts.attention_factory(attn_cfg, window=window, rope=rope, qk_norm=qk_norm,
                                   output_gate="element" if variant.sandwich else None, sinks=variant.sinks,
                                   scale=granite.multiplier(hf, "attention_multiplier") if variant.granite else None, **kw)


def build_sparse_moe(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                     dtype: Any = None, mtp: int = 0) -> DecoderLM:
    """The decoder of a sparse-MoE config of the LLaMA line (random weights; the family is the
    config's ``model_type``; see the module docstring), with ``mtp`` multi-token-prediction depths
    (GLM-4.5's: each a full-attention MoE layer, as transformers' ``get_mtp_config`` builds them)."""
    hf, model_type = _read(hf)
    variant = VARIANTS[model_type]
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    if variant.indexed:
        return _build_kolibri1_1(hf, head_size, kw)
    if variant.parallel:
        return _build_cohere2_moe(hf, head_size, kw)
    if variant.routing == "dbrx":
        return _build_dbrx(hf, head_size, kw)
    kinds = layer_kinds(hf, model_type, depth)
    ropes = ({k: _rotary(hf, variant, hf.get("head_dim", C // H), k) for k in set(kinds)} if variant.rope_by_kind
             else dict.fromkeys(kinds, _rotary(hf, variant, hf.get("head_dim", C // H))))
    sparse = sparse_layers(hf, depth)
    moes = [_moe(HFConfig({**hf.data, "num_experts_per_tok": k}, hf.source, hf.arch) if k else hf, variant, kw)
            for k in _top_ks(hf, depth)]
    act = hf.activation("hidden_act", parts.GATED, "silu")
    dense = None if all(sparse) else parts.gated_mlp(C, hf.req("intermediate_size"), act,
                                                     bias=hf.get("mlp_bias", False, bool), **kw)
    rotates = _rotates(hf, variant, kinds)
    norm = functools.partial(nn.LayerNorm, C, eps=eps, **kw) if variant.layer_norm else parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, _attention(hf, variant, w, ropes[k] if r else None, kw), moe if s else dense, norm,
                          sublayer_norm=_SUBLAYER_NORM[(variant.sandwich or variant.glm4_norms, variant.olmo2_norms)])
              for w, r, s, moe, k in zip(window_of_layers(hf, model_type, depth), rotates, sparse, moes, kinds,
                                         strict=True)]
    scale = C ** 0.5 if hf.get("mup_enabled", False, bool) else None  # AFMoE's muP embedding scale
    scale = granite.embed_scale(hf) if variant.granite else scale
    if variant.layer_norm:
        return _layer_norm_decoder(hf, blocks, norm, head_size, kw)
    predictor = _mtp_predictor(hf, model_type, mtp, (sparse[0], dense, norm), kw) if mtp else None
    model = parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embed_scale=scale, mtp=predictor, **kw)
    if predictor is not None and model_type == "ernie4_5_moe":  # its MTP post norm is the final norm (shared)
        predictor.layers[0].post_norm = model.norm
    if variant.sandwich:  # AFMoE's OLMo-2 norms: the weight applied in float32, kept in float32
        parts.float32_scale_norms(model, keep_float32=True)
    elif variant.float32_norms:  # Flint's GPT-OSS RMSNorms (the blocks' and the final one; the QK norms round first)
        parts.float32_scale_norms(model)
    return model


def _mtp_predictor(hf: HFConfig, model_type: str, mtp: int, layer0: tuple[bool, Any, Any],
                   kw: dict[str, Any]) -> MultiTokenPredictor:
    """The ``mtp`` multi-token-prediction layers transformers builds (``get_mtp_config``): each a
    decoder layer of the config with ``first_k_dense_replace`` 0 (GLM-4.5's: full attention and a
    MoE), ERNIE-4.5's of layer 0's kind, Mellum's of ``mtp_layer_types`` / ``mtp_mlp_layer_types``
    (default: a sliding-window layer with a MoE). ``layer0``: (layer 0 sparse, the dense MLP factory
    or ``None``, the norm factory)."""
    variant, C = VARIANTS[model_type], hf.req("hidden_size")
    kind = (hf.get("mtp_layer_types", None, list) or ["sliding_attention"])[0] if model_type == "mellum" else TYPES[0]
    sparse = (hf.get("mtp_mlp_layer_types", None, list) or ["sparse"])[0] == "sparse" if model_type == "mellum" \
        else model_type in _GLM_MTP or layer0[0]
    dense = layer0[1] or parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"),
                                         bias=hf.get("mlp_bias", False, bool), **kw)
    window = parts.sliding_windows(hf, [kind])[0] if model_type == "mellum" else None
    rope = _rotary(hf, variant, hf.get("head_dim", C // hf.req("num_attention_heads")), kind if variant.rope_by_kind else None)
    return MultiTokenPredictor([MTPLayer(C, parts.block(
        C, _attention(hf, variant, window, rope, kw), _moe(hf, variant, kw) if sparse else dense, layer0[2],
        sublayer_norm=_SUBLAYER_NORM[(variant.glm4_norms, False)]), layer0[2], **kw) for _ in range(mtp)])


def _layer_norm_decoder(hf: HFConfig, blocks: list[nn.Module], norm: Any, head_size: int | None,
                        kw: dict[str, Any], eps_key: str = "rms_norm_eps") -> DecoderLM:
    """PhiMoE's decoder: the final LayerNorm ``norm()`` (eps ``eps_key``) and, for an LM head, the bias
    ``lm_head_bias``; Cohere2-MoE's (``norm()`` a LayerNorm without bias, or an RMSNorm)."""
    V, C = hf.req("vocab_size"), hf.req("hidden_size")
    cfg = DecoderConfig(V, C, len(blocks), hf.req("num_attention_heads"), pos="rope",
                        norm="layer" if isinstance(norm(), nn.LayerNorm) else "rms", norm_eps=hf.req(eps_key, float),
                        tie_embeddings=hf.get("tie_word_embeddings", False, bool), max_seq_len=parts.max_positions(hf))
    head = (LMHead(C, V, bias=True, **kw) if head_size is None and hf.get("lm_head_bias", False, bool)
            else head_for(C, V, head_size, **kw))
    return DecoderLM(config=cfg, parts=DecoderParts(blocks=blocks, norm=norm(), head=head), **kw)


def _top_ks(hf: HFConfig, depth: int) -> list[int | None]:
    """Each layer's own top-k where Hunyuan's ``moe_topk`` is a list (one per layer; its gate reads
    ``moe_topk[layer_idx]``, modeling 230-231), else ``None`` (the config's one top-k)."""
    topk = hf.raw("moe_topk")
    if not isinstance(topk, list):
        return [None] * depth
    if len(topk) != depth or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in topk):
        raise CheckpointFormatError(f"{hf.source}: moe_topk must be one int or one int >= 1 per layer "
                                    f"({depth}), got {topk!r}")
    return list(topk)


def _qkv_bias(hf: HFConfig, variant: Variant) -> bool:
    """Qwen2-MoE's ``qkv_bias`` (default True), GLM-4.5's / Solar-Open's ``attention_bias``: biases
    on q, k and v, none on ``o_proj``."""
    return variant.qkv_bias is not None and hf.get(variant.qkv_bias, True, bool)


def _put_qkv_biased(plan: Plan, ours: str, theirs: str, dim: int) -> None:
    """Qwen2-MoE's / GLM-4.5's attention: q/k/v with biases, ``o_proj`` without (the module's output
    bias is 0)."""
    load_qkv_into(plan, ours, tuple(f"{theirs}{n}_proj.weight" for n in "qkv"),
                  tuple(f"{theirs}{n}_proj.bias" for n in "qkv"), True)
    plan.put(f"{ours}.out_proj.weight", f"{theirs}o_proj.weight")
    plan.put_tensor(f"{ours}.out_proj.bias", torch.zeros(dim), "zeros (the o_proj has no bias)")


def _put_attention(plan: Plan, ours: str, theirs: str, hf: HFConfig, variant: Variant) -> None:
    """A layer's attention at ``ours`` (``"blocks.3.attn"``) from ``theirs`` (``"layers.3.self_attn."``):
    q/k/v(/o) and their biases, the QK norms (Hunyuan's ``query_layernorm``/``key_layernorm``),
    AFMoE's output gate ``gate_proj``."""
    qk_norm = _qk_norm(hf, variant)
    if _qkv_bias(hf, variant):
        _put_qkv_biased(plan, ours, theirs, hf.req("hidden_size"))
    else:
        parts.put_attention(plan, ours, theirs, bias=hf.get("attention_bias", False, bool))
    names = ("query_layernorm", "key_layernorm") if qk_norm == "head_after_rope" else ("q_norm", "k_norm")
    if qk_norm is not None:
        for n, name in zip(("q_norm", "k_norm"), names, strict=True):
            plan.put(f"{ours}.frontier.{n}_weight", f"{theirs}{name}.weight")
    if variant.sandwich:
        plan.put(f"{ours}.frontier.gate_proj.weight", f"{theirs}gate_proj.weight")
    if variant.sinks:  # Flint's saved folders name them softmax_offset
        plan.put(f"{ours}.frontier.sinks", next((f"{theirs}{k}" for k in ("sinks", "softmax_offset")
                                                 if plan.src.has(f"{theirs}{k}")), f"{theirs}sinks"))


def _put_keyed_moe(plan: Plan, ours: str, theirs: str, variant: Variant, moe: Any, bias: bool) -> None:
    """Batch 2's MoE blocks (names in ``MOE_KEYS``): the router, the expert-choice bias (ERNIE's
    ``[1, E]`` flattened), the stacked experts (or one tensor per expert, as saved folders hold
    them), the shared experts (``bias``: HY-V3's ``mlp_bias``)."""
    router, choice, shared = (next((k for k in names if plan.src.has(f"{theirs}{k}{tail}")), names[0]) if names else None
                              for names, tail in zip(MOE_KEYS[variant.keys or "gate"], ("", "", ".down_proj.weight"),
                                                     strict=True))
    plan.put(f"{ours}router.weight", f"{theirs}{router}")
    if choice is not None:
        plan.put(f"{ours}score_bias", f"{theirs}{choice}", lambda t: t.reshape(-1))
    if plan.src.has(f"{theirs}experts.0.gate_proj.weight"):
        put_per_expert(plan, ours, theirs)
    else:
        key = f"{theirs}experts.gate_up_proj"
        plan.put(f"{ours}gate_proj", key, lambda w: w[:, : w.shape[1] // 2].contiguous())
        plan.put(f"{ours}up_proj", key, lambda w: w[:, w.shape[1] // 2:].contiguous())
        plan.put(f"{ours}down_proj", f"{theirs}experts.down_proj")
    if moe.shared_expert is not None:
        plan.put_pairs(f"{ours}shared_expert.", f"{theirs}{shared}.",
                       [(n, n) for n in ("gate_proj", "up_proj", "down_proj")], bias=bias)


def _put_ffn(plan: Plan, ours: str, theirs: str, variant: Variant, ffn: Any, hf: HFConfig) -> None:
    bias = hf.get("mlp_bias", False, bool)
    if variant.routing == "sparsemixer":  # PhiMoE: router.weight (a saved folder: gate.weight, per expert)
        plan.put(f"{ours}router.weight", next((f"{theirs}{k}" for k in ("router.weight", "gate.weight")
                                                if plan.src.has(f"{theirs}{k}")), f"{theirs}router.weight"))
        if plan.src.has(f"{theirs}experts.0.gate_proj.weight"):
            put_per_expert(plan, ours, theirs)
        else:
            put_stacked_experts(plan, ours, theirs)
    elif not isinstance(ffn, MixtureOfExperts):
        parts.put_mlp(plan, ours, theirs, bias=bias)
    elif variant.keys is not None:
        _put_keyed_moe(plan, ours, theirs, variant, ffn, bias)
    elif variant.routing == "deepseek":
        put_moe(plan, ours, theirs, "deepseek")
    else:
        put_moe(plan, ours, theirs, "stacked", shared=variant.shared or variant.routing == "sigmoid_shared",
                shared_gate=variant.shared)
        if variant.routing == "sigmoid_shared":  # Flint: no expert-choice bias
            plan.put_tensor(f"{ours}score_bias", torch.zeros(ffn.num_experts), "zeros (Flint's router has no bias)")
        if variant.routing == "sigmoid":
            plan.put(f"{ours}score_bias", f"{theirs}e_score_correction_bias")


def _put_mtp(plan: Plan, ours: str, k: int, hf: HFConfig, variant: Variant, ffn: Any) -> None:
    """Multi-token-prediction layer ``k``: GLM-4.5's ``layers.{num_hidden_layers + k}`` (the parts
    around the block, :func:`~attnzoo.models.families._common.put_mtp`, and a decoder layer), or
    ERNIE-4.5's ``mtp_block.{k}`` with ``mtp_emb_norm`` / ``mtp_hidden_norm`` / ``mtp_linear_proj``
    (its post norm is the model's final norm, one module: transformers' ``_keys_shared_with_mtp``), or
    Mellum's ``mtp.layers.{k}`` with ``mtp.fc`` / ``mtp.pre_fc_norm_*`` / ``mtp.norm``."""
    prefix = plan.src.prefix
    if hf.raw("model_type") == "ernie4_5_moe":
        theirs = f"mtp_block.{k}."
        plan.put_pairs(ours, "", [("enorm", f"mtp_emb_norm.{k}"), ("hnorm", f"mtp_hidden_norm.{k}"),
                                  ("eh_proj", f"mtp_linear_proj.{k}")], bias=False)
    elif hf.raw("model_type") == "mellum":  # Qwen3-Next's layout, outside the base model: mtp.*
        plan.src.prefix, theirs = "", f"mtp.layers.{k}."
        plan.put_pairs(ours, "mtp.", [("enorm", "pre_fc_norm_embedding"), ("hnorm", "pre_fc_norm_hidden"),
                                      ("eh_proj", "fc"), ("post_norm", "norm")], bias=False)
    else:
        theirs = f"layers.{hf.req('num_hidden_layers') + k}."
        parts.put_mtp(plan, ours, theirs)
    _put_attention(plan, f"{ours}block.attn", f"{theirs}self_attn.", hf, variant)
    _put_ffn(plan, f"{ours}block.ffn.", f"{theirs}mlp.", variant, ffn, hf)
    plan.put_pairs(f"{ours}block.", theirs, GLM4_NORMS if variant.glm4_norms else parts.PRE_NORMS, bias=False)
    plan.src.prefix = prefix


def convert_sparse_moe(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; Mistral's saved MoE names
    too; the multi-token-prediction layers of GLM-4.5 (``layers.{j >= depth}``), ERNIE-4.5
    (``mtp_*``) and Mellum (``mtp.*``) loaded as the model's ``mtp``, HY-V3's and EXAONE-MoE's dropped)."""
    hf, model_type = _read(hf)
    variant = VARIANTS[model_type]
    if model_type == "dbrx":
        return _convert_dbrx(hf, sd, device=device, dtype=dtype)
    # Mistral's names (GraniteMoE keeps block_sparse_moe), Kolibri-1's, Ling's
    sd = sd if variant.granite else _split_fused_qkv(saved_names(sd, _SAVED_BY_TYPE.get(model_type, _SAVED)), hf)
    depth, prefix = hf.req("num_hidden_layers"), parts.head_size_of(hf, sd)[0]
    if model_type == "qwen3_vl_moe_text":
        sd = _experts_in_memory(sd, hf)
    if model_type == "ernie4_5_vl_moe_text":
        sd = _ernie_vl_text_experts(sd, hf)
    layout = {**dict.fromkeys(_GLM_MTP, lambda k: f"{prefix}layers.{depth + k}.eh_proj.weight"),
              "ernie4_5_moe": lambda k: f"{prefix}mtp_linear_proj.{k}.weight",
              "mellum": lambda k: "mtp.fc.weight" if k == 0 else None}.get(model_type)  # Mellum: one layer
    mtp = 0 if layout is None else parts.mtp_depths(hf, sd, layout)
    mtp = min(mtp, 1) if model_type in ("ernie4_5_moe", "mellum") else mtp  # transformers' take one MTP layer
    build = functools.partial(build_sparse_moe, mtp=mtp)
    model, plan, head_size = parts.start(hf, sd, build, device=device, dtype=dtype)
    if variant.granite:
        return _convert_granite(hf, model, plan, head_size)
    if variant.indexed:
        return _convert_kolibri1_1(hf, model, plan, head_size)
    if variant.parallel:
        return _convert_cohere2_moe(hf, model, plan, head_size)
    for i, block in enumerate(model.blocks):
        o, h = f"blocks.{i}.", f"layers.{i}."
        _put_attention(plan, f"{o}attn", f"{h}self_attn.", hf, variant)
        _put_ffn(plan, f"{o}ffn.", f"{h}mlp.", variant, block.ffn, hf)
        norms = (SANDWICH if variant.sandwich else GLM4_NORMS if variant.glm4_norms else
                 OLMO2_NORMS if variant.olmo2_norms else parts.PRE_NORMS)
        plan.put_pairs(o, h, norms, bias=variant.layer_norm)
    if variant.layer_norm:  # PhiMoE: the final LayerNorm's bias, the LM head's (read here: finish reads the weight)
        plan.put("norm.bias", "norm.bias")
        if isinstance(model.lm_head, LMHead) and model.lm_head.bias is not None:
            plan.put_tensor("lm_head.bias", sd["lm_head.bias"], "lm_head.bias")
    for k in range(mtp):
        _put_mtp(plan, f"mtp.layers.{k}.", k, hf, variant, model.mtp.layers[k].block.ffn)
    ignore = parts.layers_past(sd, depth + mtp) + parts.mtp_copies(depth, mtp)
    if model_type == "exaone_moe" or (model_type in ("ernie4_5_moe", "mellum") and not mtp):
        ignore.append(r"(model\.)?mtp.*")
    elif model_type == "ernie4_5_moe":  # the MTP layers past the first
        ignore.append(r"(model\.)?mtp_\w+\.[1-9]\d*\..*")
    if model_type == "phimoe":
        ignore.append(r"lm_head\.bias")
    return parts.finish(plan, model, head_size, ignore=ignore)


def _experts_in_memory(sd: dict[str, Tensor], hf: HFConfig) -> dict[str, Tensor]:
    """``sd`` with Qwen3-VL-MoE's saved experts (``gate_up_proj [E, C, 2F]``, ``down_proj [E, F, C]``)
    transposed to transformers' in-memory layout (``[E, 2F, C]``, ``[E, C, F]``); tensors already so
    kept. The two layouts differ in ``gate_up_proj`` unless ``C == 2F`` and in ``down_proj`` unless
    ``C == F``: one of them tells."""
    C, F_ = hf.req("hidden_size"), hf.req("moe_intermediate_size")
    out = dict(sd)
    for key, t in sd.items():
        if not key.endswith("mlp.experts.gate_up_proj") or t.dim() != 3:
            continue
        down = sd.get(key[: -len("gate_up_proj")] + "down_proj")
        saved = tuple(t.shape[1:]) == (C, 2 * F_) if C != 2 * F_ else (
            down is not None and tuple(down.shape[1:]) == (F_, C))
        if saved:
            out[key] = t.transpose(1, 2)
            if down is not None:
                out[key[: -len("gate_up_proj")] + "down_proj"] = down.transpose(1, 2)
    return out


def _split_fused_qkv(sd: dict[str, Tensor], hf: HFConfig) -> dict[str, Tensor]:
    """``sd`` with every ``self_attn.query_key_value.{weight,bias}`` (Ling's saved q/k/v, rows
    ``[q; k; v]``) split into ``q_proj`` / ``k_proj`` / ``v_proj`` (in place)."""
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    D, kv = hf.get("head_dim", C // H), hf.get("num_key_value_heads", H)
    for key in [k for k in sd if ".self_attn.query_key_value." in k]:
        head, _, tail = key.rpartition("query_key_value.")
        for n, t in zip("qkv", sd.pop(key).split((H * D, kv * D, kv * D)), strict=True):
            sd[f"{head}{n}_proj.{tail}"] = t
    return sd


def _convert_granite(hf: HFConfig, model: DecoderLM, plan: Plan, head_size: int | None) -> DecoderLM:
    """GraniteMoE's weights (attention, ``block_sparse_moe`` experts, norms), ``residual_multiplier``
    folded into the out and down projections and ``1 / logits_scaling`` into the final norm."""
    bias, writes = hf.get("attention_bias", False, bool), []
    for i, block in enumerate(model.blocks):
        o, h = f"blocks.{i}.", f"layers.{i}."
        parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=bias)
        writes += granite.put_feed_forward(plan, f"{o}ffn.", h, block.ffn)  # the experts (and GraniteMoeShared's shared_mlp)
        plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
        writes += [f"{o}attn.out_proj.weight"] + ([f"{o}attn.out_proj.bias"] if bias else [])
    return granite.finish_folded(plan, model, hf, head_size, writes)


class Float32RouterMoE(MixtureOfExperts):
    """A :class:`~attnzoo.nn.moe.MixtureOfExperts` routed as ERNIE-4.5 (modular 101-124) and
    Hunyuan (modular 120-136) route: the router's logits and softmax in float32, the ``k`` experts of
    largest probability (plus ``score_bias [E]`` with ``choice_bias``: ERNIE's
    ``e_score_correction_bias``, which picks but does not weight), their probabilities divided by
    ``max(sum, norm_min)``.

    Args: as :class:`~attnzoo.nn.moe.MixtureOfExperts` (SwiGLU experts), plus ``choice_bias`` and
    ``norm_min`` (ERNIE's ``moe_norm_min``; 0 for Hunyuan's plain renormalisation).
    Shapes: ``x [..., C] -> [..., C]``."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, choice_bias: bool, norm_min: float,
                 shared_expert: nn.Module | None = None, device: Any = None, dtype: Any = None) -> None:
        super().__init__(dim, hidden, num_experts, top_k, routing=Routing("softmax_topk", norm_topk_prob=True),
                         shared_expert=shared_expert, device=device, dtype=dtype)
        self.norm_min = float(norm_min)
        if choice_bias:
            del self.score_bias
            self.register_buffer("score_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router of ``x [T, C]``: ``(weights [T, k], experts [T, k] long, logits [T, E])``."""
        wide = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(wide), self.router.weight.to(wide))  # [T, E]
        probs = torch.softmax(logits, dim=-1)
        choice = probs if self.score_bias is None else probs + self.score_bias.to(wide)
        experts = torch.topk(choice, self.top_k, dim=-1)[1]  # [T, k]
        weights = probs.gather(-1, experts)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(self.norm_min)
        return weights.to(x.dtype), experts, logits


class LogitBiasSigmoidMoE(MixtureOfExperts):
    """A :class:`~attnzoo.nn.moe.MixtureOfExperts` routed as Kolibri-1 routes (modular 115-137): the
    router's logits in float32, the ``k`` experts of largest ``logits + score_bias`` (the bias on the
    *logits*, not on the sigmoids as DeepSeek-V3's), weighted by ``sigmoid(logits)`` of those,
    renormalised to sum 1 (no epsilon) when ``norm_topk_prob``.

    Args: as :class:`~attnzoo.nn.moe.MixtureOfExperts` (SwiGLU experts), plus ``norm_topk_prob``.
    Shapes: ``x [..., C] -> [..., C]``."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, norm_topk_prob: bool,
                 shared_expert: nn.Module | None = None, device: Any = None, dtype: Any = None) -> None:
        super().__init__(dim, hidden, num_experts, top_k, routing=Routing("sigmoid_topk", norm_topk_prob=norm_topk_prob,
                                                                          norm_eps=0.0),
                         shared_expert=shared_expert, device=device, dtype=dtype)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router of ``x [T, C]``: ``(weights [T, k], experts [T, k] long, logits [T, E])``."""
        wide = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(wide), self.router.weight.to(wide))  # [T, E]
        bias = self.score_bias if self.score_bias is not None else torch.zeros((), device=x.device)
        experts = torch.topk(logits + bias.to(wide), self.top_k, dim=-1)[1]  # [T, k]
        weights = torch.sigmoid(logits.gather(-1, experts))
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts, logits


class SparseMixerMoE(MixtureOfExperts):
    """A :class:`~attnzoo.nn.moe.MixtureOfExperts` of two SwiGLU experts a token, routed by PhiMoE's
    sparsemixer (``modular_phimoe.py`` 137-255, the eval branch): with the router's logits ``s [T,
    E]``, the first expert is the top logit ``m1``, weighted by the softmax over the logits within
    ``(m1 - s) / max(|s|, m1) <= 2 eps`` of it; the second the top ``m2`` of the others, weighted by
    the softmax (the first masked out) over those within ``(m2 - s) / max(|s|, m2) <= 2 eps``.
    ``eps``: PhiMoE's ``router_jitter_noise``. Shapes: ``x [..., C] -> [..., C]``."""

    def __init__(self, dim: int, hidden: int, num_experts: int, *, eps: float, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(dim, hidden, num_experts, 2, routing=Routing("softmax_topk"), device=device, dtype=dtype)
        self.eps = float(eps)

    def _pick(self, scores: Tensor, masked: Tensor) -> tuple[Tensor, Tensor]:
        """One expert ``[T, 1]`` of ``masked [T, E]`` (``scores`` with the picked ones at ``-inf``)
        and its weight ``[T, 1]``."""
        top, index = masked.max(dim=-1, keepdim=True)  # [T, 1]
        factor = scores.abs().clamp(min=top)  # with torch.no_grad() in transformers: a mask, no gradient
        far = ((top - scores) / factor > 2 * self.eps).detach()
        gates = torch.softmax(masked.masked_fill(far, float("-inf")), dim=-1)  # [T, E]
        return gates.gather(-1, index), index

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router of ``x [T, C]``: ``(weights [T, 2], experts [T, 2] long, logits [T, E])``."""
        logits = self.router(x)  # [T, E], in x's dtype (transformers' too)
        w1, e1 = self._pick(logits, logits)
        w2, e2 = self._pick(logits, logits.scatter(-1, e1, float("-inf")))
        return torch.cat((w1, w2), dim=-1), torch.cat((e1, e2), dim=-1), logits

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sparsemixer eps={self.eps:g}"


class PostRopeNormAttention(MultiHeadAttention):
    """Hunyuan-MoE's attention (modular 60-100): the per-head q/k RMSNorms (the parts'
    ``qk_norm="head"``, ``query_layernorm``/``key_layernorm``) applied *after* the rotary embedding.

    Shapes: as :class:`~attnzoo.MultiHeadAttention` (``x [B, N, C] -> [B, N, C]``; packed
    ``[1, T, C]`` with ``cu_seqlens``)."""

    def _project_self(self, x: Tensor, positions: Tensor | None, start: int, *,
                      rotate: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``q [B, H, N, D]``, ``k, v [B, Hkv, N, D]``: rotated, then normed."""
        if not rotate:
            raise ValueError(f"{type(self).__name__}: the q/k norms follow the rotation, so it cannot hand out "
                             f"unrotated keys (a sink cache)")
        B, N, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qk_, v_ = self.qkv_proj(x).split(((H + Hkv) * D, Hkv * D), dim=-1)
        qk = self._rotate(self.split_heads(qk_), resolve_positions(positions, N, start, x.device, batch=B))
        return self.frontier.norm_q(qk[:, :H]), self.frontier.norm_k(qk[:, H:]), self.split_heads(v_)

    def _packed(self, x: Tensor, cu_seqlens: object, context: object, mask: object, cache: object,
                positions: object, return_weights: bool) -> Tensor:
        """Packed self-attention of ``x [1, T, C]`` (``cu_seqlens``): ``[1, H, T, D]`` before the merge."""
        cls = type(self).__name__
        if any(v is not None for v in (context, mask, cache, positions)) or return_weights or \
                (self.training and self.dropout):
            raise ValueError(f"{cls}: packed input (cu_seqlens) takes no context, mask, cache, positions, "
                             f"return_weights or attention dropout")
        cu = packed_cu_seqlens(cu_seqlens, x, cls)
        T = x.shape[1]
        q, k, v = self._project_self(x, packed_positions(cu, T), 0, rotate=True)
        out = attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                               causal=True, window=self.window, scale=self.scale, backend=self.backend)  # [T, H, D]
        return out.transpose(0, 1).reshape(1, self.num_heads, T, -1)


# --------------------------------------------------------------------------- DBRX
class ClippedAttention(MultiHeadAttention):
    """DBRX's attention (``DbrxAttention``, modeling 170-240): the fused ``Wqkv``'s outputs (q, k and
    v) clamped to ``[-clip, clip]`` before RoPE (``clip = None``: a plain
    :class:`~attnzoo.MultiHeadAttention`; set after building). No QK norms.

    Shapes: as :class:`~attnzoo.MultiHeadAttention` (``x [B, N, C] -> [B, N, C]``; packed ``[1, T, C]``)."""

    clip: float | None = None

    def _clamped(self, ts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return ts if self.clip is None else tuple(t.clamp(-self.clip, self.clip) for t in ts)

    def project_qkv(self, x: Tensor, source: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``q [B, H, N, D]``, ``k, v [B, Hkv, N, D]``, clamped (the packed path's projection)."""
        q, k, v = self._clamped(super().project_qkv(x, source))
        return q, k, v

    def _project_self(self, x: Tensor, positions: Tensor | None, start: int, *,
                      rotate: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``q [B, H, N, D]``, ``k, v [B, Hkv, N, D]``: clamped, then rotated at ``positions``."""
        q, k, v = self._clamped(super()._project_self(x, positions, start, rotate=False))
        if rotate and self.rope is not None:
            pos = resolve_positions(positions, x.shape[1], start, x.device, batch=x.shape[0])
            q, k = self._rotate(q, pos), self._rotate(k, pos)
        return q, k, v

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, clip={self.clip}"


class NormalizedTopKMoE(MixtureOfExperts):
    """DBRX's experts (``DbrxFFN``, modeling 330-365): a softmax over every expert in the logits' dtype,
    the top ``k``, divided by their ``p``-norm (``moe_normalize_expert_weights``; ``None``: not
    divided; ``p = 1`` renormalises to sum 1). SwiGLU experts. Shapes: ``x [..., C] -> [..., C]``."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, p: float | None, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(dim, hidden, num_experts, top_k, routing=Routing("softmax_topk"), device=device, dtype=dtype)
        self.p = None if p is None else float(p)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router of ``x [T, C]``: ``(weights [T, k], experts [T, k] long, logits [T, E])``."""
        logits = self.router(x)  # [T, E]
        weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=logits.dtype), self.top_k, dim=-1)
        if self.p is not None:
            weights = weights / torch.norm(weights, p=self.p, dim=-1, keepdim=True)
        return weights, experts, logits

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, p={self.p}"


def _dbrx_canonical(hf: HFConfig) -> HFConfig:
    """DBRX's config (configuration 25-160) under the keys read here: its ``attn_config`` /
    ``ffn_config`` read out (``kv_n_heads`` default 1, ``attn_pdrop``; ``ffn_hidden_size`` 3584,
    ``moe_num_experts`` 4, ``moe_top_k`` 1, ``ffn_act_fn["name"]``); what attnzoo does not reproduce refused."""
    attn, ffn = hf.get("attn_config", {}, dict), hf.get("ffn_config", {}, dict)
    clip, jitter, p = attn.get("clip_qkv"), ffn.get("moe_jitter_eps"), ffn.get("moe_normalize_expert_weights", 1.0)
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0):
        raise hf.unsupported(f"attn_config.clip_qkv={clip!r} (supported: null or a number > 0)")
    if jitter:  # the router's input times noise while training (modeling 320-324)
        raise hf.unsupported(f"ffn_config.moe_jitter_eps={jitter!r} (supported: null or 0)")
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or p <= 0):
        raise hf.unsupported(f"ffn_config.moe_normalize_expert_weights={p!r} (supported: null or a number > 0)")
    return HFConfig({**hf.data, "num_key_value_heads": attn.get("kv_n_heads", 1),
                     "attention_dropout": attn.get("attn_pdrop", 0.0) or 0.0,
                     "intermediate_size": ffn.get("ffn_hidden_size", 3584), "num_experts": ffn.get("moe_num_experts", 4),
                     "num_experts_per_tok": ffn.get("moe_top_k", 1),
                     "hidden_act": (ffn.get("ffn_act_fn") or {}).get("name", "silu")}, hf.source, hf.arch)


def _build_dbrx(hf: HFConfig, head_size: int | None, kw: dict[str, Any]) -> DecoderLM:
    """DBRX (module docstring): bias-free LayerNorms (eps 1e-5), clipped GQA with RoPE, every layer
    :class:`NormalizedTopKMoE`, ``resid_pdrop`` on both sub-layers' outputs."""
    C, H, depth, D = parts.dims(hf)
    attn, ffn = hf.get("attn_config", {}, dict), hf.get("ffn_config", {}, dict)
    clip = attn.get("clip_qkv")
    attention = functools.partial(
        build_softmax, ClippedAttention, C, H, num_kv_heads=hf.req("num_key_value_heads"), head_dim=D, bias=False,
        causal=True, rope=parts.rotary(hf, parts.rope_params(hf), D), dropout=hf.req("attention_dropout", float), **kw)
    if hf.get("hidden_act", "silu", str) not in ("silu", "swish"):
        raise hf.unsupported(f"ffn_config.ffn_act_fn={ffn.get('ffn_act_fn')!r} (supported: silu)")
    moe = functools.partial(NormalizedTopKMoE, C, hf.req("intermediate_size"), hf.req("num_experts"),
                            hf.req("num_experts_per_tok"), p=ffn.get("moe_normalize_expert_weights", 1.0), **kw)
    norm = functools.partial(nn.LayerNorm, C, eps=1e-5, bias=False, **kw)
    blocks = [TransformerBlock(C, layers=BlockLayers(attention=functools.partial(_with_clip, attention, clip),
                                                     feed_forward=moe, norm=norm,
                                                     dropout=hf.get("resid_pdrop", 0.0, float) or 0.0))
              for _ in range(depth)]
    return _layer_norm_decoder(HFConfig({**hf.data, "layer_norm_eps": 1e-5}, hf.source, hf.arch), blocks, norm,
                               head_size, kw, "layer_norm_eps")


def _with_clip(attention: Any, clip: float | None) -> ClippedAttention:
    module = attention()
    module.clip = None if clip is None else float(clip)
    return module


def _convert_dbrx(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """DBRX's weights (``transformer.`` / a base model's own names): ``Wqkv`` rows ``[q; k; v]`` as
    they are, the experts ``w1`` / ``v1`` / ``w2`` ``[E F, C]`` as gate / up / the transposed down."""
    head_size = parts.head_size_of(hf, sd)[1]
    model = build_sparse_moe(hf, head_size=head_size, device=device, dtype=dtype or float_dtype(sd))
    plan = parts.plan_for(sd, "transformer." if any(k.startswith("transformer.") for k in sd) else "", hf.arch)
    plan.put("tok_emb.weight", "wte.weight")
    E, F_ = hf.req("num_experts"), hf.req("intermediate_size")
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"blocks.{i}."
        plan.put_pairs(o, f"{h}norm_attn_norm.", [("attn.qkv_proj", "attn.Wqkv"), ("attn.out_proj", "attn.out_proj"),
                                                  ("attn_norm", "norm_1"), ("ffn_norm", "norm_2")], bias=False)
        plan.put(f"{o}ffn.router.weight", f"{h}ffn.router.layer.weight")
        for ours, theirs in (("gate_proj", "w1"), ("up_proj", "v1")):
            plan.put(f"{o}ffn.{ours}", f"{h}ffn.experts.mlp.{theirs}", lambda w: w.reshape(E, F_, -1))
        plan.put(f"{o}ffn.down_proj", f"{h}ffn.experts.mlp.w2", lambda w: w.reshape(E, F_, -1).transpose(1, 2).contiguous())
    return parts.finish(plan, model, head_size, final_norm="norm_f")


# --------------------------------------------------------------------------- Cohere2-MoE's parallel layers
class FeedForwardMixer(nn.Module):
    """A token-wise module (a feed-forward, a mixture of experts) as one of the token mixers of a
    :class:`~attnzoo.nn.parallel.ParallelMixers`: the attention protocol's ``mask`` and ``positions``
    mean nothing to it, its decode cache only counts tokens (a gemma4 ``SharedKVCounter``).

    Shapes: ``x [B, N, C] -> [B, N, C]``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> SharedKVCounter:
        return SharedKVCounter(batch_size)

    def forward(self, x: Tensor, *, mask: Any = None, cache: SharedKVCounter | None = None,
                positions: Tensor | None = None) -> Tensor:
        if cache is not None:
            cache.advance(x.shape[1], x.device)
        return self.module(x)  # [B, N, C]


def _parallel(attention: Any, feed_forward: Any) -> ParallelMixers:
    """Cohere's parallel layer as one mixer: ``attention(n) + feed_forward(n)`` of the same normed input."""
    return ParallelMixers([attention(), FeedForwardMixer(feed_forward())])


def _cohere_moe(hf: HFConfig, *, device: Any = None, dtype: Any = None) -> MixtureOfExperts:
    """Cohere2-MoE's experts (modeling 130-205): the top-k logits, then a softmax over them
    (``expert_selection_fn="softmax"``) or their sigmoids renormalised by ``norm_topk_prob``
    (``"sigmoid"``: :class:`LogitBiasSigmoidMoE`, its bias 0); ``num_shared_experts`` ungated shared
    experts of ``intermediate_size`` each (their average with the routed output is folded at load)."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    C, F_, E, k = (hf.req(n) for n in ("hidden_size", "intermediate_size", "num_experts", "num_experts_per_tok"))
    n = hf.get("num_shared_experts", 0)
    shared = FeedForward(C, F_ * n, "swiglu", bias=False, **kw) if n else None
    how = hf.get("expert_selection_fn", "softmax", str)
    if how == "sigmoid":
        return LogitBiasSigmoidMoE(C, F_, E, k, norm_topk_prob=hf.get("norm_topk_prob", True, bool),
                                   shared_expert=shared, **kw)
    if how != "softmax":
        raise hf.unsupported(f"expert_selection_fn={how!r} (supported: 'softmax', 'sigmoid')")
    return MixtureOfExperts(C, F_, E, k, routing=Routing("topk_softmax"), shared_expert=shared, **kw)


def _cohere_layout(hf: HFConfig, depth: int) -> tuple[list[str], list[str]]:
    """``(layer kinds, mlp kinds)`` of Cohere2-MoE (configuration 128-150): ``layer_types`` and
    ``mlp_layer_types``, by default from ``first_k_dense_replace`` dense layers, sliding but every
    ``prefix_dense_sliding_window_pattern``-th, then sliding but every ``sliding_window_pattern``-th."""
    k = hf.get("first_k_dense_replace", 0)
    patterns = [hf.raw(key) for key in ("prefix_dense_sliding_window_pattern", "sliding_window_pattern")]
    for key, p in zip(("prefix_dense_sliding_window_pattern", "sliding_window_pattern"), patterns, strict=True):
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise hf.unsupported(f"{key}={p!r} (supported: an int >= 1)")
    kinds = [TYPES[(i + 1) % patterns[0] != 0] for i in range(k)] + [
        TYPES[(i + 1) % patterns[1] != 0] for i in range(depth - k)]
    return (parts.layer_types(hf, depth, TYPES, default=kinds),
            parts.layer_types(hf, depth, ("dense", "sparse"), key="mlp_layer_types",
                              default=["dense" if i < k else "sparse" for i in range(depth)]))


def _build_cohere2_moe(hf: HFConfig, head_size: int | None, kw: dict[str, Any]) -> DecoderLM:
    """Cohere2-MoE (module docstring): parallel layers, interleaved RoPE on the sliding (and, by
    ``prefix_dense_sliding_window_pattern == 1``, the dense) layers, no positions on the others."""
    C, _, depth, D = parts.dims(hf)
    kinds, mlps = _cohere_layout(hf, depth)
    if hf.has("rms_norm_eps"):
        norm, eps_key = parts.rms_norm(C, hf.req("rms_norm_eps", float), **kw), "rms_norm_eps"
    else:
        norm, eps_key = functools.partial(nn.LayerNorm, C, eps=hf.req("layer_norm_eps", float), bias=False,
                                          **kw), "layer_norm_eps"
    rope, force = _rotary(hf, VARIANTS["cohere2_moe"], D), hf.req("prefix_dense_sliding_window_pattern") == 1
    width = hf.get("prefix_dense_intermediate_size", None) or hf.req("intermediate_size")
    mlp = parts.gated_mlp(C, width, hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    moe = _moe(hf, VARIANTS["cohere2_moe"], kw)
    blocks = [parts.block(C, functools.partial(_parallel, parts.attention_factory(
        hf, window=w, rope=rope if w is not None or (force and m == "dense") else None, **kw),
        mlp if m == "dense" else moe), None, norm) for w, m in zip(parts.sliding_windows(hf, kinds), mlps, strict=True)]
    return _layer_norm_decoder(hf, blocks, norm, head_size, kw, eps_key)


def _convert_cohere2_moe(hf: HFConfig, model: DecoderLM, plan: Plan, head_size: int | None) -> DecoderLM:
    """Cohere2-MoE's weights: the attention at ``attn.mixers.0``, the MLP or MoE at ``attn.mixers.1.module``;
    the ``"average"`` of the routed and shared experts folded into their down projections (times 0.5:
    exact), ``logit_scale`` into the final norm of an LM head."""
    variant, bias = VARIANTS["cohere2_moe"], hf.get("attention_bias", False, bool)
    average = hf.get("shared_expert_combination_strategy", "average", str)
    if average not in ("average", "sum"):
        raise hf.unsupported(f"shared_expert_combination_strategy={average!r} (supported: 'average', 'sum')")
    for i, block in enumerate(model.blocks):
        o, h, ffn = f"blocks.{i}.", f"layers.{i}.", block.attn.mixers[1].module
        parts.put_attention(plan, f"{o}attn.mixers.0", f"{h}self_attn.", bias=bias)
        _put_ffn(plan, f"{o}attn.mixers.1.module.", f"{h}mlp.", variant, ffn, hf)
        if isinstance(ffn, LogitBiasSigmoidMoE):
            plan.put_tensor(f"{o}attn.mixers.1.module.score_bias", torch.zeros(ffn.num_experts), "zeros (no bias)")
        if isinstance(ffn, MixtureOfExperts) and ffn.shared_expert is not None and average == "average":
            for name in (f"{o}attn.mixers.1.module.down_proj", f"{o}attn.mixers.1.module.shared_expert.down_proj.weight"):
                t, key = plan.values[name]
                plan.values[name] = (t * 0.5, f"{key} x 0.5 (the average of the routed and shared experts)")
        plan.put_pairs(o, h, [("attn_norm", "input_layernorm")], bias=False)
    scale = hf.req("logit_scale", float)
    return parts.finish(plan, model, head_size, norm_transform=None if head_size is not None or scale == 1.0 else
                        functools.partial(torch.mul, other=scale))


# --------------------------------------------------------------------------- Kolibri 1.1's indexed attention
def nvfp4(x: Tensor) -> Tensor:
    """``x`` rounded to NVFP4 and back, in float32 (Kolibri 1.1's ``nvfp4_fake_quantize``, modeling
    43-56): per 16 consecutive values of the last axis one E4M3 scale ``max |x| / 6`` (clamped to
    ``[2^-9, 448]``), the scaled values to E2M1 magnitudes (steps 0.5 below 2, 1 below 4, 2 up to 6;
    ties to even). Shapes: ``[..., 16 m] -> [..., 16 m]`` in ``x``'s dtype."""
    groups = x.float().unflatten(-1, (-1, 16))  # [..., m, 16]
    scale = (groups.abs().amax(-1, keepdim=True) / 6).clamp(2 ** -9, 448).to(torch.float8_e4m3fn).float()
    scaled = groups / scale
    size = scaled.abs().clamp(max=6)
    step = torch.where(size < 2, 0.5, torch.where(size < 4, 1.0, 2.0))
    return ((torch.round(size / step) * step).copysign(scaled) * scale).flatten(-2).to(x.dtype)


def top_k_lowest(scores: Tensor, k: int) -> Tensor:
    """Bool ``[..., M]``: the ``k`` highest finite ``scores [..., M]`` of each row, ties at the cut to
    the lowest indices (``-inf`` never kept)."""
    k = min(k, scores.shape[-1])
    kth = scores.topk(k, dim=-1).values[..., -1:]  # [..., 1]
    above = scores > kth
    tied = (scores == kth) & (kth > float("-inf"))
    return above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= k - above.sum(-1, keepdim=True)))


@dataclass(frozen=True)
class KolibriIndex:
    """Kolibri 1.1's weightless key selection (``Kolibri1_1Indexer``, modeling 59-189): keys and
    queries scored by ``sum_h relu(q_h . k) / (sqrt(D) * heads)`` over the first ``heads`` query heads
    against key head 0, both rounded to NVFP4 (:func:`nvfp4`). A query that sees more than ``pool``
    keys (counted from its first to its last visible one) gets a pool: the ``pool / compression``
    best blocks of ``compression`` keys (averaged, from its first visible key; its newest incomplete
    block scores 0); one that sees more than ``topk + local + sinks`` attends to the ``topk`` best of
    its pool besides the first ``sinks`` and the last ``local`` keys. Ties go to the earlier keys."""

    topk: int
    pool: int
    compression: int
    heads: int
    local: int
    sinks: int
    head_dim: int

    def _scores(self, q: Tensor, keys: Tensor) -> Tensor:
        """``[R, M]`` float32 of ``q [heads, R, D]``, ``keys [M, D]`` (float32), summed head by head."""
        scores = q.new_zeros(q.shape[1], keys.shape[0])
        for head in q:
            scores += (head @ keys.T).relu()
        return scores * (self.head_dim ** -0.5 / self.heads)

    def _groups(self, visible: Tensor, more_than: int) -> Any:
        """``(b, start, rows [R], length [R, 1])`` for the queries of row ``b`` whose first visible key
        is ``start`` and that see more than ``more_than`` keys, from ``visible [B, N, M]``."""
        starts = visible.int().argmax(-1)  # [B, N]
        lengths = (visible.shape[-1] - visible.flip(-1).int().argmax(-1) - starts) * visible.any(-1)
        for b in range(visible.shape[0]):
            long = lengths[b] > more_than
            for start in starts[b][long].unique().tolist():
                rows = (long & (starts[b] == start)).nonzero().squeeze(-1)
                yield b, start, rows, lengths[b, rows, None]

    def select_pool(self, q: Tensor, k: Tensor, visible: Tensor) -> Tensor:
        """The pool ``[B, N, M]`` bool of queries ``q [B, H, N, D]`` over keys ``k [B, Hkv, M, D]``."""
        pool, c = visible.clone(), self.compression
        unseen = ~visible.any(1)  # [B, M]: keys no query sees count as zeros in their block
        for b, start, rows, length in self._groups(visible, self.pool):
            keys = k[b, 0, start:].masked_fill(unseen[b, start:, None], 0.0)  # [M', D]
            n = keys.shape[0] // c
            summary = nvfp4(keys[: n * c].float().unflatten(0, (n, c)).sum(1) / c)  # [n, D]
            scores = F.pad(self._scores(nvfp4(q[b, : self.heads, rows]).float(), summary), (0, 1))  # [R, n + 1]
            block = torch.arange(n + 1, device=scores.device)
            scores = torch.where(block < length // c, scores, 0.0)
            scores = scores.masked_fill(block >= (length + c - 1) // c, float("-inf"))
            chosen = top_k_lowest(scores, self.pool // c).repeat_interleave(c, dim=-1)[:, : keys.shape[0]]
            pool[b, rows, start:] = chosen & visible[b, rows, start:]
        return pool

    def select(self, q: Tensor, k: Tensor, visible: Tensor, pool: Tensor) -> Tensor:
        """The keys ``[B, N, M]`` bool each query attends (within ``visible``), from ``pool``."""
        selected = visible.clone()
        for b, start, rows, length in self._groups(visible, self.topk + self.local + self.sinks):
            keys = nvfp4(k[b, 0, start:]).float()  # [M', D]
            scores = self._scores(nvfp4(q[b, : self.heads, rows]).float(), keys)  # [R, M']
            pos = torch.arange(keys.shape[0], device=scores.device)
            sinks, local = pos < self.sinks, (pos >= length - self.local) & (pos < length)
            candidates = pool[b, rows, start:] & ~sinks & (pos < length - self.local)
            chosen = top_k_lowest(scores.masked_fill(~candidates, float("-inf")), self.topk)
            selected[b, rows, start:] = (chosen | sinks | local) & visible[b, rows, start:]
        return selected


class IndexPool:
    """The pool ``[B, N, M]`` bool of the latest indexer layer for the queries of the current call,
    read by the indexed layers after it (Kolibri 1.1's ``index_pool``). Not a module."""

    def __init__(self) -> None:
        self.pool: Tensor | None = None


class IndexedAttention(Gemma4Attention):
    """Kolibri 1.1's ``indexed_attention`` layer (``Kolibri1_1Attention``, modeling 259-340): causal
    GQA without positions (NoPE), per-head q/k RMSNorms, over the keys :class:`KolibriIndex` selects
    (a boolean mask on top of causality and padding; no gradient through it), the keys and values
    rounded to NVFP4 with a straight-through gradient; ``source``: an indexer layer (it selects the
    pool it and the following layers select from, in ``pool``). KV sharing (``sharing``: a layer
    reading an earlier layer's keys and values has only ``q_proj``) is :class:`Gemma4Attention`'s,
    without its value norm.

    Shapes: ``x [B, N, C] -> [B, N, C]``. Packed input: the model runs each sequence alone."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None, *,
                 dropout: float = 0.0, parts: Any = None, sharing: KVSharing | None = None, index: KolibriIndex,
                 pool: IndexPool, source: bool) -> None:
        super().__init__(dim, num_heads, num_kv_heads, head_dim, dropout=dropout, parts=parts, sharing=sharing)
        self.index, self.pool, self.source = index, pool, bool(source)

    def _norm_v(self, v: Tensor) -> Tensor:
        return v  # no value norm

    def _attend_keys(self, q: Tensor, k: Tensor, v: Tensor, mask: Any, start: int, first: int,
                     return_weights: bool, *, decoding: bool) -> tuple[Tensor, Tensor | None]:
        """The selection of the keys ``first ..`` (every key: no window) for the queries at ``start ..``."""
        B, _, N, _ = q.shape
        with torch.no_grad():
            real = real_keys(mask, B, start + N, q.device)[:, first:]  # [B, M]
            key_pos = torch.arange(first, start + N, device=q.device)
            visible = real[:, None] & (key_pos <= torch.arange(start, start + N, device=q.device)[:, None])
            if self.source:
                self.pool.pool = self.index.select_pool(q, k, visible)
            if self.pool.pool is None or self.pool.pool.shape != visible.shape:
                raise RuntimeError("IndexedAttention: no pool for these queries; an indexer layer runs first")
            allowed = self.index.select(q, k, visible, self.pool.pool)  # [B, N, M]
        k = k + (nvfp4(k) - k).detach()
        v = v + (nvfp4(v) - v).detach()
        return super()._attend_keys(q, k, v, allowed.unsqueeze(1), start, first, return_weights, decoding=decoding)

    def _packed(self, x: Tensor, cu_seqlens: object, context: object, mask: object, cache: object,
                positions: object, return_weights: bool) -> Tensor:
        raise ValueError(f"{type(self).__name__}: packed input (cu_seqlens) runs one sequence at a time "
                         f"(the model's layer loop)")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.index}, indexer={self.source}"


class Kolibri11LM(LayerLoopLM):
    """Kolibri 1.1's decoder: its layers in order, each sequence of a packed batch alone (the
    indexed layers hand keys, values and pools from layer to layer within one call)."""

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """``x [B, N, C]`` through the blocks -> ``[B, N, C]``."""
        positions = self.rotary_positions(positions, key_padding, past, x.shape[1], x.device)
        for i, block in enumerate(self.blocks):
            x = block(x, key_padding=key_padding, cache=None if cache is None else cache[i], positions=positions)
        return x


#: Kolibri 1.1's layer kinds
KOLIBRI_TYPES = ("sliding_attention", "indexed_attention")


def kolibri1_1_layout(hf: HFConfig, depth: int) -> tuple[list[str], list[int], set[int]]:
    """``(kinds, kv_sources, indexers)`` of a Kolibri 1.1 config (configuration 126-190): the layer
    kinds (default: indexed every fifth), the layer each reads its keys and values from (default:
    of the indexed layers, the 2nd, 3rd and 10th read the 1st's, the 7th to 9th the 6th's), the
    indexer layers (default: the 1st, 3rd, 4th and 6th indexed layer)."""
    kinds = parts.layer_types(hf, depth, KOLIBRI_TYPES, default=[KOLIBRI_TYPES[(i + 1) % 5 == 0] for i in range(depth)])
    indexed = [i for i, t in enumerate(kinds) if t == KOLIBRI_TYPES[1]]
    indexers = hf.get("index_layers", None, list)
    indexers = [indexed[j] for j in (0, 2, 3, 5) if j < len(indexed)] if indexers is None else indexers
    sources = hf.get("kv_source_layers", None, list)
    if sources is None:
        if len(indexed) > len(_KOLIBRI_SOURCES):
            raise hf.unsupported(f"{len(indexed)} indexed_attention layers without kv_source_layers (its default "
                                 f"covers {len(_KOLIBRI_SOURCES)})")
        sources = list(range(depth))
        for i, j in zip(indexed, _KOLIBRI_SOURCES, strict=False):
            sources[i] = indexed[j]
    bad = len(sources) != depth or any(
        not isinstance(s, int) or not 0 <= s <= i or sources[s] != s or kinds[s] != kinds[i]
        or (kinds[i] == KOLIBRI_TYPES[0] and s != i) for i, s in enumerate(sources))
    if bad or not set(indexers) <= set(indexed) or (indexed and indexed[0] not in indexers):
        raise CheckpointFormatError(f"{hf.source}: kv_source_layers {sources!r} / index_layers {indexers!r} do not "
                                    f"fit layer_types {kinds!r}")
    return kinds, sources, set(indexers)


#: the default ``kv_source_layers`` of the indexed layers, as indices into them (configuration 164)
_KOLIBRI_SOURCES = (0, 0, 0, 3, 4, 5, 5, 5, 5, 0)


def _kolibri_sharing(sources: list[int], store: SharedKV) -> list[KVSharing | None]:
    """Each layer's part in KV sharing: a source others read ``"store"``, a reader ``"reuse"``
    (the last reader of a source releases it), else ``None``."""
    readers = {s for i, s in enumerate(sources) if s != i}
    last = {s: max(i for i, t in enumerate(sources) if t == s and i != s) for s in readers}
    return [KVSharing(store, str(s), "reuse", last[s] == i) if s != i else
            KVSharing(store, str(i), "store") if i in readers else None for i, s in enumerate(sources)]


def _kolibri_attention(hf: HFConfig, kind: str, i: int, layout: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """The factory of layer ``i``'s attention: sliding (RoPE, a window, per-head QK norms, no biases)
    or :class:`IndexedAttention` (``layout``: ``(sharing, index, pool, indexers, rope)``)."""
    sharing, index, pool, indexers, rope = layout
    C, H, eps = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.get("rms_norm_eps", 1e-6, float)
    if kind == KOLIBRI_TYPES[0]:
        return parts.attention_factory(HFConfig({**hf.data, "attention_bias": False}, hf.source, hf.arch),
                                       window=hf.req("sliding_window") - 1, rope=rope, qk_norm="head", **kw)
    return functools.partial(build_softmax, IndexedAttention, C, H, num_kv_heads=hf.get("num_key_value_heads", H),
                             head_dim=hf.get("head_dim", C // H), dropout=hf.get("attention_dropout", 0.0, float),
                             qk_norm="head", qk_norm_eps=eps, sharing=sharing[i], index=index, pool=pool,
                             source=i in indexers, **kw)


def _kolibri_index(hf: HFConfig, D: int) -> KolibriIndex:
    """The :class:`KolibriIndex` of the config (NVFP4 needs ``head_dim`` a multiple of 16)."""
    H, Hkv = hf.req("num_attention_heads"), hf.get("num_key_value_heads", hf.req("num_attention_heads"))
    index = KolibriIndex(*(hf.req(f"index_{k}") for k in ("topk", "pool_size", "compression", "num_heads",
                                                          "num_local_tokens", "num_sink_tokens")), head_dim=D)
    if D % 16 or not 0 < index.heads <= H // Hkv or min(index.topk, index.pool, index.compression) < 1 \
            or index.pool % index.compression:
        raise CheckpointFormatError(f"{hf.source}: Kolibri 1.1's indexer needs head_dim a multiple of 16, "
                                    f"index_num_heads within the query heads of key head 0 and index_pool_size a "
                                    f"multiple of index_compression; got {index}")
    return index


def _build_kolibri1_1(hf: HFConfig, head_size: int | None, kw: dict[str, Any]) -> DecoderLM:
    """Kolibri 1.1 (module docstring): GLM-4's four norms, sliding and indexed layers, MoE or dense."""
    C, H, depth, D = parts.dims(hf)
    eps, V = hf.get("rms_norm_eps", 1e-6, float), hf.req("vocab_size")
    kinds, sources, indexers = kolibri1_1_layout(hf, depth)
    layout = (_kolibri_sharing(sources, SharedKV()), _kolibri_index(hf, D), IndexPool(), indexers,
              parts.rotary(hf, parts.rope_params(hf), D))
    dense = set(hf.get("mlp_only_layers", [0, 1], list))
    mlp = parts.gated_mlp(C, hf.req("mlp_only_intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"),
                          **kw)
    moe = _moe(hf, VARIANTS["kolibri1_1"], kw)
    blocks = [parts.block(C, _kolibri_attention(hf, kind, i, layout, kw), mlp if i in dense else moe,
                          parts.rms_norm(C, eps, **kw), sublayer_norm="both") for i, kind in enumerate(kinds)]
    cfg = DecoderConfig(V, C, depth, H, pos="rope", norm="rms", norm_eps=eps,
                        tie_embeddings=hf.get("tie_word_embeddings", False, bool), max_seq_len=parts.max_positions(hf))
    return Kolibri11LM(config=cfg, parts=DecoderParts(blocks=blocks, head=head_for(C, V, head_size, **kw)), **kw)


def _convert_kolibri1_1(hf: HFConfig, model: DecoderLM, plan: Plan, head_size: int | None) -> DecoderLM:
    """Kolibri 1.1's weights: a reading layer has ``q_proj``, ``q_norm`` and ``o_proj`` only."""
    for i, block in enumerate(model.blocks):
        o, h = f"blocks.{i}.", f"layers.{i}."
        names = "q" if isinstance(block.attn, IndexedAttention) and block.attn.reuses else "qkv"
        plan.put_cat(f"{o}attn.qkv_proj.weight", [f"{h}self_attn.{n}_proj.weight" for n in names])
        plan.put(f"{o}attn.out_proj.weight", f"{h}self_attn.o_proj.weight")
        for n in ("q",) if names == "q" else ("q", "k"):
            plan.put(f"{o}attn.frontier.{n}_norm_weight", f"{h}self_attn.{n}_norm.weight")
        _put_ffn(plan, f"{o}ffn.", f"{h}mlp.", VARIANTS["kolibri1_1"], block.ffn, hf)
        plan.put_pairs(o, h, GLM4_NORMS, bias=False)
    return parts.finish(plan, model, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``: every ``Variant``
DISPATCH = {t: parts.Dispatch(v.name, convert_sparse_moe, v.classes) for t, v in VARIANTS.items()}
