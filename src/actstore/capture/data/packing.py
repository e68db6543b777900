"""Packing text into fixed-length contexts, reading only what the example budget needs.

Documents are tokenised in batches (a fast tokenizer encodes a batch in parallel) and
joined with the tokenizer's end-of-sequence (or separator) token; the joined stream is cut
into windows of ``context_length`` tokens, each starting with the model's start tokens when
it has them (BERT's [CLS], Llama's <s>). Pre-tokenized rows are joined as they are: no
token is added or re-tokenised, so rows of exactly ``context_length`` tokens stay rows.
Reading stops at the document (or row) that fills the budget, so a 1 GB corpus captured
for a million tokens is read and tokenised only as far as those tokens; the windows are the
ones packing the whole corpus would give first, whatever the batch sizes.

Example:
    >>> pack_token_rows([[5, 6, 7], [8, 9]], 2)[0].tolist()
    [[5, 6], [7, 8]]
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from tqdm.auto import tqdm

from ...errors import ConfigError
from ...progress import bar_switch
from .base import ExampleSource, SourceBatch
from .digest import token_digest

if TYPE_CHECKING:
    from ..models import LoadedModel

log = logging.getLogger(__name__)

#: Documents per tokenizer call when the budget does not say how many are left to read.
DOC_BATCH = 2048
#: Rows per step when packing pre-tokenized rows.
ROW_BATCH = 4096
#: Documents (rows) read first under a budget, to learn how long they are.
FIRST_BATCH = 8


class TextSource(ExampleSource):
    """Packed fixed-length token contexts (``token_ids``: int32 ``[n_examples, T]``); its
    description carries their ``token_digest`` (:mod:`.digest`), so the store's identity
    covers the tokens it holds."""

    def __init__(
        self, token_ids: np.ndarray, root: str, description: dict[str, Any], model: LoadedModel
    ) -> None:
        self.token_ids: np.ndarray = token_ids
        self.tokens_per_example = int(token_ids.shape[1])
        if "token_digest" not in description:  # the packed ids, hashed once as handed over
            description = {**description, "token_digest": token_digest(token_ids)}
        self._root, self._description, self.model = root, description, model

    @property
    def n_examples(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def root(self) -> str:
        return self._root

    def describe(self) -> dict[str, Any]:
        return dict(self._description)

    def for_model(self, model: LoadedModel) -> TextSource:
        return TextSource(self.token_ids, self._root, self._description, model)

    def batches(self, start: int, batch_size: int, num_workers: int = 0) -> Iterator[SourceBatch]:
        import torch

        for lo in range(start, self.n_examples, batch_size):
            hi = min(lo + batch_size, self.n_examples)
            ids = self.token_ids[lo:hi]
            input_ids = torch.from_numpy(ids.astype(np.int64)).to(self.model.device)
            yield SourceBatch(
                example_ids=np.arange(lo, hi, dtype=np.int64),
                inputs={"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)},
                token_ids=ids,
            )


# ---------------------------------------------------------------------------- the packer


class Packer:
    """Joins units (documents' token ids, or pre-tokenized rows) and cuts windows of
    ``context_length`` tokens, each led by ``prefix``, keeping at most ``limit`` windows.

    ``add`` takes units in order and keeps only those needed to fill the budget; ``full``
    says when it is filled (the caller stops reading)."""

    def __init__(
        self, context_length: int, prefix: Sequence[int] = (), limit: int | None = None
    ) -> None:
        self.prefix = np.asarray(prefix, dtype=np.int32)
        self.content = context_length - len(self.prefix)
        if self.content < 1:
            raise ConfigError(f"context_length {context_length} leaves no room for content tokens")
        self.limit = limit
        self.need = None if limit is None else limit * self.content
        self.pieces: list[np.ndarray] = []
        self.have = 0
        self.used = 0
        """Units whose tokens were taken (the last one may be cut by the budget)."""

    @property
    def full(self) -> bool:
        return self.need is not None and self.have >= self.need

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> int:
        """Append units laid end to end in ``flat`` (``lengths[i]`` tokens each), up to
        the one that fills the budget; returns how many units were taken."""
        take = len(lengths)
        if self.need is not None and take:
            ends = np.cumsum(lengths)
            left = self.need - self.have
            if ends[-1] >= left:
                take = int(np.searchsorted(ends, left)) + 1
                flat = flat[: int(ends[take - 1])]
        self.pieces.append(flat)
        self.have += len(flat)
        self.used += take
        return take

    def windows(self) -> tuple[np.ndarray, int]:
        """int32 ``[n, context_length]`` windows and the tokens taken but left out of them
        (the incomplete tail, or the rest of the unit that filled the budget)."""
        stream = np.concatenate(self.pieces) if self.pieces else np.zeros(0, dtype=np.int32)
        n = len(stream) // self.content
        if self.limit is not None:
            n = min(n, self.limit)
        body = stream[: n * self.content].astype(np.int32, copy=False).reshape(n, self.content)
        windows = np.concatenate([np.tile(self.prefix, (n, 1)), body], axis=1)
        return np.ascontiguousarray(windows), len(stream) - n * self.content


def start_tokens(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before content (e.g. [CLS] or <s>), if any."""
    with_special = tokenizer("x", add_special_tokens=True)["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    for i in range(len(with_special) - len(plain) + 1):
        if with_special[i : i + len(plain)] == plain:
            return list(with_special[:i])
    return []


def separator(tokenizer: Any) -> int | None:
    """The token that ends each document in the packed stream (EOS, else SEP, else none)."""
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    return None if tokenizer.sep_token_id is None else int(tokenizer.sep_token_id)


def encode_documents(
    tokenizer: Any, docs: list[str], sep: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """One batched tokenizer call: the documents' ids, each followed by ``sep``, end to end,
    and each document's length (with its separator)."""
    from ...hub import quiet_transformers

    # Documents are tokenised whole, then cut into windows: the "longer than the model's
    # maximum length" warning does not apply to packing.
    with quiet_transformers():
        encoded = tokenizer(
            docs,
            add_special_tokens=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )["input_ids"]
    extra = 0 if sep is None else 1
    lengths = np.fromiter((len(ids) + extra for ids in encoded), dtype=np.int64, count=len(docs))
    if sep is None:
        chained = itertools.chain.from_iterable(encoded)
    else:
        chained = itertools.chain.from_iterable(ids + [sep] for ids in encoded)
    flat = np.fromiter(chained, dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths


def pack_documents(
    docs: Sequence[str], tokenizer: Any, context_length: int, *, progress: bool = True
) -> tuple[np.ndarray, int]:
    """Tokenise ``docs`` and pack them into ``[n, context_length]`` int32 windows.

    Returns the windows and the number of trailing tokens dropped.

    Example:
        >>> windows, dropped = pack_documents(["a b", "c"], tok, 4)  # doctest: +SKIP
    """
    packer = Packer(context_length, start_tokens(tokenizer))
    sep = separator(tokenizer)
    with tqdm(total=len(docs), desc="tokenising", unit="doc", **bar_switch(progress)) as bar:
        for lo in range(0, len(docs), DOC_BATCH):
            batch = list(docs[lo : lo + DOC_BATCH])
            packer.add(*encode_documents(tokenizer, batch, sep))
            bar.update(len(batch))
    return packer.windows()


def pack_token_rows(rows: Sequence[Sequence[int]], context_length: int) -> tuple[np.ndarray, int]:
    """Concatenate pre-tokenized rows, as is, and cut ``[n, context_length]`` windows.

    Returns the windows and the number of trailing tokens dropped.

    Example:
        >>> pack_token_rows([[5, 6, 7], [8, 9]], 2)[0].tolist()
        [[5, 6], [7, 8]]
    """
    packer = Packer(context_length)
    arrays = [np.asarray(r, dtype=np.int64).reshape(-1) for r in rows]
    if arrays:
        packer.add(np.concatenate(arrays), np.array([len(a) for a in arrays]))
    return packer.windows()


# ---------------------------------------------------------------------------- reading


@dataclass(kw_only=True)
class Rows:
    """A text dataset opened for packing: its documents (``str``) or token rows (1-D int
    arrays), read lazily and in order."""

    kind: Literal["text", "tokens"]
    items: Iterator[Any]
    description: dict[str, Any]
    """What identifies the dataset (the store's ``data`` field, before packing facts)."""
    total: int | None = None
    """Documents or rows in the dataset, when known without reading them all."""
    unread: Callable[[int], str | None] = field(default=lambda read: None)
    """``unread(n_read)``: what was left unread, in words, when ``total`` is unknown (a
    file's bytes); None when not known."""


def pack_rows(
    rows: Rows,
    root: str,
    model: LoadedModel,
    *,
    context_length: int,
    limit: int | None,
    vocab_size: int | None,
    progress: bool = True,
) -> TextSource:
    """Read ``rows`` until ``limit`` contexts are filled (or the dataset ends), pack them,
    log what was read, used and left unread, and return the source."""
    tokens = rows.kind == "tokens"
    if tokens:
        packer = Packer(context_length, limit=limit)
        read = _read_token_rows(rows, packer, vocab_size, root, model, progress)
    else:
        tokenizer = model.tokenizer
        packer = Packer(context_length, start_tokens(tokenizer), limit=limit)
        read = _read_documents(rows, packer, tokenizer, progress)
    windows, dropped = packer.windows()
    unit = "rows" if tokens else "documents"
    if read == 0:
        raise ConfigError(f"{root} holds no {'token rows' if tokens else 'text documents'}")
    if len(windows) == 0:
        raise ConfigError(
            f"{root} has fewer tokens than one context of {context_length}; "
            f"lower --context-length or add {'rows' if tokens else 'text'}"
        )
    log.info(
        "packed %s contexts of %d tokens: %s %s read, %s used (%s tail tokens dropped), %s",
        f"{len(windows):,}",
        context_length,
        unit,
        f"{read:,}",
        f"{packer.used:,}",
        f"{dropped:,}",
        _unread_words(rows, read, packer.full),
    )
    description = {**rows.description, "context_length": context_length}
    if tokens:
        description["n_rows"] = packer.used
    else:
        description.update(n_docs=packer.used, tokenizer=model.ckpt)
    return TextSource(windows, root, description, model)


def _unread_words(rows: Rows, read: int, stopped: bool) -> str:
    if not stopped:
        return "none left unread"
    if rows.total is not None:
        return f"{rows.total - read:,} left unread"
    return rows.unread(read) or "the rest of the dataset (if any) left unread"


def _bar(packer: Packer, rows: Rows, unit: str, progress: bool):
    if packer.need is not None:
        return tqdm(total=packer.need, desc="reading", unit="tok", **bar_switch(progress))
    return tqdm(total=rows.total, desc="reading", unit=unit, **bar_switch(progress))


def _read_documents(rows: Rows, packer: Packer, tokenizer: Any, progress: bool) -> int:
    """Tokenise documents in batches sized to what the budget still needs."""
    sep = separator(tokenizer)
    read = 0
    with _bar(packer, rows, "doc", progress) as bar:
        while not packer.full:
            docs = list(itertools.islice(rows.items, _batch(packer, read, DOC_BATCH)))
            if not docs:
                break
            read += len(docs)
            before = packer.have
            taken = packer.add(*encode_documents(tokenizer, docs, sep))
            bar.update(packer.have - before if packer.need is not None else taken)
    return read


def _batch(packer: Packer, read: int, most: int) -> int:
    """Documents (rows) to read next: a first few to learn their length, then about what
    the budget still needs (10% more), so a small budget reads little more than it uses
    and a big one reads in batches of ``most``."""
    if packer.need is None:
        return most
    if read == 0:
        return FIRST_BATCH
    per_unit = max(packer.have / read, 1.0)
    left = (packer.need - packer.have) / per_unit
    return int(min(most, max(FIRST_BATCH, left * 1.1 + 1)))


def _read_token_rows(
    rows: Rows,
    packer: Packer,
    vocab_size: int | None,
    root: str,
    model: LoadedModel,
    progress: bool,
) -> int:
    read = 0
    with _bar(packer, rows, "row", progress) as bar:
        while not packer.full:
            batch = list(itertools.islice(rows.items, _batch(packer, read, ROW_BATCH)))
            if not batch:
                break
            flat = np.concatenate(batch) if len(batch) > 1 else batch[0]
            lengths = np.fromiter((len(r) for r in batch), dtype=np.int64, count=len(batch))
            before = packer.have
            taken = packer.add(flat, lengths)
            check_vocabulary(packer.pieces[-1], vocab_size, root, model.ckpt)
            read += len(batch)
            bar.update(packer.have - before if packer.need is not None else taken)
    return read


def check_vocabulary(
    ids: np.ndarray, vocab_size: int | None, root: str, ckpt: str, *, token_file: bool = False
) -> None:
    """One line when a pre-tokenized id is negative or not below the model's vocabulary;
    what to do depends on where the ids come from: a field or column of a dataset (which
    may have text beside it), or a ``token_file`` (ids only)."""
    if vocab_size is None or not len(ids):
        return
    low, high = int(ids.min()), int(ids.max())
    if low >= 0 and high < vocab_size:
        return
    bad = high if high >= vocab_size else low
    todo = (
        f"Tokenize the text again with {ckpt}'s tokenizer, or capture the model it was made for"
        if token_file
        else "Capture its text column with --text-field instead"
    )
    raise ConfigError(
        f"{root} holds token id {bad}, outside {ckpt}'s vocabulary of {vocab_size}: was it "
        f"tokenized for another model? {todo}"
    )
