"""Round 3 of bad input: options that were accepted silently or failed inside the library.

Each probe must be refused at the boundary with a ``TypeError`` / ``ValueError`` (or the CLI's
one-line exit 2) naming the argument; docs/bad-input.md ("round 3: tools and interop") lists them.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch

from attnzoo.cli import main
from attnzoo.cost import estimate
from attnzoo.functional.softmax.varlen import attention_varlen
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.models.hf.safetensors import read_safetensors
from attnzoo.nn.positional import RotaryEmbedding, ScaledRotaryEmbedding
from attnzoo.nn.rope_scaling import rope_inv_freq, scaled_inv_freq
from attnzoo.variants import build_attention

ORIG = {"original_max_position_embeddings": 16}
SHORT = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4}


@pytest.mark.parametrize(("params", "match"), [
    ({"rope_type": "linear", "factor": 0}, "factor must be a finite positive number, got 0"),
    ({"rope_type": "linear", "factor": float("inf")}, "factor must be a finite positive number"),
    ({"rope_type": "dynamic", "factor": -2.0}, "factor must be a finite positive"),
    ({"rope_type": "yarn", "factor": -4.0, **ORIG}, "'yarn': factor must be a finite positive number, got -4.0"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
     "original_max_position_embeddings must be a finite number > 1, got 0"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0, **ORIG}, "beta_fast must be a finite positive"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0, **ORIG}, "attention_factor"),
    ({"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 1, **SHORT},
     "original_max_position_embeddings must be a finite number > 1, got 1"),
    ({"rope_type": "longrope", "factor": 2.0, **ORIG, "short_factor": [1.0, 0.0, 1.0, 1.0], "long_factor": [1.0] * 4},
     r"short_factor\[1\] must be a finite positive number"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0, **ORIG},
     "high_freq_factor must be > low_freq_factor"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0}, "(rope_theta|base) must be a finite number > 1"),
])
def test_rope_parameters_out_of_range_are_refused_everywhere(params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rope_inv_freq(params, 8, max_position_embeddings=32)
    with pytest.raises(ValueError, match=match):  # the module from_hf builds
        ScaledRotaryEmbedding(8, params, max_position_embeddings=32)
    if params["rope_type"] not in ("dynamic", "longrope") and "rope_theta" not in params:  # MLA: its own base
        with pytest.raises(ValueError, match=match):
            build_attention("mla", 32, 2, rope_scaling=params)


def test_rope_type_errors_and_good_parameters_still_work() -> None:
    with pytest.raises(TypeError, match="factor must be a float"):
        rope_inv_freq({"rope_type": "linear", "factor": "2"}, 8)
    inv, att = rope_inv_freq({"rope_type": "yarn", "factor": 4.0, **ORIG}, 8)
    assert bool(torch.isfinite(inv).all()) and math.isfinite(att) and att > 1
    with pytest.raises(ValueError, match="num_attention_heads must be >= 1, got 0"):
        scaled_inv_freq({"hidden_size": 64, "num_attention_heads": 0})
    with pytest.raises(ValueError, match="scaling_factor must be a finite number >= 1"):
        RotaryEmbedding(8, scaling="linear", scaling_factor=float("inf"))


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("backend", ["auto", "tiled", "reference"])
@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"softcap": True}, TypeError, "softcap must be a float, got bool"),
    ({"return_lse": 1}, TypeError, "return_lse must be a bool, got int"),
    ({"scale": "0.5"}, TypeError, "scale must be a float, got str"),
    ({"scale": 0.0}, ValueError, "scale must be a finite positive number"),
    ({"alibi_slopes": [0.5, 0.25]}, TypeError, "alibi_slopes must be a torch.Tensor, got list"),
    ({"alibi_slopes": torch.ones(2, 1)}, ValueError, r"alibi_slopes must be rank 1 \[Hq\]"),
])
def test_attention_varlen_checks_every_option_on_every_path(kw: dict, error: type, match: str, backend: str,
                                                           requires_grad: bool) -> None:
    q = torch.randn(10, 2, 4, requires_grad=requires_grad)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(error, match=match):
        attention_varlen(q, q, q, cu, cu, backend=backend, **kw)


@pytest.mark.parametrize(("argv", "match"), [
    (["check", "--show-failures", "-1"], "--show-failures: expected an integer >= 0, got -1"),
    (["bench", "--name", ""], "--name: expected a non-empty name without '/'"),
    (["bench", "--name", "a/b"], "--name: expected a non-empty name without '/' (it names a file), got 'a/b'"),
    (["bench", "--name", ".."], "--name: expected a non-empty name"),
    (["arena", "--seeds-top", "-1"], "--seeds-top: expected an integer >= 0, got -1"),
    (["cost", "mla", "--head-dim", "3"], "mla: head_dim must be >= 4, got 3"),
])
def test_cli_refuses_before_any_work(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_bench_output_files_are_checked_before_the_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run.csv").mkdir()  # the CSV's path is a directory: cannot be written
    assert main(["bench", "--out", str(tmp_path), "--name", "run", "--backends", "reference", "--seq-lens", "8",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and "run.csv" in err
    assert not (tmp_path / "run.json").exists()  # nothing was measured or written


def test_cost_streaming_sinks_follow_the_builder() -> None:
    with pytest.raises(ValueError, match=r"global_tokens must be \(0, 1, ..., n - 1\), got \(1, 2\)"):
        estimate("streaming", 100, 64, 4, global_tokens=(1, 2))
    with pytest.raises(ValueError, match=r"got \(1, 2\)"):
        build_attention("streaming", 64, 4, global_tokens=(1, 2))
    assert estimate("streaming", 100, 64, 4, global_tokens=(0, 1), window=8).kv_cache_max_tokens == 2 + 8  # sinks + window (the query's own key comes with the call)


def test_mla_head_dim_below_four_is_refused_by_builder_and_cost() -> None:
    for call in (lambda: build_attention("mla", 24, 8), lambda: estimate("mla", 16, 512, 8, head_dim=3)):
        with pytest.raises(ValueError, match="mla: head_dim must be >= 4, got 3"):
            call()
    assert estimate("mla", 16, 512, 8, head_dim=4).params == sum(
        p.numel() for n, p in build_attention("mla", 512, 8, head_dim=4).named_parameters() if not n.endswith("bias"))


def _safetensors(path: Path, meta: object) -> Path:
    header = json.dumps({"__metadata__": meta, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + torch.ones(2).numpy().tobytes())
    return path


@pytest.mark.parametrize("use_package", [False, None])
@pytest.mark.parametrize("meta", [[1, 2], {"format": 1}, "pt"])
def test_safetensors_metadata_must_be_strings(meta: object, use_package: bool | None, tmp_path: Path) -> None:
    path = _safetensors(tmp_path / "m.safetensors", meta)
    with pytest.raises(CheckpointFormatError, match=r"m\.safetensors"):
        read_safetensors(path, use_package=use_package)
    good = _safetensors(tmp_path / "ok.safetensors", {"format": "pt"})
    assert torch.equal(read_safetensors(good, use_package=use_package)["w"], torch.ones(2))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2", "bert", "vit"])
@pytest.mark.parametrize("key", ["num_attention_heads", "hidden_size"])
def test_a_config_with_zero_heads_or_width_names_the_key(model_type: str, key: str, tmp_path: Path) -> None:
    from attnzoo.interop import load_pretrained

    cfg = {"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 32, "max_position_embeddings": 64,
           "n_embd": 64, "n_head": 4, "n_layer": 1, "n_positions": 64, "image_size": 32, "patch_size": 8,
           "num_channels": 3}
    cfg[{"gpt2": {"num_attention_heads": "n_head", "hidden_size": "n_embd"}}.get(model_type, {}).get(key, key)] = 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointFormatError, match=r"config.json: key '\w+' must be >= 1, got 0"):
        load_pretrained(tmp_path)
