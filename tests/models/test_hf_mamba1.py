"""Mamba (``MambaForCausalLM``) and FalconMamba (``FalconMambaForCausalLM``) through ``from_hf``:
mixer-only layers of the selective scan (the family-local ``Mamba1Mixer`` on
``gated_linear_attention``); FalconMamba's weightless RMSNorms on dt, B and C; equal to
transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {k: v for k, v in checks.SMALL.items() if k not in ("num_attention_heads", "num_key_value_heads",
                                                            "intermediate_size", "max_position_embeddings")}


def _mamba(**kw: Any) -> Any:
    """hidden 64, inner 128, state 8, dt rank 4 ("auto"), kernel 4, conv biases, tied."""
    return T.MambaConfig(**{**SMALL, "num_hidden_layers": 3, "state_size": 8, "expand": 2, "conv_kernel": 4, **kw})


def _mamba_untied(**kw: Any) -> Any:
    """hidden 32, no conv bias, in/out projection biases, kernel 3, dt rank 6, eps 1e-6, untied."""
    return T.MambaConfig(**{**SMALL, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8, "expand": 2,
                            "conv_kernel": 3, "use_conv_bias": False, "use_bias": True, "time_step_rank": 6,
                            "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False, **kw})


def _falcon(**kw: Any) -> Any:
    return T.FalconMambaConfig(**{**SMALL, "num_hidden_layers": 3, "state_size": 8, "expand": 2, "conv_kernel": 4,
                                  **kw})


def _falcon_untied(**kw: Any) -> Any:
    """hidden 32, no conv bias, kernel 3, mixer_rms_eps 1e-3 (large enough to matter), untied."""
    return T.FalconMambaConfig(**{**SMALL, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8,
                                  "expand": 2, "conv_kernel": 3, "use_conv_bias": False, "mixer_rms_eps": 1e-3,
                                  "tie_word_embeddings": False, **kw})


class TestMamba(checks.FamilyChecks):
    config = staticmethod(_mamba)
    cases = (_mamba_untied,)


class TestFalconMamba(checks.FamilyChecks):
    config = staticmethod(_falcon)
    cases = (_falcon_untied,)


@pytest.mark.parametrize("make", [_mamba, _falcon], ids=["mamba", "falcon_mamba"])
def test_structure(make: Any) -> None:
    from attnzoo.interop import from_hf
    from attnzoo.models.families.mamba1 import Mamba1Mixer

    hf = checks.hf_model(make())
    ours = from_hf(hf)
    assert all(isinstance(b.attn, Mamba1Mixer) and b.ffn is None and b.ffn_norm is None for b in ours.blocks)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    mixer = ours.blocks[0].attn
    assert mixer.in_proj.weight.shape == (256, 64) and mixer.in_proj.bias is None and mixer.out_proj.bias is None
    assert mixer.conv1d.weight.shape == (128, 1, 4) and mixer.conv1d.bias is not None
    assert mixer.x_proj.weight.shape == (4 + 16, 128) and mixer.dt_proj.weight.shape == (128, 4)
    assert mixer.A_log.shape == (128, 8) and mixer.D.shape == (128,)
    assert mixer.mixer_rms_eps == (1e-6 if make is _falcon else None)
    assert ours.tie_embeddings
    cache = ours.init_cache(2, 16)
    assert cache[0].state.shape == (2, 128, 8, 1) and cache[0].conv["conv1d"].shape == (2, 128, 3)
    other = from_hf(checks.hf_model((_mamba_untied if make is _mamba else _falcon_untied)()))
    assert not other.tie_embeddings and other.blocks[0].attn.conv1d.bias is None
    assert other.blocks[0].attn.conv1d.weight.shape == (64, 1, 3)


@pytest.mark.parametrize("make", [_mamba, _falcon], ids=["mamba", "falcon_mamba"])
def test_left_padded_row_equals_row_alone(make: Any) -> None:
    """No projection biases: a padded token feeds zeros and does not touch the state."""
    from attnzoo.interop import from_hf

    ours = from_hf(checks.hf_model(make()))
    x, mask = checks.padded(14, pad=5)
    with torch.no_grad():
        got = ours(x, attention_mask=mask.bool())
        alone = ours(x[:1, 5:])
    assert checks.rel(got[:1, 5:], alone) <= 1e-5


@pytest.mark.parametrize(("key", "value", "named"), [("hidden_act", "gelu", "hidden_act")])
@pytest.mark.parametrize("model_class", ["MambaForCausalLM", "FalconMambaForCausalLM"])
def test_options_it_cannot_reproduce_are_refused(model_class: str, key: str, value: Any, named: str) -> None:
    make = _mamba if model_class == "MambaForCausalLM" else _falcon
    checks.check_refused(getattr(T, model_class), make, key, value, named)


def test_init_only_options_are_accepted() -> None:
    """Options that change only the initialisation or the implementation of the same scan load."""
    checks.check_logits(lambda: _mamba(time_step_scale=2.0, time_step_init_scheme="constant", time_step_min=0.01,
                                       rescale_prenorm_residual=True, use_mambapy=True,
                                       use_associative_scan=False, residual_in_fp32=False), n=12)


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` that leaves out the class's defaults (``state_size``, ``conv_kernel``,
    ``expand``, ``use_conv_bias``, ``tie_word_embeddings``, ``time_step_rank``...) and
    ``intermediate_size`` (then ``expand * hidden_size``): read as transformers reads it."""
    hf = checks.hf_model(_mamba(state_size=16))
    checks.check_folder_without_keys(hf, tmp_path, (
        "state_size", "conv_kernel", "expand", "use_conv_bias", "use_bias", "tie_word_embeddings", "time_step_rank",
        "hidden_act", "layer_norm_epsilon", "intermediate_size"))


@pytest.mark.parametrize("make", [_mamba, _falcon_untied], ids=["mamba", "falcon_mamba"])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


@pytest.mark.parametrize("make", [_mamba_untied, _falcon], ids=["mamba", "falcon_mamba"])
def test_packed_training_gradients_equal_each_alone(make: Any) -> None:
    checks.check_packed_gradients_equal_each_alone(make)


def test_config_sizes_are_read_as_transformers_reads_them() -> None:
    """A stored ``intermediate_size`` wins over ``expand * hidden_size`` and ``time_step_rank`` may be
    ``"auto"`` or a number as a string, as in transformers' config class."""
    from attnzoo.models.families.mamba1 import canonical
    from attnzoo.models.hf._state import HFConfig

    for data in ({"hidden_size": 64, "intermediate_size": 96, "time_step_rank": "auto"},
                 {"hidden_size": 64, "expand": 3, "time_step_rank": "5"}, {"hidden_size": 40}):
        theirs = T.MambaConfig.from_dict(data)
        ours = canonical(HFConfig(data, "test"))
        assert (ours.req("intermediate_size"), ours.req("time_step_rank")) == (
            theirs.intermediate_size, int(theirs.time_step_rank))
