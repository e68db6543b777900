"""Stream one hook's megabatches (from one or several runs) as shuffled token batches.

This is actstore's counterpart of Activault's ``S3RCache``, made exactly resumable:

* Files are taken in an order shuffled per epoch (a pure function of ``seed`` and the
  epoch), in *windows* of ``mix_files`` files. The tokens of a window are permuted together
  (within and across its files), so a batch mixes sequences and files.
* While a window is consumed, the next ``prefetch_files`` files download in the background,
  each with concurrent ranged GETs, and are decoded with ``torch.load(weights_only=True)``.
  Memory peaks at about ``2 x mix_files + prefetch_files`` megabatches, when a window's
  files are joined (the files and their concatenation), and is ``mix_files +
  prefetch_files`` otherwise; a file being decoded briefly holds its bytes twice.
* Batches are consecutive ``batch_size`` slices of the epoch's token stream, so the state
  is just ``(epoch, tokens consumed)``: :meth:`state_dict` / :meth:`load_state_dict` resume
  exactly, whatever the download timing was.
* Several locations can be mixed into one stream after checking that they hold the same
  width, dtype and model.

Example:
    >>> from actstore.formats.activault import ActivaultOptions
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(n_examples=24), tempfile.TemporaryDirectory()  # 6 tokens each
    >>> case = FormatCase("activault", ActivaultOptions(rows_per_file=4))  # 24-token files
    >>> run = case.write(f"{out.name}/run", plan, make_batches(plan, make_acts(plan)))
    >>> stream = ActivaultStream(f"{run}/models.layers.3.post", batch_size=16)  # or s3://...
    >>> for acts in stream:  # [16, d] in the stored dtype (the last batch may be smaller)
    ...     loss = acts.float().square().mean()  # sae(acts.cuda().float())
    >>> acts.dtype, stream.state_dict()["epoch"]  # save the state with the model checkpoint
    (torch.bfloat16, 1)
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import ConfigError
from ...storage.location import Location
from ...storage.object import StorageOptions
from .layout import parse_dtype
from .reader import ActivaultReader

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch


@dataclass
class StreamStats:
    """Where the time went; ``wait_s`` counts only after each (re)start's first window."""

    warmup_s: float = 0.0
    """Time the consumer waited for the first window after each start."""
    wait_s: float = 0.0
    """Time the consumer waited for later windows (should stay near 0)."""
    files: int = 0
    bytes: int = 0
    batches: int = 0
    tokens: int = 0
    started: float = 0.0
    """``time.perf_counter()`` when the current iteration started."""


class ActivaultStream(torch.utils.data.IterableDataset):
    """Shuffled, prefetched, exactly resumable token batches of one hook.

    ``locations`` are hook folders (``s3://bucket/run/models.layers.6.post``) or runs with
    ``hook=`` naming the hook (a hook name or an actstore site like ``"resid.6"``).
    Yields ``[batch_size, d]`` tensors in the stored dtype (``dtype=`` converts), or with
    ``return_ids=True`` dicts ``{"states": [B, d], "input_ids": [B]}``. Use it with
    ``DataLoader(stream, batch_size=None, num_workers=0)``: it downloads on its own threads.
    """

    def __init__(
        self,
        locations: str | os.PathLike | Location | Sequence[str | os.PathLike | Location],
        *,
        hook: Hashable | None = None,
        batch_size: int = 4096,
        mix_files: int = 2,
        prefetch_files: int = 2,
        concurrency: int = 8,
        chunk_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        epochs: int | None = 1,
        return_ids: bool = False,
        drop_last: bool = False,
        dtype: torch.dtype | None = None,
        allow_incomplete: bool = False,
        storage: StorageOptions | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1 or mix_files < 1 or prefetch_files < 0 or concurrency < 1:
            raise ConfigError(
                "batch_size, mix_files and concurrency must be >= 1, prefetch_files >= 0"
            )
        if epochs is not None and epochs < 1:
            raise ConfigError("epochs must be >= 1 (or None for an endless stream)")
        if isinstance(locations, (str, os.PathLike, Location)):
            locations = [locations]
        if not locations:
            raise ConfigError("give at least one location to stream from")
        self.batch_size, self.mix_files, self.prefetch_files = batch_size, mix_files, prefetch_files
        self.shuffle, self.seed, self.epochs = shuffle, seed, epochs
        self.return_ids, self.drop_last, self.out_dtype = return_ids, drop_last, dtype
        self.readers = [
            ActivaultReader(
                loc,
                allow_incomplete=allow_incomplete,
                storage=storage,
                chunk_size=chunk_size,
                concurrency=concurrency,
            )
            for loc in locations
        ]
        self.hooks = [self._pick_hook(r, hook) for r in self.readers]
        self._check_compatible()
        #: (reader index, file index, tokens in file) of every file, in a fixed base order.
        self.files = [
            (ri, fi, r.metadata(h).tokens_per_file)
            for ri, (r, h) in enumerate(zip(self.readers, self.hooks))
            for fi in range(len(r.data_files(h)))
        ]
        if not self.files:
            raise ConfigError(f"{', '.join(map(str, locations))} hold no megabatch files")
        self.d_model = self.readers[0].metadata(self.hooks[0]).d_in
        self.epoch, self.position = 0, 0
        self.stats = StreamStats()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _pick_hook(reader: ActivaultReader, hook: Hashable | None) -> str:
        if hook is not None:
            return reader.hook_of(hook)
        if len(reader.hooks) != 1:
            raise ConfigError(
                f"{reader.url} holds hooks {reader.hooks}; choose one with hook=, or give "
                "the hook's folder"
            )
        return reader.hooks[0]

    def _check_compatible(self) -> None:
        ref, ref_hook = self.readers[0], self.hooks[0]
        ref_md = ref.metadata(ref_hook)
        for reader, hook in zip(self.readers[1:], self.hooks[1:]):
            md = reader.metadata(hook)
            problems = []
            if md.d_in != ref_md.d_in:
                problems.append(f"width {md.d_in} vs {ref_md.d_in}")
            if parse_dtype(md.dtype) != parse_dtype(ref_md.dtype):
                problems.append(f"dtype {md.dtype} vs {ref_md.dtype}")
            if reader.model_name and ref.model_name and reader.model_name != ref.model_name:
                problems.append(f"model {reader.model_name!r} vs {ref.model_name!r}")
            if problems:
                raise ConfigError(
                    f"cannot mix {reader.url} ({hook}) into a stream with {ref.url} "
                    f"({ref_hook}): {'; '.join(problems)}"
                )

    @property
    def n_tokens(self) -> int:
        """Tokens per epoch."""
        return sum(n for _, _, n in self.files)

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.n_tokens, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    # ------------------------------------------------------------------ resume

    def _digest(self) -> str:
        h = hashlib.sha256()
        for ri, fi, n in self.files:
            reader = self.readers[ri]
            f = reader.data_files(self.hooks[ri])[fi]
            h.update(f"{reader.store.url(f.key)}:{f.size}:{n}\n".encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch yielded: restore it with :meth:`load_state_dict`."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "mix_files": self.mix_files,
            "shuffle": self.shuffle,
            "files": self._digest(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the batch at which ``state`` was taken."""
        mine = self.state_dict()
        differ = [
            k
            for k in ("seed", "batch_size", "mix_files", "shuffle", "files")
            if state.get(k) != mine[k]
        ]
        if differ:
            raise ConfigError(
                f"this state was saved by a stream with a different {', '.join(differ)}; "
                "open the same locations with the same settings to resume"
            )
        if not 0 <= int(state["position"]) <= self.n_tokens:
            raise ConfigError(f"position {state['position']} is outside the epoch")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    # ------------------------------------------------------------------ order

    def epoch_order(self, epoch: int) -> list[int]:
        """Indices into :attr:`files` in the order epoch ``epoch`` reads them."""
        if not self.shuffle:
            return list(range(len(self.files)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.files)).tolist()

    def _window_perm(self, epoch: int, window: int, n: int) -> torch.Tensor | None:
        if not self.shuffle:
            return None
        perm = np.random.default_rng([self.seed, epoch, window, 1]).permutation(n)
        return torch.from_numpy(perm)

    # ------------------------------------------------------------------ iteration

    def _load(self, index: int) -> dict[str, torch.Tensor]:
        ri, fi, _ = self.files[index]
        reader, hook = self.readers[ri], self.hooks[ri]
        data = reader.fetch(hook, fi)
        mb = reader.decode(hook, fi, data)
        with self._lock:
            self.stats.files += 1
            self.stats.bytes += len(data)
        return mb

    def __iter__(self) -> Iterator[Any]:
        if torch.utils.data.get_worker_info() is not None:
            raise ConfigError(
                "use DataLoader(stream, batch_size=None, num_workers=0): the stream "
                "downloads on its own threads; in worker processes it would repeat "
                "in every worker, and its position (state_dict) would stay behind"
            )
        self.stats.started = time.perf_counter()
        while self.epochs is None or self.epoch < self.epochs:
            yield from self._iter_epoch()
            self.epoch, self.position = self.epoch + 1, 0

    def _iter_epoch(self) -> Iterator[Any]:
        order = self.epoch_order(self.epoch)
        windows = [order[i : i + self.mix_files] for i in range(0, len(order), self.mix_files)]
        sizes = [sum(self.files[i][2] for i in w) for w in windows]
        starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        first = int(np.searchsorted(starts, self.position, side="right") - 1)
        if first >= len(windows):
            return
        pending: deque[Future] = deque()
        todo = iter([i for w in windows[first:] for i in w])
        pool = ThreadPoolExecutor(
            max(1, self.prefetch_files + self.mix_files), thread_name_prefix="actstore-prefetch"
        )

        def refill(room: int) -> None:
            while len(pending) < room:
                index = next(todo, None)
                if index is None:
                    return
                pending.append(pool.submit(self._load, index))

        carry_states: list[torch.Tensor] = []
        carry_ids: list[torch.Tensor] = []
        carried = 0
        try:
            for wi in range(first, len(windows)):
                refill(len(windows[wi]) + self.prefetch_files)
                t0 = time.perf_counter()
                mbs = []
                for _ in windows[wi]:
                    mbs.append(pending.popleft().result())
                waited = time.perf_counter() - t0
                if wi == first:
                    self.stats.warmup_s += waited
                else:
                    self.stats.wait_s += waited
                states = torch.cat([m["states"].reshape(-1, self.d_model) for m in mbs])
                ids = None
                if self.return_ids:
                    ids = torch.cat([_ids_of(m) for m in mbs])
                del mbs
                perm = self._window_perm(self.epoch, wi, states.shape[0])
                offset = self.position - starts[wi] if wi == first else 0
                while offset < states.shape[0]:
                    take = min(self.batch_size - carried, states.shape[0] - offset)
                    sel = (
                        slice(offset, offset + take)
                        if perm is None
                        else perm[offset : offset + take]
                    )
                    carry_states.append(states[sel])
                    if ids is not None:
                        carry_ids.append(ids[sel])
                    carried += take
                    offset += take
                    if carried == self.batch_size:
                        self.position = starts[wi] + offset
                        yield self._emit(carry_states, carry_ids)
                        carry_states, carry_ids, carried = [], [], 0
                # Free this window before waiting for the next: the carried rows are copied
                # out (they may be views of ``states``), so nothing refers to it any more.
                if carried:
                    carry_states = [torch.cat(carry_states)]
                    carry_ids = [torch.cat(carry_ids)] if carry_ids else []
                del states, ids, perm
            if carried and not self.drop_last:
                self.position = starts[-1]
                yield self._emit(carry_states, carry_ids)
        finally:
            for fut in pending:
                fut.cancel()
            pool.shutdown(wait=True, cancel_futures=True)

    def _emit(self, states: list[torch.Tensor], ids: list[torch.Tensor]) -> Any:
        batch = torch.cat(states) if len(states) > 1 else states[0]
        if self.out_dtype is not None:
            batch = batch.to(self.out_dtype)
        self.stats.batches += 1
        self.stats.tokens += batch.shape[0]
        if not self.return_ids:
            return batch
        return {"states": batch, "input_ids": torch.cat(ids) if len(ids) > 1 else ids[0]}

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


def _ids_of(mb: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = mb["input_ids"]
    if ids is None:
        rows = mb["states"].shape[0] * mb["states"].shape[1]
        return torch.full((rows,), -1, dtype=torch.int64)
    return ids.reshape(-1)
