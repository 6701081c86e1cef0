"""Arena checkpoints as models to look at: ``attnzoo viz --model lm-mha.pt`` reads them here."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from attnzoo.arena.runner import TaskSettings, _build_model
from attnzoo.arena.storage import first_line, load_checkpoint
from attnzoo.arena.tasks import ShakespeareTask
from attnzoo.viz import Tokenize

__all__ = ["load_arena_model"]

def _char_tokenize(task: ShakespeareTask) -> Tokenize:
    def tokenize(text: str) -> tuple[Tensor, list[str]]:
        ids = task.encode(text)
        return ids.unsqueeze(0), ["␣" if c == " " else repr(c)[1:-1] for c in text]

    return tokenize


def _id_tokenize(vocab: int) -> Tokenize:
    def tokenize(text: str) -> tuple[Tensor, list[str]]:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError:
            raise ValueError("an mqar model reads space-separated token ids, e.g. --text '3 17 4 9'") from None
        if any(not 0 <= i < vocab for i in ids):
            raise ValueError(f"token ids must be in [0, {vocab}), got {ids}")
        return torch.tensor([ids]), [str(i) for i in ids]

    return tokenize


def load_arena_model(path: str | Path) -> tuple[nn.Module, Tokenize]:
    """Rebuild the model of an arena checkpoint (``.pt`` written by ``attnzoo arena``) with its tokenizer.

    The checkpoint's signature says how the model was built (task settings, variant, seed). The
    ``lm`` task reads text through its character vocabulary; ``mqar`` reads space-separated token ids.

    Returns:
        ``(model in eval mode, tokenize)`` where ``tokenize(text) -> (ids [1, N], labels)``.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    try:
        state = load_checkpoint(p)
    except Exception as exc:  # torch.load raises many types for foreign or truncated files
        raise ValueError(f"{p} is not an arena checkpoint: it cannot be read ({type(exc).__name__})") from None
    if not (isinstance(state, dict) and isinstance(state.get("extra"), dict) and "signature" in state["extra"]):
        raise ValueError(f"{p} is not an arena checkpoint (expected keys model/extra.signature) nor a model folder")
    sig = dict(state["extra"]["signature"])
    variant = sig.pop("variant")
    seed = sig.pop("seed", 0)
    sig.pop("world_size", None)
    sig.pop("context_parallel", None)
    try:
        settings = TaskSettings(**sig)
    except TypeError as exc:
        raise ValueError(f"{p}: the checkpoint's signature does not describe arena settings ({exc})") from None
    if settings.task == "lm":
        task = ShakespeareTask(seq_len=settings.seq_len)
        vocab, tokenize = task.vocab_size, _char_tokenize(task)
    else:
        vocab, tokenize = settings.vocab_size, _id_tokenize(settings.vocab_size)
    model = _build_model(settings, variant, vocab, seed, torch.device("cpu"))
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError) as exc:
        raise ValueError(f"{p}: the weights do not fit the model of its signature "
                         f"({first_line(exc)[:160]})") from None
    return model.eval(), tokenize
