"""The multi-token-prediction layer of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (``mtp.*``: ``mtp.fc``,
``mtp.pre_fc_norm_embedding`` / ``_hidden``, ``mtp.layers.0``, ``mtp.norm``; the layout vLLM's
``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py`` read; transformers drops it): loaded from a checkpoint
folder (text model or the Qwen3.5 multimodal wrapper), its logits equal a reference built from
transformers' own modules with the same weights — ``norm(layer(fc([norm_e(embed(t[j+1])); norm_h(h[j])])))``
through transformers' decoder layer, rotary embedding and head — and ``generate(use_mtp=True)``
writes greedy decoding's tokens with fewer forwards once the layer predicts well."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import test_hf_qwen3_5 as qwen3_5  # noqa: E402
import test_hf_qwen3_5_moe as qwen3_5_moe  # noqa: E402
import test_hf_qwen3_next as qwen3_next  # noqa: E402
from test_mtp import _distill  # noqa: E402

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import load_pretrained, save_pretrained  # noqa: E402
from attnzoo.models.mtp import MultiTokenPredictor  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

L, F = "linear_attention", "full_attention"
#: family -> a config maker taking overrides (Qwen3-Next: every layer a MoE, so the MTP layer is one)
MAKERS: dict[str, Callable[..., Any]] = {
    "qwen3_next": lambda **kw: qwen3_next._config(decoder_sparse_step=1, **kw),
    "qwen3_5_text": qwen3_5._config,
    "qwen3_5_moe_text": qwen3_5_moe._config,
}


def _wrapper(**kw: Any) -> Any:
    """The Qwen3.5 multimodal wrapper around the text config ``kw`` (a one-block vision tower)."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, num_position_embeddings=16,
                  out_hidden_size=checks.SMALL["hidden_size"])
    return T.Qwen3_5Config(text_config=qwen3_5._config(**kw).to_dict(), vision_config=vision)


def _checkpoint(folder: Path, family: str, seed: int = 0) -> tuple[Path, Any]:
    """A saved 4-layer model (3 linear, 1 full) with an MTP layer: transformers' model of 5 layers saved,
    its last (full-attention) layer renamed ``mtp.layers.0``, the fc and the three norms added, the config
    cut back to 4 layers (and ``mtp_num_hidden_layers`` / ``num_nextn_predict_layers`` 1, as released).
    Returns the folder and the 5-layer model (its layer 4: the MTP layer's reference)."""
    kinds = [L, L, L, F, F]
    config = _wrapper(num_hidden_layers=5, layer_types=kinds) if family == "qwen3_5" else \
        MAKERS[family](num_hidden_layers=5, layer_types=kinds)
    big = checks.hf_model(config, seed=seed)
    big.save_pretrained(folder)
    g = torch.Generator().manual_seed(seed + 1)
    path = folder / "model.safetensors"
    tensors = {}
    for key, value in safetensors_torch.load_file(str(path)).items():
        head, sep, rest = key.partition("layers.4.")
        tensors[f"mtp.layers.0.{rest}" if sep and "visual" not in head else key] = value
    C = checks.SMALL["hidden_size"]
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = 0.1 * torch.randn(C, generator=g)
    tensors["mtp.fc.weight"] = torch.randn(C, 2 * C, generator=g) / 8
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
    data = json.loads((folder / "config.json").read_text())
    text = data.get("text_config", data)
    text.update(num_hidden_layers=4, layer_types=kinds[:4])
    text["num_nextn_predict_layers" if family == "qwen3_next" else "mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(data))
    return folder, big


def _reference(big: Any, folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """The MTP logits ``[B, N - 1, V]`` computed with transformers' modules: the folder's model for the
    hidden states, embedding, rotary embedding and head; ``big``'s layer 4 as the MTP layer."""
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = type(big).from_pretrained(folder).eval()
    text = theirs.model.language_model if hasattr(theirs.model, "language_model") else theirs.model
    layer = (big.model.language_model if hasattr(big.model, "language_model") else big.model).layers[4]
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = type(text.norm)(tensors[f"mtp.{name}.weight"].shape[0], eps=text.norm.eps)
        norms[name].weight.data.copy_(tensors[f"mtp.{name}.weight"])
    with torch.no_grad():
        h = theirs(ids, output_hidden_states=True).hidden_states[-1]  # [B, N, C], after the final norm
        e = text.embed_tokens(ids[:, 1:])
        x = torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h[:, :-1])], -1)
        x = x @ tensors["mtp.fc.weight"].T
        n = x.shape[1]
        pos = torch.arange(1, n + 1)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = layer(x, attention_mask=mask, position_embeddings=text.rotary_emb(x, pos), position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        return theirs.lm_head(norms["norm"](y))


@pytest.mark.parametrize("family", [*MAKERS, "qwen3_5"])
def test_mtp_layer_loads_and_equals_transformers_modules(tmp_path: Path, family: str) -> None:
    folder, big = _checkpoint(tmp_path / family, family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the wrapper's vision tower, dropped
        ours = load_pretrained(folder).eval()
    assert isinstance(ours.mtp, MultiTokenPredictor) and ours.mtp.depth == 1
    assert isinstance(ours.mtp.layers[0].block.ffn, MixtureOfExperts) == (family in ("qwen3_next", "qwen3_5_moe_text"))
    ids = checks.tokens(11, batch=2)
    want = _reference(big, folder, ids)
    with torch.no_grad():
        got = ours.mtp_logits(ids)[0]
    assert want.abs().max() > 0.1 and checks.rel(got, want) <= checks.TOL


def test_use_mtp_on_qwen3_next_writes_greedy_tokens_with_fewer_forwards(tmp_path: Path) -> None:
    """Self-distilled, written back with save_pretrained(like=) and read again: greedy's tokens, fewer
    forwards of the model than tokens (drafts kept; a rejected round also rolls the gated-DeltaNet
    states back)."""
    folder, _ = _checkpoint(tmp_path / "base", "qwen3_next")
    ours = load_pretrained(folder).eval()
    prompts = checks.tokens(6, batch=48, seed=3)
    with torch.no_grad():
        seqs = ours.generate(prompts, 16)
    _distill(ours, seqs)
    save_pretrained(ours, tmp_path / "distilled", like=folder)
    back = load_pretrained(tmp_path / "distilled").eval()
    for a, b in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert a[0] == b[0]  # the 1 + w norms round-trip through w: to the last bit of 1 + w
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=2 ** -22, msg=a[0])
    calls = [0]
    back.blocks[-1].register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    x = prompts[:2]
    with torch.no_grad():
        got = back.generate(x, 16, use_mtp=True)
        fast = calls[0]
        assert torch.equal(got, back.generate(x, 16))
    assert fast < 16


def test_a_checkpoint_without_the_mtp_layer_loads_without(tmp_path: Path) -> None:
    hf = checks.hf_model(qwen3_next._config())
    hf.save_pretrained(tmp_path)
    assert load_pretrained(tmp_path).mtp is None
