"""Checks every Hugging Face **encoder** family passes against transformers (used by the
``test_hf_<family>.py`` modules of the encoder families): hidden states of the base model on a
padded batch (right- and left-padded rows), the masked-LM and sequence-classification heads, mean-
pooled sentence embeddings, a saved folder through ``load_pretrained`` (also with the config's
defaults left out), and half precision no worse than transformers' own.

A family's model is random-initialised offline from a tiny config, then every weight is perturbed
(:func:`hf_family_checks.perturbed`) so that norms are not identities."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import attnzoo as az
from attnzoo.interop import from_hf, load_pretrained, to_hf
from hf_family_checks import V, perturbed, rel

TOL = 1e-5
#: the test modules of the encoder families, each with its ``SWEEP`` (model_type -> maker of seed)
MODULES = ("test_hf_roberta", "test_hf_bert_kin", "test_hf_modernbert", "test_hf_deberta", "test_hf_mpnet",
           "test_hf_t5_encoder", "test_hf_rope_bert", "test_hf_clip")
#: the pad token id of the checks' configs (RoBERTa's ``padding_idx``; BERT's 0 would do as well)
PAD = 1


def hf_encoder(config: Any, model_class: Any, seed: int = 0, **kw: Any) -> Any:
    """``model_class`` (e.g. ``transformers.RobertaModel``) built offline from ``config`` in eager
    attention, every weight perturbed."""
    torch.manual_seed(seed)
    return perturbed(model_class._from_config(config, attn_implementation="eager", **kw), seed)


def sweep() -> dict[str, Callable[[int], Any]]:
    """Every encoder ``model_type`` -> a maker of its transformers model (``seed`` -> model): the
    ``SWEEP`` of each family test module (BERT's is in ``test_hf_export``)."""
    out: dict[str, Callable[[int], Any]] = {}
    for name in MODULES:
        out.update(importlib.import_module(name).SWEEP)
    return out


def batch(n: int = 12, pad: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [3, n], mask [3, n])``: row 0 right-padded by ``pad`` (the tokenizers' default),
    row 1 left-padded by ``pad``, row 2 full; padded slots hold :data:`PAD`."""
    x = torch.randint(3, V, (3, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(x)
    mask[0, n - pad:] = 0
    mask[1, :pad] = 0
    return x.masked_fill(mask == 0, PAD), mask


def real_rel(ours: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    """:func:`rel` over the real (unpadded) tokens of ``[B, N, *]`` outputs."""
    keep = mask.bool()
    return rel(ours[keep].float(), ref[keep].float())


def hf_hidden(hf: Any, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=x, attention_mask=mask).last_hidden_state


def check_hidden(hf: Any, n: int = 12) -> float:
    """``from_hf(hf)`` (a base encoder) returns transformers' ``last_hidden_state`` at every real
    token of a padded batch; returns the max relative error."""
    ours = from_hf(hf)
    assert isinstance(ours, az.TransformerEncoder)
    x, mask = batch(n)
    with torch.no_grad():
        err = real_rel(ours(x, attention_mask=mask), hf_hidden(hf, x, mask), mask)
    assert err <= TOL, err
    return err


def check_head(hf: Any, n: int = 12) -> float:
    """A ``*ForMaskedLM`` model: ``ours.mlm_logits(ours(x))`` equals its logits at real tokens; a
    ``*ForSequenceClassification`` model: ``ours.classify(ours(x), mask)`` equals its logits."""
    ours = from_hf(hf)
    x, mask = batch(n)
    per_token = "MaskedLM" in type(hf).__name__
    with torch.no_grad():
        want = hf(input_ids=x, attention_mask=mask).logits
        hidden = ours(x, attention_mask=mask)
        got = ours.mlm_logits(hidden) if per_token else ours.classify(hidden, mask)
    err = real_rel(got, want, mask) if per_token else rel(got, want)
    assert err <= TOL, err
    return err


#: the names the family tests call (one check: the head is read off the model's class)
check_mlm = check_classify = check_head


def check_encode(hf: Any, n: int = 12) -> None:
    """``encode`` (mean over real tokens, L2-normalised) equals sentence-transformers' recipe on
    transformers' hidden states."""
    ours = from_hf(hf)
    x, mask = batch(n)
    ref = hf_hidden(hf, x, mask)
    m = mask[..., None].to(ref.dtype)
    want = torch.nn.functional.normalize((ref * m).sum(1) / m.sum(1), dim=-1)
    with torch.no_grad():
        got = ours.encode(x, mask, normalize=True)
    assert rel(got, want) <= TOL


def check_encode_right_padded(hf: Any, n: int = 12) -> None:
    """On a right-padded batch (as tokenizers pad) ``encode``'s default — packed where the model is
    packable — equals the padded forward (``packed=False``) and runs for every family."""
    ours = from_hf(hf)
    x, mask = batch(n)
    mask[1] = mask[1].flip(0)  # row 1 right-padded too
    x[1] = x[1].flip(0)
    with torch.no_grad():
        want = ours.encode(x, mask, packed=False)
        got = ours.encode(x, mask)
    assert rel(got, want) <= TOL


def check_folder(hf: Any, tmp_path: Path, drop: tuple[str, ...] = ()) -> None:
    """``hf.save_pretrained`` -> ``load_pretrained`` gives the same hidden states, also with the
    config keys ``drop`` left out of ``config.json`` (transformers reads their defaults)."""
    hf.save_pretrained(tmp_path)
    if drop:
        path = tmp_path / "config.json"
        data = json.loads(path.read_text())
        for key in drop:
            data.pop(key, None)
        path.write_text(json.dumps(data))
        hf = type(hf).from_pretrained(tmp_path, attn_implementation="eager").eval()
    model = load_pretrained(tmp_path)
    x, mask = batch()
    with torch.no_grad():
        assert real_rel(model(x, attention_mask=mask), hf_hidden(hf, x, mask), mask) <= TOL


def check_to_hf(make: Callable[[int], Any]) -> None:
    """``to_hf(from_hf(B), A)`` (A, B: ``make(0)``, ``make(1)``, one config, other weights) makes A
    convert to B's parameters exactly."""
    target, source = make(0), make(1)
    ours = from_hf(source)
    assert to_hf(ours, target) is target
    again = from_hf(target).state_dict()
    for name, want in ours.state_dict().items():
        scale = float(want.abs().max()) if want.numel() else 1.0
        torch.testing.assert_close(again[name], want, rtol=0, atol=4e-7 * max(scale, 1.0), msg=name)


def check_half(hf: Any, dtype: torch.dtype = torch.bfloat16, slack: float = 2.0, *, full_rows: bool = False) -> None:
    """In ``dtype`` our hidden states are no further from the float64 model than transformers'
    own in ``dtype`` (times ``slack``, plus a floor of one ``dtype`` epsilon). ``full_rows``: the
    left-padded row made full (a causal text tower, whose float64 transformers reference is NaN on a
    left-padded row: its float32 softmax meets float64's mask minimum as ``-inf``)."""
    x, mask = batch()
    if full_rows:
        mask[1], x[1] = 1, x[2]
    ref = hf_hidden(hf.to(torch.float64), x, mask)
    ours = from_hf(hf, dtype=dtype)
    theirs = hf.to(dtype)
    with torch.no_grad():
        ours_err = real_rel(ours(x, attention_mask=mask).double(), ref, mask)
        their_err = real_rel(hf_hidden(theirs, x, mask).double(), ref, mask)
    hf.float()
    assert ours_err <= slack * their_err + torch.finfo(dtype).eps, (ours_err, their_err)


class EncoderChecks:
    """The checks of an encoder family as test methods: a test module declares
    ``class TestFamily(EncoderChecks): config = staticmethod(make_config)``, ``base`` (the
    ``*Model`` class), and ``mlm`` / ``classifier`` (``*ForMaskedLM`` / ``*ForSequenceClassification``,
    ``None`` where the family has none); ``cases``: more configs whose hidden states are checked;
    ``drop``: config keys whose defaults ``load_pretrained`` must know."""

    config: Callable[[], Any]
    base: Any
    mlm: Any = None
    classifier: Any = None
    cases: tuple[Callable[[], Any], ...] = ()
    drop: tuple[str, ...] = ()
    half_full_rows = False

    def test_hidden_states_equal_transformers(self) -> None:
        for make in (self.config, *self.cases):
            check_hidden(hf_encoder(make(), self.base))

    def test_masked_lm_head(self) -> None:
        if self.mlm is not None:
            check_head(hf_encoder(self.config(), self.mlm))

    def test_sequence_classifier(self) -> None:
        if self.classifier is not None:
            cfg = self.config()
            cfg.num_labels = 3
            check_head(hf_encoder(cfg, self.classifier))

    def test_mean_pooled_embeddings(self) -> None:
        check_encode(hf_encoder(self.config(), self.base))
        check_encode_right_padded(hf_encoder(self.config(), self.base))

    def test_saved_folder_loads(self, tmp_path: Path) -> None:
        check_folder(hf_encoder(self.config(), self.base), tmp_path, self.drop)

    def test_to_hf_writes_the_weights_back(self) -> None:
        for cls in (self.base, self.mlm, self.classifier):
            if cls is not None:
                cfg = self.config()
                cfg.num_labels = 3
                check_to_hf(lambda seed, cfg=cfg, cls=cls: hf_encoder(cfg, cls, seed))

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
    def test_half_precision_no_worse_than_transformers(self, dtype: torch.dtype) -> None:
        check_half(hf_encoder(self.config(), self.base), dtype, full_rows=self.half_full_rows)
