"""Per-row conditioning: what each row of a batch is generated from, carried as data.

A :class:`Conditioning` holds, for ``B`` rows, either class labels or text embeddings (with the
tokens' attention mask and a pooled vector where a model uses them), and for guided text rows
the classifier-free guidance scale and an optional negative conditioning (the embeddings that
replace the null prompt's). :meth:`Conditioning.take` and :func:`concat` keep it aligned with
the rows of ``x`` through batching, routing (an expert sees only its rows) and guidance (the
conditional and unconditional rows stacked in one forward), after diffusers' ``encode_prompt``
outputs and flow_matching's ``model_extras``.

Pure NumPy: the sampling loop, the servers and every model family share it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

#: The kinds of conditioning a DDM is trained on.
LABELS, TEXT = "labels", "text"

#: Fields that hold one entry per row (the others describe the whole batch).
_ROW_FIELDS = ("labels", "embeddings", "mask", "pooled", "guidance", "keys")
#: Bytes of a row's content key, a SHA-256 (:func:`row_keys`).
ROW_KEY_BYTES = 32


@dataclass(frozen=True, eq=False)
class Conditioning:
    """``B`` rows of conditioning; exactly one of ``labels`` and ``embeddings`` is set.

    * ``labels`` (B,) int64: class labels;
    * ``embeddings`` (B, L, D) float32: per-token text embeddings (CLIP's last hidden state);
    * ``mask`` (B, L) int64: 1 for a token, 0 for padding (None: every token counts);
    * ``pooled`` (B, P) float32: a pooled text vector, for models that take one;
    * ``guidance`` (B,) float32: classifier-free guidance scale per row (None, or 1: unguided);
    * ``negative``: ``B`` rows of embeddings that replace the null conditioning as the
      unconditional half of guided rows (a negative prompt); None: the model's null one;
    * ``keys`` (B, 32) uint8: each text row's content key (:func:`row_keys`), made once
      by :meth:`keyed` where a caller names rows by their content at every step (the router's
      contexts), so that a step hashes no embeddings; None: not made.
    """

    labels: np.ndarray | None = None
    embeddings: np.ndarray | None = None
    mask: np.ndarray | None = None
    pooled: np.ndarray | None = None
    guidance: np.ndarray | None = None
    negative: Conditioning | None = None
    keys: np.ndarray | None = None

    def __post_init__(self) -> None:
        if (self.labels is None) == (self.embeddings is None):
            raise ValueError("conditioning holds either labels or text embeddings, "
                             "exactly one of them")
        if self.labels is not None:
            _check(self.labels.ndim == 1, f"labels must have shape (B,), got "
                                          f"{self.labels.shape}")
            _check(self.mask is None and self.pooled is None and self.negative is None
                   and self.keys is None,
                   "label conditioning takes no mask, pooled vector, negative prompt or keys")
        else:
            assert self.embeddings is not None
            _check(self.embeddings.ndim == 3, f"text embeddings must have shape (B, L, D), got "
                                              f"{self.embeddings.shape}")
        rows = len(self)
        for name in _ROW_FIELDS:
            value = getattr(self, name)
            _check(value is None or value.shape[:1] == (rows,),
                   f"conditioning {name} has {None if value is None else value.shape[:1]} "
                   f"rows, expected {rows}")
        if self.mask is not None:
            _check(self.embeddings is not None and self.mask.shape == self.embeddings.shape[:2],
                   f"attention mask shape {self.mask.shape} differs from the embeddings' "
                   "(B, L)")
        if self.negative is not None:
            _check(self.negative.kind == TEXT and len(self.negative) == rows,
                   f"a negative conditioning needs {rows} rows of text embeddings")
            _check(self.negative.negative is None and self.negative.guidance is None,
                   "a negative conditioning is itself unguided")

    @classmethod
    def from_labels(cls, labels: Sequence[int] | np.ndarray) -> Conditioning:
        """Label conditioning, ``(B,)`` int64."""
        return cls(labels=np.asarray(labels, dtype=np.int64).reshape(-1))

    @property
    def kind(self) -> str:
        """:data:`LABELS` or :data:`TEXT`."""
        return LABELS if self.labels is not None else TEXT

    def __len__(self) -> int:
        rows = self.labels if self.labels is not None else self.embeddings
        assert rows is not None
        return int(rows.shape[0])

    def take(self, rows: Sequence[int] | np.ndarray) -> Conditioning:
        """The conditioning of ``rows`` (indices, repeats allowed), every field aligned. A
        read-only field (a keyed conditioning's rows: :meth:`keyed`) taken whole, every row
        in order, is shared rather than copied: nobody may write to it; where every field is
        so shared, the result is this very conditioning (a routed step's usual call)."""
        index = np.asarray(rows, dtype=np.int64).reshape(-1)
        if index.size and not (index.min() >= -len(self) and index.max() < len(self)):
            raise IndexError(f"rows {index.tolist()} outside a conditioning of {len(self)}")
        whole = index.size == len(self) and bool((index == np.arange(len(self))).all())
        taken = {name: value if whole and not value.flags.writeable else value[index]
                 for name in _ROW_FIELDS if (value := getattr(self, name)) is not None}
        negative = None if self.negative is None else self.negative.take(index)
        if negative is self.negative and all(value is getattr(self, name)
                                              for name, value in taken.items()):
            return self
        return replace(self, **taken, negative=negative)

    def with_guidance(self, scale: np.ndarray | float,
                      negative: Conditioning | None = None) -> Conditioning:
        """These rows guided with ``scale`` (a float or one per row) against ``negative``
        (None: the model's null conditioning)."""
        if self.kind != TEXT:
            raise ValueError("classifier-free guidance needs text conditioning; label experts "
                             "have no unconditional input")
        # Read-only, as a keyed conditioning's rows: a whole take shares them (:meth:`take`).
        guidance = _read_only(np.broadcast_to(np.asarray(scale, np.float32), (len(self),)).copy())
        return replace(self, guidance=guidance, negative=negative)

    def unguided(self) -> Conditioning:
        """The same rows without guidance: what a network's forward pass sees."""
        return replace(self, guidance=None, negative=None)

    def keyed(self) -> Conditioning:
        """These text rows with their content keys, and their negative rows' (:func:`row_keys`;
        kept as they are where made already), as read-only views: the keys name the rows'
        content, which must not change under them (and :meth:`take` shares them)."""
        negative = None if self.negative is None else self.negative.keyed()
        keys = row_keys(self) if self.keys is None else self.keys
        return replace(self, negative=negative, **{
            name: _read_only(value) for name, value in (
                ("embeddings", self.embeddings), ("mask", self.mask), ("pooled", self.pooled),
                ("keys", keys)) if value is not None})


def _read_only(array: np.ndarray) -> np.ndarray:
    """A view of ``array`` that cannot be written to."""
    view = array.view()
    view.flags.writeable = False
    return view


def row_keys(cond: Conditioning) -> np.ndarray:
    """Each text row's content key (B, 32) uint8: the SHA-256 of its embeddings (their
    shape and float32 bytes) and its mask (uint8; none: every token counts). Two rows with
    the same key condition a network alike; the one home of that rule (``cond.keys`` where
    :meth:`Conditioning.keyed` made them)."""
    if cond.keys is not None:
        return cond.keys
    if cond.embeddings is None:
        raise ValueError("only text rows have content keys")
    shape = str(cond.embeddings.shape[1:]).encode()
    embeddings = np.ascontiguousarray(cond.embeddings, np.float32)
    masks = (np.ones(embeddings.shape[:2], np.uint8) if cond.mask is None
             else np.ascontiguousarray(cond.mask, np.uint8))
    keys = np.empty((len(embeddings), ROW_KEY_BYTES), np.uint8)
    for row in range(len(embeddings)):
        digest = hashlib.sha256(shape)
        digest.update(embeddings[row])
        digest.update(masks[row])
        keys[row] = np.frombuffer(digest.digest(), np.uint8)
    return keys


def guided_rows(guidance: np.ndarray | None, rows: int, has_negative: bool,
                holder: str) -> np.ndarray:
    """Which of ``rows`` rows ``guidance`` (B,) guides (scale not 1; None: none), as a bool
    mask (B,). A guided row's unconditional half is a negative row (the embeddings of the
    empty or a negative prompt); where there are none (``has_negative`` False: ``holder``,
    e.g. ``the context``, brought none) a guided row is a ValueError. The one home of that
    rule, for the router, the in-process guidance and the expert servers alike."""
    mask = np.zeros(rows, bool) if guidance is None else np.asarray(guidance) != 1.0
    if mask.any() and not has_negative:
        raise ValueError(f"guided rows need {holder}'s negative rows, and it has none (the "
                         "text encoder's embeddings of the empty or a negative prompt)")
    return mask


def concat(parts: Sequence[Conditioning]) -> Conditioning:
    """The rows of ``parts`` one after the other; all must be of one kind and carry the same
    fields (texts of one length and width). A missing mask or guidance means its neutral value
    (every token counts, scale 1), so it is filled in where other parts have one. Rows that
    follow each other in one array already are shared, not copied (:func:`_joined`)."""
    if not parts:
        raise ValueError("nothing to concatenate")
    if len({p.kind for p in parts}) != 1:
        raise ValueError("cannot concatenate label and text conditioning")
    widths = {p.embeddings.shape[1:] for p in parts if p.embeddings is not None}
    if len(widths) > 1:
        raise ValueError(f"cannot concatenate text embeddings of different (L, D): "
                         f"{sorted(widths)}")
    joined = {}
    for name in _ROW_FIELDS:
        present = [getattr(p, name) is not None for p in parts]
        if not any(present):
            continue
        if not all(present) and name == "keys":
            continue  # made for some parts only: made again where needed
        if not all(present) and name not in ("mask", "guidance"):
            raise ValueError(f"cannot concatenate conditionings with and without {name}")
        joined[name] = _joined([_field_or_neutral(p, name) for p in parts])
    negatives = [p.negative is not None for p in parts]
    if any(negatives) and not all(negatives):
        raise ValueError("cannot concatenate rows with and without a negative conditioning")
    negative = concat([p.negative for p in parts if p.negative is not None]) if any(
        negatives) else None
    return Conditioning(**joined, negative=negative)


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """``arrays``' rows one after the other: where they are consecutive rows of one array
    already (a batch gathered into one buffer, its rows then their negative rows), a view of
    those rows, else a copy."""
    base, shape = arrays[0].base, arrays[0].shape[1:]
    row_items = math.prod(shape)
    if not (isinstance(base, np.ndarray) and base.flags.c_contiguous and row_items
            and base.size % row_items == 0
            and all(a.base is base and a.dtype == base.dtype and a.shape[1:] == shape
                    and a.flags.c_contiguous for a in arrays)):
        return np.concatenate(arrays)
    rows = base.reshape(-1, *shape)
    origin, row_bytes = rows.__array_interface__["data"][0], rows.strides[0]
    first, within = divmod(arrays[0].__array_interface__["data"][0] - origin, row_bytes)
    end = first
    for array in arrays:
        if within or array.__array_interface__["data"][0] != origin + end * row_bytes:
            return np.concatenate(arrays)
        end += len(array)
    return rows[first:end]


@dataclass(frozen=True, eq=False)
class EncodedPrompts:
    """A text encoder's answer for ``P`` prompts, in process or over the wire
    (``docs/protocol.md``'s encode reply): their text :class:`Conditioning` (embeddings
    (P, L, D), mask (P, L)) and ``tokens_cut`` (P,) int64, the tokens truncation dropped from
    each (0: the prompt fit), so that the API can say a prompt was too long; ``unknown``
    (N, 3) int64, a row per word the encoder cannot represent (its tokenizer's unknown token:
    a word-level vocabulary's missing words): the prompt's index and the word's characters
    ``[start, end)`` in it, so that the API can say which words were ignored."""

    cond: Conditioning
    tokens_cut: np.ndarray
    unknown: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))

    def __post_init__(self) -> None:
        _check(self.cond.kind == TEXT and self.tokens_cut.shape == (len(self.cond),),
               f"an encoder's answer is text conditioning and a cut per prompt, got "
               f"{self.cond.kind} of {len(self.cond)} rows and cuts {self.tokens_cut.shape}")
        _check(self.unknown.ndim == 2 and self.unknown.shape[1] == 3,
               f"unknown words are (N, 3) spans, got {self.unknown.shape}")

    @classmethod
    def concat(cls, parts: Sequence[EncodedPrompts]) -> EncodedPrompts:
        """The prompts of ``parts`` one after the other (an encode split into calls)."""
        firsts = np.cumsum([0, *(len(p.cond) for p in parts[:-1])])
        return cls(concat([p.cond for p in parts]),
                   np.concatenate([p.tokens_cut for p in parts]),
                   np.concatenate([p.unknown + [first, 0, 0]
                                   for p, first in zip(parts, firsts)]).astype(np.int64))

    def warnings(self, prompts: Sequence[str]) -> list[str]:
        """What the encoder ignored of ``prompts`` (the texts of its rows, in order): a line
        per distinct prompt that lost words or tokens, naming them."""
        lines = []
        for row, prompt in enumerate(prompts):
            words = [prompt[start:end] for _, start, end in self.unknown[
                self.unknown[:, 0] == row]]
            if words:
                lines.append(f"{prompt!r}: the text encoder does not know "
                             f"{', '.join(dict.fromkeys(words))}; ignored")
            if self.tokens_cut[row]:
                lines.append(f"{prompt!r}: longer than the text encoder takes; its last "
                             f"{int(self.tokens_cut[row])} token(s) ignored")
        return list(dict.fromkeys(lines))


def _field_or_neutral(part: Conditioning, name: str) -> np.ndarray:
    value = getattr(part, name)
    if value is not None:
        return value
    if name == "mask":
        assert part.embeddings is not None
        return np.ones(part.embeddings.shape[:2], np.int64)
    return np.ones(len(part), np.float32)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
