"""attnzoo.viz: capture without changing outputs, mask expressions, pictures that are real PNGs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnzoo as az
from attnzoo import masks as M
from attnzoo.arena import load_arena_model
from attnzoo.arena.runner import _QUICK, _build_model, _signature
from attnzoo.arena.storage import save_checkpoint
from attnzoo.arena.tasks import ShakespeareTask
from attnzoo.viz import (
    capture_attention,
    load_model,
    mask_to_text,
    parse_mask,
    plot_attention,
    plot_mask,
    plot_positional,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path: Path, min_bytes: int = 8_000) -> bool:
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and len(data) >= min_bytes


# ----------------------------------------------------------------------------- capture
def test_capture_equals_return_weights_and_keeps_the_output() -> None:
    torch.manual_seed(0)
    m = az.MultiHeadAttention(32, 4, causal=True).eval()
    x = torch.randn(2, 9, 32)
    before = m(x)
    _, w_direct = m(x, return_weights=True)
    with capture_attention(m) as cap:
        during = m(x)
    assert torch.equal(before, during)
    assert cap.layers == ["MultiHeadAttention"] and len(cap.maps["MultiHeadAttention"]) == 1
    torch.testing.assert_close(cap[0], w_direct, rtol=0, atol=1e-6)
    assert "forward" not in m.__dict__  # the wrapper is gone after the block


def test_capture_a_decoder_by_layer_and_head() -> None:
    torch.manual_seed(0)
    model = az.DecoderLM(50, 32, 3, 4).eval()
    tokens = torch.randint(0, 50, (2, 12))
    before = model(tokens)
    with torch.no_grad(), capture_attention(model) as cap:
        during = model(tokens)
    assert torch.equal(before, during)
    assert len(cap.layers) == 3
    w = cap.stacked()  # [L, B, H, N, N]
    assert w.shape == (3, 2, 4, 12, 12)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 2, 4, 12))  # rows are distributions
    assert float(torch.triu(w, diagonal=1).abs().max()) == 0.0  # causal: nothing above the diagonal


def test_capture_while_decoding_records_every_step() -> None:
    torch.manual_seed(0)
    model = az.DecoderLM(50, 32, 2, 4).eval()
    tokens = torch.randint(0, 50, (1, 6))
    full = model(tokens)
    cache = model.init_cache(1, 6)
    with torch.no_grad(), capture_attention(model) as cap:
        steps = [model(tokens[:, i:i + 1], cache=cache) for i in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
    first = cap.maps[cap.layers[0]]
    assert len(first) == 6 and first[-1].shape[-1] == 6  # the last step sees 6 keys


def test_capture_rejects_non_modules() -> None:
    with pytest.raises(TypeError, match="model"), capture_attention("not a model"):  # type: ignore[arg-type]
        pass


# ----------------------------------------------------------------------------- masks
@pytest.mark.parametrize(
    ("expr", "mask"),
    [
        ("causal", M.causal()),
        ("causal & window(4,0)", M.causal() & M.sliding_window(4, 0)),
        ("window(2, None)", M.sliding_window(2, None)),
        ("causal & (window(3,0) | global(0, 5))", M.causal() & (M.sliding_window(3, 0) | M.global_tokens([0, 5]))),
        ("prefix_lm(4)", M.prefix_lm(4)),
        ("~causal", ~M.causal()),
        ("document(5, 7) & causal", M.document(torch.tensor([0] * 5 + [1] * 7)) & M.causal()),
    ],
)
def test_parse_mask_equals_the_builders(expr: str, mask: M.Mask) -> None:
    got = parse_mask(expr).materialize(1, 1, 12, 12)
    torch.testing.assert_close(got, mask.materialize(1, 1, 12, 12))


def test_padding_expression_is_per_batch() -> None:
    m = parse_mask("padding(3, 5)")
    torch.testing.assert_close(m.materialize(2, 1, 4, 6), M.key_padding([3, 5]).materialize(2, 1, 4, 6))


@pytest.mark.parametrize(
    "expr",
    ["__import__('os').system('true')", "causal & 3", "window(left=3)", "window(1.5, 0)", "causal +", "",
     "foo(1)", "window(-1, 0)"],
)
def test_parse_mask_rejects(expr: str) -> None:
    with pytest.raises(ValueError, match="mask expression"):
        parse_mask(expr)


@pytest.mark.parametrize(("nq", "nk", "off"), [(16, 16, None), (2, 5, None), (4, 10, 1)])
def test_mask_text_rows_equal_materialize(nq: int, nk: int, off: int | None) -> None:
    m = M.causal() & M.sliding_window(3, 0)
    text = mask_to_text(m, nq, nk, q_offset=off)
    dense = m.materialize(1, 1, nq, nk, q_offset=off)[0, 0]
    rows = [line.split()[1] for line in text.splitlines() if line.strip()[:1].isdigit() and "█" in line + "·"
            and len(line.split()) == 3]
    assert len(rows) == nq
    for i, row in enumerate(rows):
        assert [c == "█" for c in row] == dense[i].tolist()


def test_mask_text_draws_bottom_right_alignment() -> None:
    # Nq=2, Nk=5, causal: the queries sit at positions 3 and 4 (docs/conventions.md)
    text = mask_to_text("causal", 2, 5)
    assert "3  ████·" in text and "4  █████" in text


# ----------------------------------------------------------------------------- pictures
def test_plot_mask_png(tmp_path: Path) -> None:
    p = tmp_path / "mask.png"
    plot_mask("causal & window(4,0)", 16, path=p)
    assert _is_png(p)


def test_plot_attention_png_grid_and_single(tmp_path: Path) -> None:
    w = torch.softmax(torch.randn(2, 4, 6, 6), dim=-1)
    toks = ["The", "cat", "sat", "on", "the", "mat"]
    p = tmp_path / "grid.png"
    plot_attention(w, toks, path=p)
    assert _is_png(p)
    p1 = tmp_path / "one.png"
    plot_attention(w, toks, heads=2, batch=1, path=p1)
    assert _is_png(p1, 4_000)


@pytest.mark.parametrize("kind", ["rope", "all"])
def test_plot_positional_png(tmp_path: Path, kind: str) -> None:
    p = tmp_path / f"{kind}.png"
    plot_positional(kind, n=64, dim=32, heads=4, path=p)
    assert _is_png(p)


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"weights": torch.rand(2, 2, 2, 2, 2)}, ValueError, "weights must be"),
        ({"weights": [[0.5]]}, TypeError, "weights must be"),
        ({"tokens": ["a", "b"]}, ValueError, "tokens"),
        ({"heads": [7]}, ValueError, "heads"),
        ({"batch": 3}, ValueError, "batch"),
    ],
)
def test_plot_attention_bad_input(kwargs, exc, words) -> None:
    args = {"weights": torch.rand(1, 4, 3, 3), **kwargs}
    with pytest.raises(exc, match=words):
        plot_attention(args.pop("weights"), **args)


def test_plot_positional_bad_input() -> None:
    with pytest.raises(ValueError, match="kind"):
        plot_positional("xpos")
    with pytest.raises(ValueError, match="dim"):
        plot_positional("rope", dim=7)


# ----------------------------------------------------------------------------- saved models
@pytest.fixture(scope="module")
def arena_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    s = _QUICK["lm"]
    task = ShakespeareTask(seq_len=s.seq_len)
    model = _build_model(s, "gqa", task.vocab_size, 0, torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path_factory.mktemp("arena") / "lm-gqa.pt"
    save_checkpoint(path, model, opt, 0, {"signature": _signature(s, "gqa", 0, 1), "losses": [], "evals": []})
    return path


def test_load_arena_checkpoint_and_capture(arena_checkpoint: Path) -> None:
    model, tokenize = load_arena_model(arena_checkpoint)
    ids, labels = tokenize("To be, or not")
    assert ids.shape == (1, 13) and labels[2] == "␣" and labels[5] == ","
    with torch.no_grad(), capture_attention(model) as cap:
        model(ids)
    assert cap[len(cap) - 1].shape[-2:] == (13, 13)


def test_load_model_errors(tmp_path: Path, arena_checkpoint: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError):
        load_arena_model(tmp_path / "missing.pt")
    bad = tmp_path / "bad.pt"
    torch.save({"weights": torch.zeros(1)}, bad)
    with pytest.raises(ValueError, match="arena checkpoint"):
        load_model(bad)  # a file is no model folder: viz points at the arena's loader
    with pytest.raises(ValueError, match="arena checkpoint"):
        load_arena_model(bad)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(arena_checkpoint.read_bytes()[:100])
    with pytest.raises(ValueError, match="cannot be read"):
        load_arena_model(garbage)


def test_viz_imports_no_tool_above_it() -> None:
    import ast

    root = Path(az.viz.__file__).parent
    for f in root.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(("attnzoo.arena", "attnzoo.bench", "attnzoo.cli")), (f, node.module)


def test_mask_drawing_refuses_sizes_beyond_memory() -> None:
    with pytest.raises(ValueError, match="memory"):
        mask_to_text("causal", 10**7)
    with pytest.raises(ValueError, match="memory"):
        plot_mask("causal", 10**7)


@pytest.mark.slow
def test_load_hf_bert_folder_and_capture(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    transformers.BertModel(cfg).save_pretrained(tmp_path)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "the", "cat", "##s", "sat", "."]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab + [f"w{i}" for i in range(30 - len(vocab))]) + "\n")
    model, tokenize = load_model(tmp_path)
    ids, labels = tokenize("hello the cats sat.")
    assert labels == ["[CLS]", "hello", "the", "cat", "##s", "sat", ".", "[SEP]"]
    with torch.no_grad(), capture_attention(model) as cap:
        model(ids)
    assert len(cap) == 2 and cap[0].shape == (1, 4, 8, 8)


def test_alibi_picture_refuses_sizes_beyond_memory() -> None:
    with pytest.raises(ValueError, match="memory"):
        plot_positional("alibi", n=10**7)


def test_a_call_without_weights_does_not_leave_an_older_map_as_the_latest() -> None:
    """A StreamingLLM cached step gives no weights (recorded in ``skipped``), but ``cap[0]`` kept
    returning the full forward's map as if it were the latest call's."""
    torch.manual_seed(0)
    m = az.StreamingAttention(32, 4, window=6, sink_tokens=2).eval()
    x = torch.randn(1, 12, 32)
    with torch.no_grad(), capture_attention(m) as cap:
        m(x)
        assert cap[0].shape == (1, 4, 12, 12)
        m(x[:, :1], cache=m.init_cache(1, 12))
        with pytest.raises(KeyError, match="latest call of layer 'StreamingAttention' gave no attention weights"):
            cap[0]
        assert len(cap.maps["StreamingAttention"]) == 1  # the earlier map is still there
        m(x)  # a call with weights makes its map the latest again
        assert cap[0].shape == (1, 4, 12, 12)


def test_a_model_folder_without_tokenizer_files_is_named(tmp_path: Path) -> None:
    """A folder with weights but no tokenizer raised transformers' own error, naming no file of ours."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"has no tokenizer attnzoo can read \(vocab.txt, or tokenizer.json"):
        load_model(tmp_path)
