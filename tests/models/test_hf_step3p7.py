"""Step-3.7-Flash (``step3p7``, its text model ``step3p5``) through ``from_hf`` / ``load_pretrained``:
sliding layers with their own query-head count, per-kind partial RoPE, Gemma-normed per-head QK norms,
a sigmoid output gate, sigmoid-routed experts with a shared expert, per-layer SwiGLU limits; equal to
transformers' eager ``Step3p7ForConditionalGeneration`` on text. Its multi-token-prediction layers load
from a folder and give transformers' ``MtpModel`` logits at every depth, and ``generate(use_mtp=True)``
writes transformers' tokens with as many forwards; a released ``config.json`` (padded per-layer lists,
``moe_layers_enum``, ``attention_other_setting``) reads as transformers reads it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_mtp import _distill  # noqa: E402

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf, load_pretrained, save_pretrained  # noqa: E402
from attnzoo.models.families.bailing_hybrid import LimitedSwiGLU  # noqa: E402
from attnzoo.models.mtp import MultiTokenPredictor  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*the text decoder of Step-3.7-Flash is converted")]

F, S = "full_attention", "sliding_attention"
#: a one-layer vision tower
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)


def _text(**kw: Any) -> dict[str, Any]:
    """4 layers (sliding, full, sliding, full; the sliding ones 8 query heads, the full ones 4), the full
    layers' RoPE on half the head (theta 5e5), a dense first layer then MoE (4 experts top-2), SwiGLU
    limits small enough to clip on layers 0 and 2 (routed on 2, shared / dense on 0 and 2)."""
    return {**checks.SMALL, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "head_dim": 8,
            "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "share_expert_dim": 24,
            "sliding_window": 4, "layer_types": [S, F, S, F], "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "num_sliding_attention_heads": 8, "moe_router_scaling_factor": 1.5,
            "rope_parameters": {F: {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5},
                                S: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}},
            "swiglu_limits": [0, 0, 0.3, 0], "swiglu_limits_shared": [0.3, 0, 0.3, None], **kw}


def _step(**kw: Any) -> Any:
    return T.Step3p7Config(text_config=_text(**kw), vision_config=dict(VISION))


def _step_other() -> Any:
    """Biases on q/k/v/o, a query scalar of 20, one key/value head, every layer full
    and sparse, llama3-scaled RoPE, tied embeddings."""
    config = _step(gating="per-head", attention_bias=True, query_pre_attn_scalar=20, num_key_value_heads=1,
                   layer_types=[F, F, F, F], mlp_layer_types=["sparse"] * 4, rms_norm_eps=1e-6,
                   rope_parameters={F: {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}})
    config.tie_word_embeddings = True
    return config


class TestStep3p7(checks.FamilyChecks):
    config = staticmethod(_step)
    cases = (_step_other,)


def test_layer_structure_and_parameter_count() -> None:
    hf = checks.hf_model(_step())
    ours = from_hf(hf)
    a0, a1 = ours.blocks[0].attn, ours.blocks[1].attn
    assert (a0.num_heads, a0.num_kv_heads, a0.rope.rotary_dim) == (8, 2, 8)
    assert (a1.num_heads, a1.rope.rotary_dim, a1.frontier.gate_proj.mode) == (4, 4, "head")
    assert isinstance(ours.blocks[0].ffn, LimitedSwiGLU) and ours.blocks[0].ffn.limit == 0.3
    moe = ours.blocks[2].ffn
    assert isinstance(moe, MixtureOfExperts) and moe.activation == "limited_swiglu" and moe.routed_scaling == 1.5
    assert isinstance(moe.shared_expert, LimitedSwiGLU) and ours.blocks[1].ffn.activation == "swiglu"
    text = sum(p.numel() for n, p in hf.named_parameters() if "vision" not in n and "projector" not in n)
    assert sum(p.numel() for p in ours.parameters()) == text


def test_packed_sequences_and_their_gradients_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_step)
    checks.check_packed_gradients_equal_each_alone(_step)


def test_the_text_model_alone(tmp_path: Path) -> None:
    """``Step3p7TextModel`` converts as the base decoder; a folder of ``model_type`` ``step3p5`` (the
    text model with its head, the released names) loads as the wrapper's text model."""
    checks.check_text_model_alone(checks.hf_model(_step()), tmp_path, "step3p5")


def _released(config: dict[str, Any], mtp: int) -> dict[str, Any]:
    """A saved text config written as the released ``config.json`` is: per-layer lists padded with the MTP
    layers' entries, ``moe_layers_enum``, ``attention_other_setting``, ``rope_theta`` /
    ``partial_rotary_factors`` per layer, the config's other names (``moe_num_experts``, ...)."""
    kinds, mlps = config.pop("layer_types"), config.pop("mlp_layer_types")
    mtp_kinds, mtp_mlps = config.pop("mtp_layer_types") or [], config.pop("mtp_mlp_layer_types") or []
    rope = config.pop("rope_parameters")
    every = kinds + mtp_kinds
    out = {**config, "layer_types": every, "num_nextn_predict_layers": mtp,
           "moe_layers_enum": ",".join(str(i) for i, m in enumerate(mlps + mtp_mlps) if m == "sparse"),
           "attention_other_setting": {"num_attention_heads": config.pop("num_sliding_attention_heads")},
           "rope_theta": [rope[k]["rope_theta"] for k in every],
           "partial_rotary_factors": [rope[k].get("partial_rotary_factor", 1.0) for k in every],
           "moe_num_experts": config.pop("n_routed_experts"), "moe_top_k": config.pop("num_experts_per_tok"),
           "swiglu_limits": config.pop("swiglu_limits") + [7.0] * mtp,
           "swiglu_limits_shared": config.pop("swiglu_limits_shared") + [7.0] * mtp}
    for key in ("per_layer_config", "query_pre_attn_scalar", "model_type"):
        out.pop(key, None)
    return out


def _checkpoint(folder: Path, mtp: int = 2, seed: int = 0, released: bool = False) -> Path:
    """A saved ``Step3p7ForConditionalGeneration`` with ``mtp`` MTP layers (``model.layers.{4 + k}``: a
    full-attention decoder layer, the first a MoE and the second dense, with ``enorm``, ``hnorm``,
    ``eh_proj``, ``shared_head.norm`` and the copies of the embedding and the head the released
    checkpoints hold); ``released``: its ``config.json`` in the released form (:func:`_released`)."""
    config = _step(mtp_layer_types=[F] * mtp, mtp_mlp_layer_types=["sparse", "dense"][:mtp])
    config.text_config.num_nextn_predict_layers = mtp
    hf = checks.hf_model(config, seed=seed)
    hf.save_pretrained(folder)
    g = torch.Generator().manual_seed(seed + 1)
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    C = 32
    for k in range(mtp):  # attention from layer 1 (full); the feed-forward from layer 1 (MoE), then 0 (dense)
        ffn = "model.layers.1." if k == 0 else "model.layers.0."
        for key, value in list(tensors.items()):
            attention = key.startswith(("model.layers.1.self_attn.", "model.layers.1.input_layernorm."))
            if attention or (key.startswith(ffn) and ".self_attn." not in key and ".input_layernorm." not in key):
                name = f"model.layers.{4 + k}.{key.split('.', 3)[3]}"
                tensors[name] = value + 0.05 * torch.randn(value.shape, generator=g)
        for n in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"model.layers.{4 + k}.{n}.weight"] = 0.1 * torch.randn(C, generator=g)
        tensors[f"model.layers.{4 + k}.eh_proj.weight"] = torch.randn(C, 2 * C, generator=g) / 8
        tensors[f"model.layers.{4 + k}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        tensors[f"model.layers.{4 + k}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    safetensors_torch.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if released:
        path = folder / "config.json"
        data = json.loads(path.read_text())
        data["text_config"] = _released(data["text_config"], mtp)
        path.write_text(json.dumps(data))
    return folder


def _theirs(folder: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return T.Step3p7ForConditionalGeneration.from_pretrained(folder).eval()


@pytest.mark.parametrize("released", [False, True], ids=["saved", "released-config"])
def test_mtp_layers_give_transformers_logits_at_every_depth(tmp_path: Path, released: bool) -> None:
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    folder = _checkpoint(tmp_path / "ckpt", released=released)
    theirs = _theirs(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the vision tower's tensors are dropped
        ours = load_pretrained(folder).eval()
    assert isinstance(ours.mtp, MultiTokenPredictor) and ours.mtp.depth == 2
    assert isinstance(ours.mtp.layers[0].block.ffn, MixtureOfExperts)
    assert not isinstance(ours.mtp.layers[1].block.ffn, MixtureOfExperts)
    ids = checks.tokens(10, batch=1)
    with torch.no_grad():
        h = theirs(ids, output_hidden_states=True).hidden_states[-1]
        assert checks.rel(ours(ids), theirs(ids).logits) <= checks.TOL
        mtp = MtpModel.from_pretrained(theirs)
        cache = MtpCache(config=theirs.config.get_mtp_config())
        got = ours.mtp_logits(ids)
        for k in range(2):  # depth k reads depth k - 1's output and the ids shifted once more
            h = mtp.forward_layer(k, h[:, :-1], torch.arange(k + 1, 10)[None], cache, input_ids=ids[:, k + 1:])
            want = mtp._project_to_logits(h)  # [1, 9 - k, V]: row j predicts token j + k + 2
            assert want.abs().max() > 0.1 and checks.rel(got[k], want) <= checks.TOL


def test_use_mtp_writes_transformers_tokens_with_as_many_forwards(tmp_path: Path) -> None:
    """Self-distilled MTP layers written back with save_pretrained(like=): the tokens of transformers'
    generate(use_mtp=True) and of greedy decoding, with as many forwards of the model as transformers."""
    folder = _checkpoint(tmp_path / "base", mtp=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_pretrained(folder).eval()
    prompts = checks.tokens(6, batch=48, seed=3)
    with torch.no_grad():
        seqs = ours.generate(prompts, 16)
    _distill(ours, seqs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_pretrained(ours, tmp_path / "distilled", like=folder)
        back = load_pretrained(tmp_path / "distilled").eval()
    theirs = _theirs(tmp_path / "distilled")
    calls = {"ours": 0, "theirs": 0}
    back.blocks[-1].register_forward_hook(lambda *_: calls.__setitem__("ours", calls["ours"] + 1))
    theirs.model.language_model.layers[-1].register_forward_hook(
        lambda *_: calls.__setitem__("theirs", calls["theirs"] + 1))
    for row in range(3):
        x = prompts[row:row + 1]
        calls.update(ours=0, theirs=0)
        with torch.no_grad():
            want = theirs.generate(x, max_new_tokens=16, do_sample=False, use_mtp=True, eos_token_id=None, pad_token_id=0)
            got = back.generate(x, 16, use_mtp=True)
        assert torch.equal(got, want)
        assert calls["ours"] == calls["theirs"] < 16, calls  # drafts were kept
        assert torch.equal(got, back.generate(x, 16))


def test_released_config_reads_as_transformers_reads_it(tmp_path: Path) -> None:
    """No MTP layers in the folder, the config's padded lists split all the same."""
    folder = _checkpoint(tmp_path / "ckpt", mtp=0, released=True)
    data = json.loads((folder / "config.json").read_text())
    data["text_config"]["num_nextn_predict_layers"] = 2
    for key in ("layer_types", "rope_theta", "partial_rotary_factors", "swiglu_limits", "swiglu_limits_shared"):
        data["text_config"][key] = data["text_config"][key] + data["text_config"][key][-1:] * 2
    (folder / "config.json").write_text(json.dumps(data))
    theirs = _theirs(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_pretrained(folder)
    assert ours.mtp is None and theirs.config.text_config.num_sliding_attention_heads == 8
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(ours(x), theirs(input_ids=x).logits) <= checks.TOL


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A text config leaving out ``Step3p7TextConfig``'s defaults (every layer full, dense below layer 3)."""
    text = _text(layer_types=None, mlp_layer_types=None, rope_parameters=None, rms_norm_eps=1e-5,
                 moe_router_scaling_factor=1.0, num_hidden_layers=5, swiglu_limits=None, swiglu_limits_shared=None)
    hf = checks.hf_model(T.Step3p7Config(text_config=text, vision_config=dict(VISION)))
    hf.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "rms_norm_eps", "moe_router_scaling_factor",
                "per_layer_config", "query_pre_attn_scalar", "swiglu_limits", "swiglu_limits_shared"):
        data["text_config"].pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(data))
    theirs = _theirs(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_pretrained(tmp_path)
    assert [isinstance(b.ffn, MixtureOfExperts) for b in ours.blocks] == [False] * 3 + [True] * 2
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(ours(x), theirs(input_ids=x).logits) <= checks.TOL


def _twelve(**kw: Any) -> Any:
    """12 layers (sliding, sliding, sliding, full) x 3: transformers saves ``per_layer_config`` keys
    zero-padded (``"03"``, ``"11"``)."""
    return _step(num_hidden_layers=12, layer_types=[S, S, S, F] * 3, mlp_layer_types=["dense"] + ["sparse"] * 11,
                 swiglu_limits=[0] * 12, swiglu_limits_shared=[0] * 12, **kw)


@pytest.mark.parametrize("per_layer", [{3: {"num_attention_heads": 2}, 11: {"num_attention_heads": 2}},
                                       {1: {"num_attention_heads": 2}}],
                         ids=["full layers, zero-padded keys", "a sliding layer, the others as the full ones"])
def test_a_saved_per_layer_config_says_the_heads_alone(tmp_path: Path, per_layer: dict[int, Any]) -> None:
    """Given, ``per_layer_config`` says each layer's heads (``num_attention_heads`` where it says nothing,
    ``num_sliding_attention_heads`` then unread, as transformers' ``setdefault`` reads it)."""
    hf = checks.hf_model(_twelve(per_layer_config=per_layer))
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["text_config"]["per_layer_config"]
    assert {int(k) for k in saved} == set(per_layer) and (len(per_layer) == 1 or "03" in saved)  # zero-padded
    x = checks.tokens(12)
    with torch.no_grad():
        want = hf(input_ids=x).logits
        for ours in (from_hf(hf), load_pretrained(tmp_path)):
            assert checks.rel(ours(x), want) <= checks.TOL
    heads = [b.attn.num_heads for b in from_hf(hf).blocks]
    assert heads == [2 if i in per_layer else 4 for i in range(12)]


def test_released_mtp_names_and_the_mtp_layer_alias_load(tmp_path: Path) -> None:
    """The released MTP layers name their norms and head ``layers.{L+k}.transformer.*`` (vLLM strips the
    infix): they load, the per-layer ``shared_head.output`` copy unread; ``num_mtp_layers`` (the config's
    alias) counts them as ``num_nextn_predict_layers`` does."""
    folder = _checkpoint(tmp_path / "ckpt", mtp=1)
    want = load_pretrained(folder).mtp_logits(checks.tokens(9, batch=1))[0]
    path = folder / "model.safetensors"
    tensors = safetensors_torch.load_file(str(path))
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.4.transformer.{name}.weight"] = tensors.pop(f"model.layers.4.{name}.weight")
    tensors["model.layers.4.transformer.shared_head.output.weight"] = tensors.pop("model.layers.4.shared_head.head.weight")
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
    data = json.loads((folder / "config.json").read_text())
    data["text_config"]["num_mtp_layers"] = data["text_config"].pop("num_nextn_predict_layers")
    (folder / "config.json").write_text(json.dumps(data))
    got = load_pretrained(folder)
    assert got.mtp is not None and got.mtp.depth == 1
    assert torch.equal(got.mtp_logits(checks.tokens(9, batch=1))[0], want)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("per_layer_config", {"03": {"query_pre_attn_scalar": 2.0}}, "per_layer_config"),
    ("layer_types", [S, "minimax_m3_sparse", S, F], "minimax_m3_sparse"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("mlp_bias", True, "mlp_bias"),
    ("gating", "per-element", "gating"),
    ("swiglu_limits", [0, -1.0, 0, 0], "negative"),
    ("mlp_layer_types", ["dense", "moe", "sparse", "sparse"], "moe"),
])
def test_what_has_no_equivalent_is_refused_by_name(key: str, value: Any, named: str) -> None:
    hf = T.Step3p7ForConditionalGeneration(_step())
    setattr(hf.config.text_config, key, value)
    with pytest.raises(UnsupportedConfigError, match=named), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_hf(hf)
