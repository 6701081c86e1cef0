"""``VisionTransformer(parts=ViTParts(...))``: given modules are used as they are and give the same
model as the config's own when they are the same modules; bad parts are refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import attnzoo as az
from attnzoo.models import ViTConfig, ViTParts

CFG = ViTConfig(16, 4, 3, 5, 32, 2, 4, pooler=True)


class _Patches(nn.Module):
    """The default path's embedding as one part (the same weights)."""

    def __init__(self, ref: az.VisionTransformer) -> None:
        super().__init__()
        self.ref = ref

    def forward(self, images: Tensor) -> Tensor:
        x = self.ref.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.ref.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        return x + self.ref.position_embeddings(*self.ref.grid)


class _Head(nn.Module):
    def __init__(self, ref: az.VisionTransformer) -> None:
        super().__init__()
        self.ref = ref

    def forward(self, features: Tensor) -> Tensor:
        assert self.ref.head is not None
        return self.ref.head(self.ref.pool_features(features))


def test_given_parts_are_used_as_they_are() -> None:
    torch.manual_seed(0)
    ref = az.VisionTransformer(config=CFG).eval()
    ours = az.VisionTransformer(config=CFG, parts=ViTParts(embedding=_Patches(ref), blocks=list(ref.blocks),
                                                          norm=ref.norm, head=_Head(ref))).eval()
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_features(images), ref.forward_features(images), rtol=0, atol=0)
        torch.testing.assert_close(ours(images), ref(images), rtol=0, atol=0)
    assert ours.patch_embed is None and ours.pos_embed is None and ours.pooler is None
    assert ours.blocks[1] is ref.blocks[1]
    assert not any(k.startswith("pooler") for k in ours.state_dict())


def test_given_blocks_may_hold_their_own_head_widths() -> None:
    with pytest.raises(ValueError, match=r"dim \(30\) must be divisible by num_heads \(4\)"):
        az.VisionTransformer(config=ViTConfig(16, 4, 3, 0, 30, 1, 4))
    vit = az.VisionTransformer(config=ViTConfig(16, 4, 3, 0, 30, 1, 4), parts=ViTParts(blocks=[nn.Identity()]))
    assert vit(torch.randn(1, 3, 16, 16)).shape == (1, 30)


def test_bad_parts_are_refused() -> None:
    with pytest.raises(TypeError, match="parts must be a ViTParts"):
        az.VisionTransformer(config=CFG, parts={"head": None})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ViTParts: head must be an nn"):
        ViTParts(head="linear")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"depth=2 nn\.Module entries"):
        az.VisionTransformer(config=CFG, parts=ViTParts(blocks=[nn.Identity()]))
