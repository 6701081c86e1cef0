"""Checks every Hugging Face **encoder-decoder** family passes against transformers (used by the
``test_hf_<family>.py`` modules of the seq2seq families): teacher-forced logits of the
``*ForConditionalGeneration`` model (and the hidden states of the bare ``*Model``) on a padded batch,
the encoder's states, cached decoding equal to the full forward, greedy generation equal to greedy
decoding with transformers' model, a saved folder through ``load_pretrained`` (also with config
defaults left out), ``to_hf``, and half precision no worse than transformers' own.

A family's model is random-initialised offline from a tiny config, then every weight is perturbed
(:func:`hf_family_checks.perturbed`) so that norms are not identities. A family whose encoder reads
something else than token ids (Whisper's log-mel features) overrides :meth:`Seq2SeqChecks.source`."""

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
from hf_encoder_checks import check_to_hf, real_rel
from hf_family_checks import V, perturbed, rel

TOL = 1e-5
#: the test modules of the seq2seq families, each with its ``SWEEP`` (key -> maker of seed)
MODULES: tuple[str, ...] = ("test_hf_t5", "test_hf_bart", "test_hf_marian", "test_hf_m2m_100", "test_hf_whisper")
#: the pad token id of the checks' configs
PAD = 1
#: the end token of the checks' configs (generation stops there)
EOS = 2


def hf_seq2seq(config: Any, model_class: Any, seed: int = 0, **kw: Any) -> Any:
    """``model_class`` (e.g. ``transformers.BartForConditionalGeneration``) built offline from
    ``config`` in eager attention, every weight perturbed."""
    torch.manual_seed(seed)
    return perturbed(model_class._from_config(config, attn_implementation="eager", **kw), seed)


def tiny_bart(seed: int = 0, scale: float = 0.5, **overrides: Any) -> Any:
    """A tiny transformers BART for the generation checks: 2 + 2 eager layers of width 32, pad
    :data:`PAD`, end :data:`EOS`, start 0, every weight perturbed by ``scale`` (distributions far
    from flat); ``overrides``: more config keys."""
    import transformers

    cfg = transformers.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                  decoder_ffn_dim=48, max_position_embeddings=40, pad_token_id=PAD, eos_token_id=EOS,
                                  bos_token_id=0, **overrides)
    torch.manual_seed(seed)
    return perturbed(transformers.BartForConditionalGeneration._from_config(cfg, attn_implementation="eager"), seed,
                     scale)


def sweep() -> dict[str, Callable[[int], Any]]:
    """Every seq2seq family's export sweep: key -> a maker of its transformers model (``seed`` -> model)."""
    out: dict[str, Callable[[int], Any]] = {}
    for name in MODULES:
        try:
            out.update(importlib.import_module(name).SWEEP)
        except ModuleNotFoundError as exc:  # a family module not written yet
            if exc.name != name:
                raise
    return out


def token_source(m: int = 10, pad: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src [3, m], src_mask [3, m])``: row 0 right-padded by ``pad`` (the tokenizers' default),
    row 1 left-padded by ``pad``, row 2 full; padded slots hold :data:`PAD`; no special ids."""
    x = torch.randint(3, V, (3, m), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(x)
    mask[0, m - pad:] = 0
    mask[1, :pad] = 0
    return x.masked_fill(mask == 0, PAD), mask


def target(n: int = 7, pad: int = 2, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tgt [3, n], tgt_mask [3, n])``: the decoder's input, row 0 right-padded by ``pad`` (a
    padded batch of labels), the others full."""
    y = torch.randint(3, V, (3, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(y)
    mask[0, n - pad:] = 0
    return y.masked_fill(mask == 0, PAD), mask


def hf_logits(hf: Any, inputs: dict[str, torch.Tensor], tgt: torch.Tensor, tgt_mask: torch.Tensor | None) -> torch.Tensor:
    """transformers' teacher-forced output: ``logits`` (or the bare model's ``last_hidden_state``)."""
    with torch.no_grad():
        r = hf(**inputs, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    return r.logits if hasattr(r, "logits") else r.last_hidden_state


class Seq2SeqChecks:
    """The checks of a seq2seq family as test methods. A test module declares
    ``class TestFamily(Seq2SeqChecks): config = staticmethod(make_config)``, ``model`` (the
    ``*ForConditionalGeneration`` class), ``base`` (the bare ``*Model`` class or ``None``), ``cases``
    (more configs whose logits are checked), ``drop`` (config keys whose defaults
    ``load_pretrained`` must know); ``start``: the decoder start token of its configs."""

    config: Callable[[], Any]
    model: Any
    base: Any = None
    cases: tuple[Callable[[], Any], ...] = ()
    drop: tuple[str, ...] = ()
    start: int = 0
    tol: float = TOL
    #: the attention calls transformers' own model makes through attnzoo's kernel per forward
    #: (``attn_implementation="attnzoo"``), ``None``: that check is not run for this class
    kernel_calls: int | None = None

    # ------------------------------------------------------------------ inputs
    def source(self, hf: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(src, src_mask)`` for ``hf``'s encoder: a padded batch of token ids by default."""
        return token_source()

    def hf_inputs(self, hf: Any, src: torch.Tensor, src_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """What transformers' model takes for ``src``."""
        return {"input_ids": src, "attention_mask": src_mask} if src_mask is not None else {"input_ids": src}

    def _make(self, cls: Any = None, config: Any = None, seed: int = 0, dtype: torch.dtype | None = None) -> Any:
        hf = hf_seq2seq(config if config is not None else self.config(), cls or self.model, seed)
        return hf if dtype is None else hf.to(dtype)

    # ------------------------------------------------------------------ checks
    def logits_error(self, ours: Any, hf: Any) -> float:
        """The max relative difference of ``ours`` (an ``EncoderDecoder``) from transformers' ``hf``:
        teacher-forced outputs at every real target token of the checks' batch."""
        assert isinstance(ours, az.EncoderDecoder)
        src, src_mask = self.source(hf)
        tgt, tgt_mask = target()
        with torch.no_grad():
            got = ours(src, tgt, src_mask=src_mask, tgt_mask=tgt_mask)
        return real_rel(got, hf_logits(hf, self.hf_inputs(hf, src, src_mask), tgt, tgt_mask), tgt_mask)

    def check_logits(self, hf: Any) -> float:
        """``from_hf(hf)`` equals transformers' teacher-forced output at every real target token."""
        err = self.logits_error(from_hf(hf), hf)
        assert err <= self.tol, err
        return err

    def test_logits_equal_transformers(self) -> None:
        for make in (self.config, *self.cases):
            self.check_logits(self._make(config=make()))

    def test_bare_model_hidden_states(self) -> None:
        if self.base is not None:
            self.check_logits(self._make(self.base))

    def test_encoder_states_equal_transformers(self) -> None:
        hf = self._make()
        ours = from_hf(hf)
        src, src_mask = self.source(hf)
        with torch.no_grad():
            got = ours.encode(src, src_mask)
            want = hf.get_encoder()(**self.hf_inputs(hf, src, src_mask)).last_hidden_state
        if src_mask is None or got.shape[1] != src_mask.shape[1]:
            assert rel(got, want) <= self.tol
        else:
            assert real_rel(got, want, src_mask) <= self.tol

    def test_cached_decode_equals_full_forward(self) -> None:
        """Prefill 3 target tokens, then one at a time: every step's logits equal the full forward's."""
        ours = from_hf(self._make())
        src, src_mask = self.source(None)
        tgt, _ = target(pad=0)
        with torch.no_grad():
            memory = ours.encode(src, src_mask)
            full = ours.decode(tgt, memory, memory_mask=src_mask)
            cache = ours.init_cache(tgt.shape[0], tgt.shape[1])
            steps = [ours.decode(tgt[:, :3], memory, memory_mask=src_mask, cache=cache)]
            steps += [ours.decode(tgt[:, i:i + 1], memory, memory_mask=src_mask, cache=cache)
                      for i in range(3, tgt.shape[1])]
        assert rel(torch.cat(steps, dim=1), full) <= self.tol

    def test_greedy_generate_equals_transformers(self) -> None:
        """``generate`` (greedy, cached) equals greedy decoding with transformers' full forward, row
        by row up to each row's end token."""
        hf = self._make()
        ours = from_hf(hf)
        src, src_mask = self.source(hf)
        new = 6
        with torch.no_grad():
            got = ours.generate(src, new, src_mask=src_mask, bos_token_id=self.start, eos_token_id=EOS)
            ys = torch.full((src.shape[0], 1), self.start, dtype=torch.long)
            inputs = self.hf_inputs(hf, src, src_mask)
            for _ in range(new):
                ys = torch.cat([ys, hf(**inputs, decoder_input_ids=ys).logits[:, -1].argmax(-1, keepdim=True)], 1)
        for row, want in zip(got.tolist(), ys.tolist(), strict=True):
            end = want.index(EOS, 1) + 1 if EOS in want[1:] else len(want)
            assert row[:end] == want[:end], (row, want)

    def test_saved_folder_loads(self, tmp_path: Path) -> None:
        hf = self._make()
        hf.save_pretrained(tmp_path)
        if self.drop:
            path = tmp_path / "config.json"
            data = json.loads(path.read_text())
            for key in self.drop:
                data.pop(key, None)
            path.write_text(json.dumps(data))
            hf = type(hf).from_pretrained(tmp_path, attn_implementation="eager").eval()
        assert self.logits_error(load_pretrained(tmp_path), hf) <= self.tol

    def test_to_hf_writes_the_weights_back(self) -> None:
        for cls in (self.model, self.base):
            if cls is not None:
                check_to_hf(lambda seed, cls=cls: self._make(cls, seed=seed))

    def test_attnzoo_kernels_in_transformers_equal_eager(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """transformers' own model with ``attn_implementation="attnzoo"`` (its self-, causal and
        cross-attention through its attention interface) equals its eager model; every call counted,
        so nothing passes without reaching attnzoo."""
        if self.kernel_calls is None:
            pytest.skip("kernel_calls not set: the kernel hook is checked on another class or module for this family")
        import attnzoo.hf as azhf

        azhf.register()
        calls: list[tuple[int, ...]] = []
        real = azhf.attention

        def counted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
            calls.append(tuple(q.shape))
            return real(q, k, v, **kw)

        monkeypatch.setattr(azhf, "attention", counted)
        hf = self._make()
        src, src_mask = self.source(hf)
        tgt, tgt_mask = target()
        inputs = self.hf_inputs(hf, src, src_mask)
        want = hf_logits(hf, inputs, tgt, tgt_mask)
        hf.set_attn_implementation("attnzoo")
        got = hf_logits(hf, inputs, tgt, tgt_mask)
        assert len(calls) == self.kernel_calls
        assert real_rel(got, want, tgt_mask) <= self.tol

    def labels(self) -> torch.Tensor:
        """``[3, 7]`` target ids, row 0 right-padded with ``-100`` (no loss taken there)."""
        tgt, mask = target()
        return tgt.masked_fill(mask == 0, -100)

    def test_loss_equals_transformers(self) -> None:
        """``loss(src, labels)`` equals transformers' ``model(..., labels=labels).loss`` (the labels
        shifted right behind the start token, ``-100`` not counted)."""
        hf = self._make()
        ours = from_hf(hf)
        src, src_mask = self.source(hf)
        labels = self.labels()
        with torch.no_grad():
            want = hf(**self.hf_inputs(hf, src, src_mask), labels=labels).loss
            got = ours.loss(src, labels, src_mask=src_mask)
        assert abs(float(got) - float(want)) <= self.tol * abs(float(want))

    def test_fine_tuned_model_writes_back_to_transformers(self) -> None:
        """Convert, take two SGD steps on ``loss`` with attnzoo, ``to_hf`` into a fresh transformers
        model of the config: its logits equal the fine-tuned attnzoo model's."""
        hf = self._make()
        ours = from_hf(hf).train()
        src, src_mask = self.source(hf)
        labels = self.labels()
        opt = torch.optim.SGD(ours.parameters(), lr=0.05)
        for _ in range(2):
            loss = ours.loss(src, labels, src_mask=src_mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
        fresh = self._make(seed=1)
        to_hf(ours.eval(), fresh)
        assert self.logits_error(ours, fresh) <= self.tol

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
    def test_half_precision_no_worse_than_transformers(self, dtype: torch.dtype) -> None:
        """In ``dtype`` our logits are no further from the float64 model than transformers' own in
        ``dtype`` (times 2, plus a floor of one ``dtype`` epsilon)."""
        hf = self._make()
        src, src_mask = self.source(hf)
        tgt, tgt_mask = target()
        ref = hf_logits(hf.to(torch.float64), self.hf_inputs(hf, _as(src, torch.float64), src_mask), tgt, tgt_mask)
        ours = from_hf(hf, dtype=dtype)
        with torch.no_grad():
            ours_out = ours(_as(src, dtype), tgt, src_mask=src_mask, tgt_mask=tgt_mask).double()
        theirs = hf_logits(hf.to(dtype), self.hf_inputs(hf, _as(src, dtype), src_mask), tgt, tgt_mask).double()
        ours_err, their_err = real_rel(ours_out, ref, tgt_mask), real_rel(theirs, ref, tgt_mask)
        assert ours_err <= 2.0 * their_err + torch.finfo(dtype).eps, (ours_err, their_err)


def _as(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float source (audio features) in ``dtype``; token ids unchanged."""
    return src.to(dtype) if src.is_floating_point() else src


def is_seq2seq(hf: Any) -> bool:
    """A transformers encoder-decoder with its decoder (not, say, ``T5EncoderModel``)."""
    return bool(getattr(hf.config, "is_encoder_decoder", False)) and any(
        ".decoder." in f".{name}" or name.startswith("decoder.") for name, _ in hf.named_parameters())


def sweep_output(hf: Any) -> torch.Tensor:
    """The export sweep's output of a seq2seq model: teacher-forced logits (hidden states of a bare
    model) on the checks' source (random log-mel features for an audio model) and target."""
    if getattr(hf, "main_input_name", "input_ids") == "input_features":
        cfg = hf.config
        src = torch.randn(2, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=torch.Generator().manual_seed(0))
        inputs = {"input_features": src}
    else:
        src, mask = token_source()
        inputs = {"input_ids": src, "attention_mask": mask}
    tgt = target(pad=0)[0]
    return hf_logits(hf, inputs, tgt[: src.shape[0]], None).float()
