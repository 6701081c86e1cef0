"""Checks every Hugging Face **vision** family passes against transformers (used by the
``test_hf_<family>.py`` modules of the vision families): the token features of the base model
(``last_hidden_state``), the model's output (``pooler_output`` of a base model, ``logits`` of a
classifier, ``image_embeds`` of a projection model) at the training size and at another size
(interpolated positions where the family has them), a saved folder through ``load_pretrained``,
bfloat16 no worse than transformers' own, and ``to_hf``.

A family's model is random-initialised offline from a tiny config, then every weight is perturbed
(:func:`hf_family_checks.perturbed`) so that norms and layer scales are not identities."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import attnzoo as az
from attnzoo.interop import from_hf, load_pretrained
from hf_encoder_checks import check_to_hf, hf_encoder
from hf_family_checks import rel

TOL = 1e-5
#: the test modules of the vision families, each with its ``VISION_SWEEP`` (model_type -> maker of seed)
MODULES = ("test_hf_dinov2", "test_hf_siglip", "test_hf_clip")
hf_vision = hf_encoder  # the same recipe: built offline in eager attention, every weight perturbed


def sweep() -> dict[str, Callable[[int], Any]]:
    """Every vision ``model_type`` -> a maker of its transformers model (``seed`` -> model): the
    ``VISION_SWEEP`` of each family test module present (a family missing from it is caught by
    ``test_hf_export.test_every_converted_model_type_is_swept``)."""
    out: dict[str, Callable[[int], Any]] = {}
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        out.update(module.VISION_SWEEP)
    return out


def pixels(size: int | tuple[int, int] = 32, batch: int = 2, channels: int = 3, seed: int = 1) -> torch.Tensor:
    """``[batch, channels, H, W]`` seeded normal pixels."""
    h, w = (size, size) if isinstance(size, int) else size
    return torch.randn(batch, channels, h, w, generator=torch.Generator().manual_seed(seed))


def hf_outputs(hf: Any, images: torch.Tensor, **kw: Any) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(last_hidden_state or None, output)``: the output is ``logits``, else ``image_embeds``, else
    ``pooler_output`` (what :meth:`attnzoo.VisionTransformer.forward` returns for that class)."""
    with torch.no_grad():
        r = hf(pixel_values=images, **kw)
    out = next(getattr(r, k) for k in ("logits", "image_embeds", "pooler_output") if getattr(r, k, None) is not None)
    return getattr(r, "last_hidden_state", None), out


def check_vision(hf: Any, size: int | tuple[int, int] = 32, **kw: Any) -> float:
    """``from_hf(hf)`` gives transformers' features (``forward_features``) and output (``forward``)
    on ``size`` images (``kw``: e.g. ``interpolate_pos_encoding=True`` for another size); returns
    the max relative error."""
    ours = from_hf(hf)
    assert isinstance(ours, az.VisionTransformer)
    images = pixels(size, channels=ours.in_channels)
    want_hidden, want = hf_outputs(hf, images, **kw)
    with torch.no_grad():
        err = rel(ours(images), want)
        if want_hidden is not None:  # a base model's (a classifier's output holds no final features)
            err = max(err, rel(ours.forward_features(images), want_hidden))
    assert err <= TOL, err
    return err


def check_folder(hf: Any, tmp_path: Path) -> None:
    """``hf.save_pretrained`` -> ``load_pretrained`` gives the same output."""
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    images = pixels(channels=model.in_channels)
    with torch.no_grad():
        assert rel(model(images), hf_outputs(hf, images)[1]) <= TOL


def check_half(hf: Any, dtype: torch.dtype = torch.bfloat16, slack: float = 2.0) -> None:
    """In ``dtype`` our output is no further from the float64 model than transformers' own in
    ``dtype`` (times ``slack``, plus one ``dtype`` epsilon)."""
    images = pixels()
    ref = hf_outputs(hf.to(torch.float64), images.double())[1]
    ours = from_hf(hf, dtype=dtype)
    theirs = hf.to(dtype)
    with torch.no_grad():
        ours_err = rel(ours(images.to(dtype)).double(), ref)
        their_err = rel(hf_outputs(theirs, images.to(dtype))[1].double(), ref)
    hf.float()
    assert ours_err <= slack * their_err + torch.finfo(dtype).eps, (ours_err, their_err)


class VisionChecks:
    """The checks of a vision family as test methods: a test module declares
    ``class TestFamily(VisionChecks): config = staticmethod(make_config)``, ``classes`` (the
    transformers classes converted: base, classifier, projection ...), ``size`` (the config's image
    size) and ``other_size`` (a second size, or ``None`` where the family has fixed positions) with
    ``other_kw`` (e.g. ``{"interpolate_pos_encoding": True}``); ``cases``: more configs."""

    config: Callable[[], Any]
    classes: tuple[Any, ...]
    cases: tuple[Callable[[], Any], ...] = ()
    size: int | tuple[int, int] = 32
    other_size: int | tuple[int, int] | None = None
    other_kw: dict[str, Any] = {}  # noqa: RUF012 (read only)

    def test_features_and_outputs_equal_transformers(self) -> None:
        for make in (self.config, *self.cases):
            for cls in self.classes:
                check_vision(hf_vision(make(), cls), self.size)

    def test_another_image_size(self) -> None:
        if self.other_size is not None:
            check_vision(hf_vision(self.config(), self.classes[0]), self.other_size, **self.other_kw)

    def test_saved_folder_loads(self, tmp_path: Path) -> None:
        for i, cls in enumerate(self.classes):
            check_folder(hf_vision(self.config(), cls), tmp_path / str(i))

    def test_to_hf_writes_the_weights_back(self) -> None:
        for cls in self.classes:
            check_to_hf(lambda seed, cls=cls: hf_vision(self.config(), cls, seed))

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
    def test_half_precision_no_worse_than_transformers(self, dtype: torch.dtype) -> None:
        check_half(hf_vision(self.config(), self.classes[0]), dtype)
