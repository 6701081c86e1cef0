"""attnzoo.cost: analytic FLOPs / memory / cache size against measurements on the real modules."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import attnzoo as az
from attnzoo.cost import estimate, measure_activation_bytes, visible_pairs
from attnzoo.variants import VARIANTS, build_attention, resolve_config

SOFTMAX = [n for n, s in VARIANTS.items() if s.family == "softmax"]
B, N, C, H = 1, 300, 64, 8  # N crosses the tiled backend's 256-row and 128-key blocks


def _cpu_flash(query_shape, key_shape, value_shape, *args, out_shape=None, **kw):
    # FlopCounterMode has no formula for torch's CPU flash kernel; use torch's own SDPA formula.
    return sdpa_flop_count(query_shape, key_shape, value_shape)


_MAPPING = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash}


def _settings(name: str) -> dict:
    return {"window": 40} if name in ("sliding", "local_global") else {}


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
@pytest.mark.parametrize("name", SOFTMAX)
def test_flops_match_flop_counter(name: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # FlopCounterMode counts aten operators: the compiled kernels' sgemm calls are invisible to it, so
    # the count is taken on the PyTorch path (the same computation)
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    torch.manual_seed(0)
    mod = build_attention(name, C, H, backend=backend, **_settings(name)).eval()
    x = torch.randn(B, N, C)
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=_MAPPING) as fc:
        mod(x)
    measured = fc.get_total_flops()
    est = estimate(name, N, C, H, batch=B, backend=backend, **_settings(name))
    assert measured > 0
    assert abs(est.flops - measured) <= 0.05 * measured, (
        f"{name}/{backend}: estimate {est.flops} vs FlopCounterMode {measured} "
        f"({est.flops / measured:.3f}x) [B={B} N={N} C={C} H={H}]")


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
@pytest.mark.parametrize("name", SOFTMAX)
def test_activation_memory_within_25_percent(name: str, backend: str) -> None:
    torch.manual_seed(0)
    mod = build_attention(name, C, H, backend=backend, **_settings(name)).train()
    x = torch.randn(B, N, C)
    measured = measure_activation_bytes(lambda: mod(x), exclude=list(mod.parameters()))
    est = estimate(name, N, C, H, batch=B, backend=backend, **_settings(name))
    assert abs(est.activation_bytes - measured) <= 0.25 * measured, (
        f"{name}/{backend}: predicted {est.activation_bytes} B vs measured {measured} B "
        f"({est.activation_bytes / measured:.2f}x)")


@pytest.mark.parametrize("name", SOFTMAX)
def test_kv_cache_bytes_match_the_module_cache(name: str) -> None:
    mod = build_attention(name, C, H, **_settings(name))
    n = 120
    cache = mod.init_cache(B, n)
    held = cache.nbytes  # the cache protocol's size
    est = estimate(name, n, C, H, batch=B, **_settings(name))
    assert est.kv_cache_bytes == held, f"{name}: estimate {est.kv_cache_bytes} B, cache holds {held} B"


@pytest.mark.parametrize(
    ("name", "kw", "mask"),
    [
        ("mha", {}, lambda n: az.masks.causal()),
        ("mha", {"causal": False}, None),
        ("sliding", {"window": 7}, lambda n: az.masks.causal() & az.masks.sliding_window(7, 0)),
        ("sliding", {"window": (3, 5), "causal": False}, lambda n: az.masks.sliding_window(3, 5)),
        ("local_global", {"window": 4, "global_tokens": (0, 9)},
         lambda n: az.masks.causal() & (az.masks.sliding_window(4, 4) | az.masks.global_tokens([0, 9]))),
        ("local_global", {"window": 4, "global_tokens": (2,), "causal": False},
         lambda n: az.masks.sliding_window(4, 4) | az.masks.global_tokens([2])),
    ],
)
def test_visible_pairs_equal_the_materialised_mask(name, kw, mask) -> None:
    n = 37
    cfg = resolve_config(name, 32, 4, **kw)
    want = n * n if mask is None else int(mask(n).materialize(1, 1, n, n).sum())
    assert visible_pairs(cfg, n) == want


def test_ideal_flops_scale_with_the_window_not_n_squared() -> None:
    a = estimate("sliding", 4096, 256, 4, window=64, backend="ideal")
    b = estimate("sliding", 8192, 256, 4, window=64, backend="ideal")
    assert 1.95 < b.flops_useful / a.flops_useful < 2.05  # O(N W C)
    d1 = estimate("mha", 4096, 256, 4, backend="ideal")
    d2 = estimate("mha", 8192, 256, 4, backend="ideal")
    assert 3.9 < d2.flops_useful / d1.flops_useful < 4.1  # O(N^2 C)


def test_feature_map_state_does_not_grow() -> None:
    a = estimate("linear", 1024, 256, 4)
    b = estimate("linear", 8192, 256, 4)
    assert a.kv_cache_bytes == b.kv_cache_bytes and a.kv_cache_bytes_per_token == 0


def test_as_dict_is_json_ready() -> None:
    import json

    d = estimate("gqa", 128, 64, 8).as_dict()
    assert json.loads(json.dumps(d))["num_kv_heads"] == 2


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"variant": "nope"}, ValueError, "variant"),
        ({"seq_len": 0}, ValueError, "seq_len"),
        ({"seq_len": 3.5}, TypeError, "seq_len"),
        ({"batch": 0}, ValueError, "batch"),
        ({"dtype": "int8"}, ValueError, "dtype"),
        ({"backend": "magic"}, ValueError, "backend"),
        ({"num_kv_heads": 3, "variant": "gqa"}, ValueError, "num_kv_heads"),
        ({"dim": 65}, ValueError, "dim"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
    ],
)
def test_bad_input(kwargs, exc, words) -> None:
    args = {"variant": "mha", "seq_len": 16, "dim": 64, "num_heads": 8, **kwargs}
    with pytest.raises(exc, match=words):
        estimate(args.pop("variant"), args.pop("seq_len"), args.pop("dim"), args.pop("num_heads"), **args)


OTHERS = [("linear", {}), ("performer", {"num_features": 64}), ("infini", {"segment_len": 64})]


@pytest.mark.parametrize(("name", "kw"), OTHERS)
def test_other_families_flops_and_memory(name: str, kw: dict) -> None:
    # a shape unlike the softmax tests: padded last chunk / partial last segment, D = 24
    b, n, c, h = 2, 200, 96, 4
    torch.manual_seed(0)
    mod = build_attention(name, c, h, **kw)
    x = torch.randn(b, n, c)
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=_MAPPING) as fc:
        mod.eval()(x)
    est = estimate(name, n, c, h, batch=b, **kw)
    measured = fc.get_total_flops()
    assert abs(est.flops - measured) <= 0.05 * measured, f"{name}: {est.flops} vs {measured}"
    mod.train()
    act = measure_activation_bytes(lambda: mod(x), exclude=[*mod.parameters(), *mod.buffers()])
    assert abs(est.activation_bytes - act) <= 0.25 * act, f"{name}: {est.activation_bytes} vs {act}"


# ----------------------------------------------------------------------------- options, scale, closed form
@pytest.mark.parametrize(
    ("name", "kw"),
    [("mha", {"window": 8}), ("mqa", {"num_kv_heads": 2}), ("gqa", {"segment_len": 8}), ("linear", {"window": 4}),
     ("linear", {"num_features": 64}), ("performer", {"global_tokens": (0,)}), ("infini", {"chunk_size": 8}),
     ("sliding", {"num_features": 8})],
)
def test_options_that_do_not_apply_raise(name: str, kw: dict) -> None:
    with pytest.raises(ValueError, match="do not apply"):
        estimate(name, 64, 64, 8, **kw)


def test_causal_false_raises_for_a_causal_only_variant() -> None:
    with pytest.raises(ValueError, match="causal=False"):
        estimate("infini", 64, 64, 8, causal=False)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_closed_form_at_a_billion_tokens(name: str) -> None:
    """No tensor of size N (or (N/128)^2) is built: N = 10^9 is answered at once."""
    est = estimate(name, 10**9, 4096, 32, backend="auto")
    assert est.flops > 0 and est.kv_cache_bytes >= 0 and 0 < est.visible_fraction <= 1
    for backend in ("tiled", "flex", "ideal"):
        if name == "sigmoid" and backend == "flex":  # as the module, the estimate refuses what cannot run it
            with pytest.raises(ValueError, match="sigmoid attention runs on backend"):
                estimate(name, 10**9, 4096, 32, backend=backend)
            continue
        assert estimate(name, 10**9, 4096, 32, backend=backend).flops_attention > 0


@pytest.mark.parametrize(
    ("n", "causal", "window", "glob"),
    [(300, True, (40, 0), ()), (700, False, (130, 5), ()), (129, True, None, ()), (1000, True, (3, 0), (0, 500)),
     (513, False, (40, 40), (2, 300, 512)), (256, False, None, ())],
)
def test_block_pairs_equal_counting_the_tiles(n: int, causal: bool, window, glob) -> None:
    """The closed-form tile count equals the non-empty 128 x 128 tiles of the materialised mask."""
    from attnzoo.nn.costs import BLOCK, block_pairs
    from attnzoo.nn.spec import VariantConfig

    cfg = VariantConfig("x", 64, 8, 8, 8, causal, window, glob)
    m = az.masks.causal() if causal else None
    if window is not None:
        w = az.masks.sliding_window(*window)
        w = w | az.masks.global_tokens(list(glob)) if glob else w
        m = w if m is None else m & w
    dense = torch.ones(n, n, dtype=torch.bool) if m is None else m.materialize(1, 1, n, n)[0, 0]
    pairs = tiles = 0
    for i in range(0, n, BLOCK):
        for j in range(0, n, BLOCK):
            tile = dense[i:i + BLOCK, j:j + BLOCK]
            if tile.any():
                tiles, pairs = tiles + 1, pairs + tile.numel()
    assert block_pairs(cfg, n) == (pairs, tiles)
    assert visible_pairs(cfg, n) == int(dense.sum())


def test_stack_estimate_sums_its_layers() -> None:
    """A hybrid stack's cost is the sum of its layers' (each with the settings it takes), cycled to depth."""
    stack = az.cost.estimate_stack("gated_deltanet/gated_deltanet/gated_deltanet/gqa", 2048, 256, 8, depth=8,
                                   num_kv_heads=2, window=None)
    assert stack.pattern == ("gated_deltanet", "gated_deltanet", "gated_deltanet", "gqa") * 2
    gdn = az.cost.estimate("gated_deltanet", 2048, 256, 8)
    gqa = az.cost.estimate("gqa", 2048, 256, 8, num_kv_heads=2)
    for field in ("flops", "flops_backward", "kv_cache_bytes", "params", "kv_cache_bytes_per_token"):
        assert getattr(stack, field) == 6 * getattr(gdn, field) + 2 * getattr(gqa, field), field
    assert stack.as_dict()["pattern"] == "gated_deltanet/gated_deltanet/gated_deltanet/gqa/" * 1 + \
        "gated_deltanet/gated_deltanet/gated_deltanet/gqa"
    with pytest.raises(ValueError, match="estimate_stack"):
        az.cost.estimate("gla/mha", 128, 64, 4)
    with pytest.raises(ValueError, match="unknown attention variant"):
        az.cost.estimate_stack("gla/nope", 128, 64, 4)
    with pytest.raises(TypeError, match="unknown setting"):
        az.cost.estimate_stack("gla/mha", 128, 64, 4, windw=3)


def test_the_auto_backends_calibration_is_not_measured_as_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` times the compiled kernel against SDPA once a process, with gradients for training;
    a measurement whose call ran that calibration counted its saved tensors (33x the module's)."""
    from attnzoo.functional.backends.tiled import native

    if native.native_module() is None:
        pytest.skip("the compiled kernel is not built: auto never calibrates")
    monkeypatch.setattr(native, "_calibrated", {})  # as in a fresh process
    monkeypatch.setenv("ATTNZOO_NATIVE_AUTO", "measure")
    torch.manual_seed(0)
    mod = build_attention("mha", 64, 4).train()
    x = torch.randn(1, 300, 64)
    first = measure_activation_bytes(lambda: mod(x), exclude=list(mod.parameters()))
    assert native._calibrated, "the call did not calibrate: the test no longer tests anything"
    second = measure_activation_bytes(lambda: mod(x), exclude=list(mod.parameters()))
    # equal up to a small tensor (storages are told apart by address, which a freed scalar's may
    # share with another); the timing run added 33x
    assert abs(first - second) <= 0.01 * second, (first, second)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_kv_cache_bytes_equal_the_cache_after_decoding(name: str) -> None:
    """After decoding N tokens one by one the cache holds what the estimate says (Infini had its
    segment counted whole although a full segment is folded into the memory; a streaming cache
    allocated sink + window slots for a stream of fewer tokens)."""
    import inspect

    accepted = inspect.signature(estimate).parameters
    kw = {k: v for k, v in VARIANTS[name].check.items() if k in accepted and name != "nsa"}  # nsa: its own sizes
    torch.manual_seed(0)
    mod = build_attention(name, 32, 4, **kw).eval()
    for n in (5, 21):
        cache = mod.init_cache(2, n)
        with torch.no_grad():
            for _ in range(n):
                mod(torch.randn(2, 1, 32), cache=cache)
        assert estimate(name, n, 32, 4, batch=2, **kw).kv_cache_bytes == cache.nbytes, (name, n, kw)
    if name == "streaming":  # a stream shorter than sink + window allocates only its own slots
        small = build_attention(name, 32, 4, window=64, global_tokens=(0, 1, 2, 3)).init_cache(2, 8)
        assert small.capacity == 8
        assert estimate(name, 8, 32, 4, batch=2, window=64, global_tokens=(0, 1, 2, 3)).kv_cache_bytes == small.nbytes


def test_sigmoid_is_counted_on_the_backend_it_runs() -> None:
    """SigmoidAttention's auto is tiled (it has no SDPA form); the estimate said sdpa and counted N^2."""
    assert estimate("sigmoid", 2048, 64, 4).backend == "tiled"
    assert estimate("sigmoid", 2048, 64, 4).flops_attention == estimate("mha", 2048, 64, 4, backend="tiled").flops_attention
    with pytest.raises(ValueError, match="sigmoid attention runs on backend"):
        estimate("sigmoid", 2048, 64, 4, backend="sdpa")


def test_a_stack_setting_that_no_layer_takes_is_refused() -> None:
    from attnzoo.cost import estimate_stack

    with pytest.raises(ValueError, match=r"setting\(s\) \['window'\] apply to no layer of gated_deltanet/mha"):
        estimate_stack("gated_deltanet/mha", 128, 64, 4, window=16)
    stack = estimate_stack("sliding/mha", 128, 64, 4, window=16)  # taken by the sliding layer only
    assert stack.layers[0].kv_cache_max_tokens == 16 and stack.layers[1].kv_cache_max_tokens is None
