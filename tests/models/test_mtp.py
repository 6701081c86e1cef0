"""Multi-token prediction (``attnzoo.models.mtp``): a DeepSeek-V3 / GLM-4.5 checkpoint's MTP layers
load from its folder and give transformers' ``MtpModel`` logits; ``generate(use_mtp=True)`` writes
greedy decoding's tokens, transformers' ``use_mtp`` tokens with as many forwards of the model, and
its cached drafts are the drafts of a full :meth:`DecoderLM.mtp_logits` (every depth, left padding,
accepted and rejected rounds, a hybrid stack); the pieces refuse bad input by name."""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import attnzoo as az  # noqa: E402
from attnzoo.blocks import TransformerBlock  # noqa: E402
from attnzoo.models import speculative  # noqa: E402
from attnzoo.models.decoder import shared_rotaries  # noqa: E402
from attnzoo.models.hf import load_pretrained, save_pretrained, to_hf  # noqa: E402
from attnzoo.models.mtp import MTPLayer, MultiTokenPredictor  # noqa: E402
from attnzoo.models.parts import DecoderParts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

V, C = 64, 32


# --------------------------------------------------------------------------- checkpoints
def _tiny(family: str, depth: int) -> Any:
    """A tiny transformers model of ``family`` with ``depth`` layers (the MoE from layer 1 on)."""
    common = {"vocab_size": V, "hidden_size": C, "intermediate_size": 64, "moe_intermediate_size": 16,
              "num_attention_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
              "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "num_mtp_layers": 1,
              "max_position_embeddings": 128, "num_hidden_layers": depth}
    if family in ("deepseek_v3", "sarvam_mla"):  # DeepSeek-V3's classes
        config = transformers.AutoConfig.for_model(family, **common, num_key_value_heads=4, kv_lora_rank=16,
                                                   q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    elif family == "ernie4_5_moe":  # the MoE from layer 0: its MTP block is a MoE (layer 0's kind)
        config = transformers.Ernie4_5_MoeConfig(
            vocab_size=V, hidden_size=C, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
            moe_layer_start_index=0, num_hidden_layers=depth, max_position_embeddings=128, num_mtp_layers=1)
    elif family == "mellum":  # sliding / full layers, each kind its RoPE; the MTP layer: sliding, a MoE
        config = transformers.AutoConfig.for_model(
            "mellum", vocab_size=V, hidden_size=C, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, num_hidden_layers=depth,
            layer_types=["sliding_attention", "full_attention"] * (depth // 2) + ["sliding_attention"] * (depth % 2),
            sliding_window=4, max_position_embeddings=128, num_mtp_layers=1)
    else:  # GLM-4.5's classes (glm4_moe, param2moe, sarvam_moe)
        config = transformers.AutoConfig.for_model(family, **common, num_key_value_heads=2, head_dim=8,
                                                   partial_rotary_factor=0.5, use_qk_norm=True)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _checkpoint(folder: Path, family: str, seed: int = 0) -> Path:
    """A 2-layer checkpoint folder with an MTP layer: DeepSeek-V3's layout (``model.layers.2``: a MoE
    decoder layer with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``, ``embed_tokens``) or
    ERNIE-4.5's (``model.mtp_block.0``, ``mtp_emb_norm.0``, ``mtp_hidden_norm.0``, ``mtp_linear_proj.0``)."""
    torch.manual_seed(seed)
    three = _tiny(family, 3).state_dict()
    model = _tiny(family, 2)
    model.load_state_dict({k: v for k, v in three.items() if k in model.state_dict()})
    model.save_pretrained(folder)
    g = torch.Generator().manual_seed(seed)
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    if family == "mellum":  # Qwen3-Next's layout, outside the base model
        tensors.update({k.replace("model.layers.2.", "mtp.layers.0."): v.contiguous() for k, v in three.items()
                        if k.startswith("model.layers.2.")})
        tensors.update({f"mtp.{n}.weight": 1 + 0.1 * torch.randn(C, generator=g)
                        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
        tensors["mtp.fc.weight"] = torch.randn(C, 2 * C, generator=g) / 8
        safetensors_torch.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    if family == "ernie4_5_moe":
        tensors.update({k.replace("model.layers.2.", "model.mtp_block.0."): v.contiguous() for k, v in three.items()
                        if k.startswith("model.layers.2.")})
        tensors.update({f"model.mtp_{n}_norm.0.weight": 1 + 0.1 * torch.randn(C, generator=g) for n in ("emb", "hidden")})
        tensors["model.mtp_linear_proj.0.weight"] = torch.randn(C, 2 * C, generator=g) / 8
        safetensors_torch.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    tensors.update({k: v.contiguous() for k, v in three.items() if k.startswith("model.layers.2.")})
    tensors.update({f"model.layers.2.{n}.weight": 1 + 0.1 * torch.randn(C, generator=g)
                    for n in ("enorm", "hnorm", "shared_head.norm")})
    tensors["model.layers.2.eh_proj.weight"] = torch.randn(C, 2 * C, generator=g) / 8
    tensors["model.layers.2.shared_head.head.weight"] = three["lm_head.weight"].clone()
    tensors["model.layers.2.embed_tokens.weight"] = three["model.embed_tokens.weight"].clone()
    safetensors_torch.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _theirs(folder: Path) -> Any:
    """transformers' model of ``folder``, told where its MTP layer is (its classes name the layer
    index of the released checkpoints, 61 / 92)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    if model.config.model_type not in OWN_NAMES:  # ERNIE's and Mellum's name their MTP keys "mtp" in any checkpoint
        model._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]
    return model


FAMILIES = ["deepseek_v3", "sarvam_mla", "glm4_moe", "param2moe", "sarvam_moe", "ernie4_5_moe", "mellum"]
#: the types whose MTP layers are not DeepSeek-V3's layers.{L} (no copies of the embedding and head)
OWN_NAMES = ("ernie4_5_moe", "mellum")


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_layers_load_and_give_transformers_logits(tmp_path: Path, family: str) -> None:
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    folder = _checkpoint(tmp_path / family, family)
    theirs, ours = _theirs(folder), load_pretrained(folder).eval()
    assert isinstance(ours.mtp, MultiTokenPredictor) and ours.mtp.depth == 1
    assert {k.split(".")[3] for k in ours.state_dict() if k.startswith("mtp.")} == {"enorm", "hnorm", "eh_proj",
                                                                                   "block", "post_norm"}
    assert (ours.mtp.layers[0].post_norm is ours.norm) == (family == "ernie4_5_moe")  # ERNIE's: the final norm
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h = theirs(ids, output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(ours.hidden_states(ids), h, atol=1e-5, rtol=1e-5)
        mtp = MtpModel.from_pretrained(theirs)
        out = mtp.forward_layer(0, h[:, :8], torch.arange(1, 9)[None], MtpCache(config=theirs.config.get_mtp_config()),
                                input_ids=ids[:, 1:])
        want = mtp._project_to_logits(out)  # [1, 8, V]: row j predicts token j + 2
        got = ours.mtp_logits(ids)[0]
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _distill(model: az.DecoderLM, seqs: torch.Tensor, steps: int = 150, everything: bool = False) -> None:
    """Train the MTP layers (the parts around the blocks, or ``everything``) to predict the model's
    own greedy continuations ``seqs``: drafts that are accepted often, so that rounds keep several."""
    for p in model.parameters():
        p.requires_grad_(False)
    train = [p for n, p in model.mtp.named_parameters() if everything or ".block." not in n]
    for p in train:
        p.requires_grad_(True)
    opt = torch.optim.Adam(train, lr=3e-2)
    for _ in range(steps):
        loss = sum(nn.functional.cross_entropy(lg[:, :-1].flatten(0, 1), seqs[:, i + 2:].flatten())
                   for i, lg in enumerate(model.mtp_logits(seqs)))
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    for p in model.parameters():
        p.requires_grad_(False)


@pytest.mark.parametrize("family", FAMILIES)
def test_use_mtp_writes_transformers_tokens_with_as_many_forwards(tmp_path: Path, family: str) -> None:
    """Self-distilled MTP weights (written back with save_pretrained(like=), then read by both):
    the same tokens as transformers' generate(use_mtp=True) and greedy decoding, and the same count
    of the model's forwards, fewer than the tokens (drafts were accepted)."""
    folder = _checkpoint(tmp_path / "base", family)
    ours = load_pretrained(folder).eval()
    prompts = torch.randint(0, V, (48, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        seqs = ours.generate(prompts, 20)
    _distill(ours, seqs)
    with torch.no_grad():  # a fine-tuned head: the MTP layer's copy of it follows (DeepSeek's layout)
        ours.lm_head.weight.mul_(1.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every checkpoint tensor written
        save_pretrained(ours, tmp_path / "distilled", like=folder)
    back = load_pretrained(tmp_path / "distilled").eval()
    saved = safetensors_torch.load_file(str(tmp_path / "distilled" / "model.safetensors"))
    if family not in OWN_NAMES:
        assert torch.equal(saved["model.layers.2.shared_head.head.weight"], back.lm_head.weight)
        assert torch.equal(saved["model.layers.2.embed_tokens.weight"], back.tok_emb.weight)
    for a, b in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]
    theirs = _theirs(tmp_path / "distilled")
    calls = {"ours": 0, "theirs": 0}
    # the model's forwards, counted at its last layer (ERNIE's final norm also closes its MTP layer)
    back.blocks[-1].register_forward_hook(lambda *_: calls.__setitem__("ours", calls["ours"] + 1))
    theirs.model.layers[-1].register_forward_hook(lambda *_: calls.__setitem__("theirs", calls["theirs"] + 1))
    ends = theirs.generation_config.eos_token_id  # the end token(s) transformers' generate stops at (its config's)
    for row in range(3):
        x = prompts[row:row + 1]
        calls.update(ours=0, theirs=0)
        with torch.no_grad():
            want = theirs.generate(x, max_new_tokens=20, do_sample=False, use_mtp=True)
            got = back.generate(x, 20, use_mtp=True, eos_token_id=ends)
        assert torch.equal(got, want)
        assert calls["ours"] == calls["theirs"] < got.shape[1] - x.shape[1], calls  # drafts were kept
        assert torch.equal(got, back.generate(x, 20, eos_token_id=ends))


def test_to_hf_leaves_the_mtp_layers_out_with_a_warning(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "ckpt", "deepseek_v3")
    ours, theirs = load_pretrained(folder).eval(), _theirs(folder)
    with torch.no_grad():
        ours.lm_head.weight.mul_(1.5)
    with pytest.warns(UserWarning, match=r"multi-token-prediction layers \(mtp\.\*\) are not written"):
        to_hf(ours, theirs)
    assert ours.mtp is not None  # given back
    torch.testing.assert_close(theirs.lm_head.weight, ours.lm_head.weight)


def test_a_checkpoint_without_mtp_layers_loads_without(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    _tiny("deepseek_v3", 2).save_pretrained(folder)
    model = load_pretrained(folder)
    assert model.mtp is None and not any(k.startswith("mtp.") for k in model.state_dict())


# --------------------------------------------------------------------------- a model built here
def with_mtp(model: az.DecoderLM, depth: int, attention: str = "mha", seed: int = 0) -> az.DecoderLM:
    """``model`` (a registry-built DecoderLM) with ``depth`` random MTP layers, each around a block
    of ``attention`` built as the model's own."""
    cfg = model.config
    torch.manual_seed(seed)
    own = dataclasses.replace(cfg, attention=attention)
    layers = [MTPLayer(cfg.dim, TransformerBlock(config=az.DecoderLM.block_config(own, shared_rotaries(own))),
                       lambda: nn.RMSNorm(cfg.dim)) for _ in range(depth)]
    out = az.DecoderLM(config=cfg, parts=DecoderParts(mtp=MultiTokenPredictor(layers))).eval()
    missing = out.load_state_dict(model.state_dict(), strict=False).missing_keys
    assert all(k.startswith("mtp.") for k in missing)
    return out


def _model(attention: Any = "mha", depth_mtp: int = 1, mtp_attention: str = "mha", seed: int = 0) -> az.DecoderLM:
    torch.manual_seed(seed)
    base = az.DecoderLM(vocab_size=V, dim=C, depth=2, num_heads=4, max_seq_len=96, attention=attention).eval()
    return with_mtp(base, depth_mtp, mtp_attention, seed + 1)


def _recording(monkeypatch: pytest.MonkeyPatch, model: az.DecoderLM) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """Record every draft logits the MTP drafter computes, with the buffer of tokens and ``F``."""
    seen: list[tuple[torch.Tensor, int, torch.Tensor]] = []
    propose = speculative._Predictor.propose

    def spy(self: Any, gen: Any, k: int) -> int:
        logits: list[torch.Tensor] = []
        hook = model.lm_head.register_forward_hook(lambda _m, _a, out: logits.append(out[:, -1].clone()))
        try:
            k = propose(self, gen, k)
        finally:
            hook.remove()
        for i, lg in enumerate(logits):
            seen.append((gen.tokens[:, :gen.written + i].clone(), i, lg))
        return k

    monkeypatch.setattr(speculative._Predictor, "propose", spy)
    return seen


@pytest.mark.parametrize(("depth", "attention", "distilled"), [(1, "mha", False), (2, "mha", True),
                                                               (3, "mha", False), (2, "gqa", True)])
def test_cached_drafts_are_full_mtp_logits(monkeypatch: pytest.MonkeyPatch, depth: int, attention: str,
                                           distilled: bool) -> None:
    """Each draft's logits (depth i at row F - 1, the drafts before it in the row) equal
    ``mtp_logits`` of the whole row up to it, on left-padded rows, through rounds that accept and
    reject drafts (depths >= 1 truncate the rows that read drafts); the tokens are greedy's."""
    model = _model(attention, depth)
    x = torch.randint(0, V, (3, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, :3] = False
    mask[2, :1] = False
    if distilled:  # on the rows' own continuations and others
        with torch.no_grad():
            seqs = model.generate(torch.cat([x, torch.randint(0, V, (45, 8), generator=torch.Generator().manual_seed(5))]),
                                  24)
        _distill(model, seqs, everything=True)
    seen = _recording(monkeypatch, model)
    with torch.no_grad():
        want = model.generate(x, 24, attention_mask=mask)
        got = model.generate(x, 24, attention_mask=mask, use_mtp=True)
        assert torch.equal(got, want)
        assert {i for _, i, _ in seen} == set(range(depth))
        for tokens, i, logits in seen:  # depth i's draft: its last row, over the tokens and drafts before it
            full = model.mtp_logits(tokens, attention_mask=torch.cat(
                [mask, mask.new_ones(3, tokens.shape[1] - 8)], 1))[i]  # [B, L - 1 - i, V]
            torch.testing.assert_close(logits, full[:, -1], atol=1e-4, rtol=1e-4)
    if distilled:  # rounds kept drafts: fewer forwards of the model than tokens
        calls = []
        model.norm.register_forward_hook(lambda *_: calls.append(1))
        with torch.no_grad():
            model.generate(x, 24, attention_mask=mask, use_mtp=True)
        assert len(calls) < 20


def test_a_hybrid_feeds_back_its_accepted_tokens_with_the_next_drafts() -> None:
    """A gated-DeltaNet/softmax stack with an untrained MTP layer (nearly every draft rejected): the
    rolled-back states take the accepted tokens again inside the next round's forward (a backlog of at
    most k + 1 tokens), not in a forward of their own: fewer than 1.5 forwards a token (2 a token when
    each rejected round fed its tokens again alone), greedy's tokens."""
    model = _model(["gated_deltanet", "mha"], 1)
    x = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(6))
    calls = [0]
    model.blocks[-1].register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    with torch.no_grad():
        got = model.generate(x, 24, use_mtp=True)
        assert calls[0] < 1.5 * 24, calls
        assert torch.equal(got, model.generate(x, 24))


def test_use_mtp_on_a_hybrid_stack_and_a_recurrent_mtp_block() -> None:
    """A gated-DeltaNet/softmax stack (its states rolled back, not truncated) with an MTP layer around a
    gated-DeltaNet block (depth 1 never takes rows back): greedy's tokens; two such depths are refused."""
    model = _model(["gated_deltanet", "mha"], 1, "gated_deltanet")
    x = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(model.generate(x, 16, use_mtp=True), model.generate(x, 16))
    two = _model(["gated_deltanet", "mha"], 2, "gated_deltanet")
    with pytest.raises(TypeError, match="use_mtp with 2 depths truncates"):
        two.generate(x, 4, use_mtp=True)


def test_mtp_sampling_returns_rows_with_a_seed() -> None:
    model = _model("mha", 2)
    x = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(7))
    kw = {"temperature": 0.8, "top_k": 20, "num_return_sequences": 2, "use_mtp": True}
    with torch.no_grad():
        a = model.generate(x, 8, generator=torch.Generator().manual_seed(1), **kw)
        b = model.generate(x, 8, generator=torch.Generator().manual_seed(1), **kw)
    assert a.shape == (4, 14) and torch.equal(a, b)


def test_hidden_states_are_what_the_head_reads() -> None:
    model = _model(["gated_deltanet", "mha"])
    x = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(model.hidden_states(x)), model(x))
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        torch.testing.assert_close(model.lm_head(model.hidden_states(x[:1], cu_seqlens=cu)), model(x[:1], cu_seqlens=cu))


def test_mtp_layers_kept_in_another_dtype_than_the_model() -> None:
    """A bfloat16 model whose MTP layers stay float32: their inputs are cast to their dtype, their
    outputs to the head's; the drafts verified by the bfloat16 model give its greedy tokens."""
    model = _model("mha", 2).to(torch.bfloat16)
    model.mtp.float()
    x = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        h = model.hidden_states(x)
        got = model.mtp_logits(x, hidden=h)
        want = model.lm_head(model.mtp.layers[0](model.tok_emb(x[:, 1:]).float(), h[:, :6].float(),
                                                 positions=torch.arange(1, 7).expand(2, 6)).bfloat16())
        assert [t.dtype for t in got] == [torch.bfloat16] * 2 and torch.equal(got[0], want)
        assert torch.equal(model.generate(x, 12, use_mtp=True), model.generate(x, 12))


def test_mtp_logits_rows_and_their_targets() -> None:
    model = _model("mha", 3)
    x = torch.randint(0, V, (2, 5))
    out = model.mtp_logits(x)
    assert [tuple(t.shape) for t in out] == [(2, 4, V), (2, 3, V), (2, 2, V)]
    assert [tuple(t.shape) for t in model.mtp_logits(x[:, :2])] == [(2, 1, V), (2, 0, V), (2, 0, V)]


# --------------------------------------------------------------------------- bad input
def test_bad_input_is_refused_by_name() -> None:
    plain = az.DecoderLM(vocab_size=V, dim=C, depth=1, num_heads=4).eval()
    model = _model("mha", 1)
    x = torch.randint(0, V, (1, 4))
    with pytest.raises(ValueError, match="use_mtp=True drafts with the model's multi-token-prediction layers"):
        plain.generate(x, 3, use_mtp=True)
    with pytest.raises(ValueError, match="has no multi-token-prediction layers"):
        plain.mtp_logits(x)
    with pytest.raises(TypeError, match="use_mtp"):
        model.generate(x, 3, use_mtp="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens and use_mtp are 2 ways of drafting"):
        model.generate(x, 3, use_mtp=True, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match="num_beams must be 1"):
        model.generate(x, 3, use_mtp=True, num_beams=2)
    with pytest.raises(TypeError, match="block must be a decoder block"):
        MTPLayer(C, nn.Linear(C, C), lambda: nn.RMSNorm(C))
    with pytest.raises(TypeError, match="norm must be a callable"):
        MTPLayer(C, model.mtp.layers[0].block, nn.RMSNorm(C))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layers must be a non-empty list of MTPLayer"):
        MultiTokenPredictor([])
    with pytest.raises(TypeError, match="mtp must be a MultiTokenPredictor"):
        DecoderParts(mtp=nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention_mask"):
        model.mtp_logits(x, attention_mask=torch.ones(1, 3, dtype=torch.bool))


def test_an_mtp_checkpoint_copies_to_a_new_folder(tmp_path: Path) -> None:
    """The folder's files beside the weights (config, generation config) travel with save_pretrained."""
    folder = _checkpoint(tmp_path / "a", "glm4_moe")
    model = load_pretrained(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_pretrained(model, tmp_path / "b", like=folder)
    assert (tmp_path / "b" / "config.json").exists()
    shutil.rmtree(tmp_path / "a")
    assert load_pretrained(tmp_path / "b").mtp is not None


def test_a_generation_config_that_turns_on_mtp(tmp_path: Path) -> None:
    """``use_mtp`` in a checkpoint's generation config is not passed on (drafting does not change the
    tokens, and a model converted from transformers has no MTP layers); the tokens are transformers'."""
    import json

    from attnzoo.interop import from_hf
    from attnzoo.models.hf import generation_settings

    folder = _checkpoint(tmp_path / "ckpt", "deepseek_v3")
    (folder / "generation_config.json").write_text(json.dumps({"use_mtp": True, "eos_token_id": V - 1}))
    settings = generation_settings(folder)
    assert settings == {"eos_token_id": V - 1}  # not passed on: a conversion from transformers has no MTP layers
    x = torch.randint(0, V - 1, (1, 7), generator=torch.Generator().manual_seed(9))
    theirs = _theirs(folder)
    calls = []
    theirs.lm_head.register_forward_hook(lambda *_: calls.append(1))  # the MTP layer's head too
    with torch.no_grad():
        want = theirs.generate(x, max_new_tokens=10, min_new_tokens=10)
        ours = load_pretrained(folder).eval()
        assert torch.equal(ours.generate(x, 10, **settings), want)
        assert torch.equal(ours.generate(x, 10, use_mtp=True, **settings), want)
        assert torch.equal(from_hf(theirs).generate(x, 10, **settings), want)  # no MTP layers: nothing refused
    assert len(calls) > 10  # transformers drafted with its MTP layer: more heads than tokens


def test_the_config_bounds_the_mtp_layers_loaded(tmp_path: Path) -> None:
    """A checkpoint holding more MTP layers than its config's ``num_nextn_predict_layers`` loads as many
    as the config says (transformers' use_mtp reads that many); the rest are dropped."""
    import json

    folder = _checkpoint(tmp_path / "ckpt", "deepseek_v3")
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    tensors.update({k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items()
                    if k.startswith("model.layers.2.")})
    safetensors_torch.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert load_pretrained(folder).mtp.depth == 1  # the config's num_nextn_predict_layers (num_mtp_layers): 1
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    assert load_pretrained(folder).mtp.depth == 2


def test_widths_are_checked() -> None:
    model = _model("mha", 1)
    narrow = MTPLayer(16, TransformerBlock(16, 4), lambda: nn.RMSNorm(16))
    with pytest.raises(ValueError, match="block has width 32, the layer's dim is 16"):
        MTPLayer(16, model.mtp.layers[0].block, lambda: nn.RMSNorm(16))
    with pytest.raises(ValueError, match=r"parts\.mtp has layers of width 16, the model's dim is 32"):
        az.DecoderLM(vocab_size=V, dim=C, depth=1, num_heads=4, parts=DecoderParts(mtp=MultiTokenPredictor([narrow])))
    x = torch.randint(0, V, (1, 5))
    with pytest.raises(ValueError, match="hidden must be the floating hidden states"):
        model.mtp_logits(x, hidden=torch.zeros(1, 5, C, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[1, 5, 32\]"):
        model.mtp_logits(x, hidden=torch.zeros(1, 4, C))


def test_hidden_first_reads_the_halves_swapped() -> None:
    """``MTPLayer(hidden_first=True)`` (Inkling's order) equals the default layer whose projection
    columns are swapped: the same output for the same weights."""
    model = _model("mha", 1)
    layer = model.mtp.layers[0]
    swapped = MTPLayer(C, layer.block, lambda: nn.RMSNorm(C), hidden_first=True)
    swapped.load_state_dict(layer.state_dict())
    with torch.no_grad():
        swapped.eh_proj.weight.copy_(torch.cat([layer.eh_proj.weight[:, C:], layer.eh_proj.weight[:, :C]], dim=1))
        e, h = torch.randn(2, 5, C), torch.randn(2, 5, C)
        pos = torch.arange(1, 6).expand(2, 5)
        torch.testing.assert_close(swapped(e, h, positions=pos), layer(e, h, positions=pos))
        assert not torch.allclose(MTPLayer(C, layer.block, lambda: nn.RMSNorm(C), hidden_first=True)(
            e, h, positions=pos), layer(e, h, positions=pos))
