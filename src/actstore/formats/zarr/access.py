"""Random access to a zarr store or run: one ``(sample, site)`` read from the chunk files
holding it, batches of the training pattern, ``reader[...]``, and the per-sample fields
(arrays, token ids, texts) (:class:`ZarrAccess`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import ConfigError, CorruptStoreError, IndexOutOfRangeError
from ...sites import Site
from ...storage.local import load_json
from .index import ZarrIndex
from .layout import ACT_DTYPE, SAMPLE_KEY, TEXT_FILES, TOKEN_IDS


class ZarrAccess(ZarrIndex):
    """Samples, batches and per-sample fields of a zarr store or run."""

    def read(
        self,
        i: int,
        site: Any,
        part: str = "prompt",
        *,
        trim: bool = True,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Activations of sample ``i`` at ``site`` for ``part``: ``(len_i, H)`` float16 with
        ``trim`` (the stored real tokens), else ``(P_max or R_max, H)`` zero-padded.

        Reads only the chunks of this ``(sample, layer)`` that hold the requested tokens,
        each checked.

        Example:
            >>> import tempfile
            >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
            >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # 6-token prompts
            >>> batches = make_batches(plan, make_acts(plan))
            >>> from actstore.formats.zarr.reader import ZarrReader
            >>> reader = ZarrReader(FormatCase("zarr").write(out.name, plan, batches))
            >>> reader.read(0, "resid.3", "prompt").shape, reader.read(0, 3, trim=False).shape
            ((6, 8), (6, 8))
        """
        return self.read_index(i, self._layer_index(site), part, trim=trim, out=out)

    def read_index(
        self,
        i: int,
        layer_idx: int,
        part: str = "prompt",
        *,
        trim: bool = True,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """:meth:`read` with the position on the ``L`` axis instead of the site."""
        lay = self.layout
        max_len = lay.max_len(part)  # checks part
        if not 0 <= layer_idx < lay.n_layers:
            raise IndexOutOfRangeError(
                f"layer position {layer_idx} out of range (0..{lay.n_layers - 1})"
            )
        k, local = self.locate(i)
        store = self.stores[k]
        n_real = int(store.lengths[part][local])
        n_rows = n_real if trim else max_len
        if out is None:
            out = np.empty((n_rows, lay.hidden_size), dtype=ACT_DTYPE)
        elif (
            out.shape != (n_rows, lay.hidden_size)
            or out.dtype != ACT_DTYPE
            or not out.flags.c_contiguous
        ):
            raise ConfigError(
                f"out must be a C-contiguous float16 array of shape "
                f"{(n_rows, lay.hidden_size)}, not {out.dtype} {out.shape}"
            )
        store.read_rows(part, local, layer_idx, out[:n_real])
        out[n_real:] = 0  # padding is zeros (the writer stores it so; verify checks it)
        return out

    def read_examples(
        self, examples: np.ndarray, sites: Sequence[Site], tokens: slice | np.ndarray
    ) -> np.ndarray:
        """Over the padded ``P_max + R_max`` tokens (prompt then response, float16; zeros
        past each part's length), checked."""
        lay = self.layout
        layer_ids = [self._layer_index(site) for site in sites]
        out = np.zeros(
            (len(examples), len(layer_ids), lay.p_max + lay.r_max, lay.hidden_size), ACT_DTYPE
        )
        for j, i in enumerate(examples.tolist()):
            for m, li in enumerate(layer_ids):
                out[j, m, : lay.p_max] = self.read_index(i, li, "prompt", trim=False)
                out[j, m, lay.p_max :] = self.read_index(i, li, "response", trim=False)
        return out[:, :, tokens]

    def read_batch(
        self,
        samples: Sequence[int] | np.ndarray,
        layers: Sequence[Sequence[Any]] | np.ndarray,
        part: str = "response",
        *,
        trim: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Stack ``read(samples[j], layers[j][m], part)`` into ``acts[b, k, T, H]`` (zero-padded
        to ``P_max``/``R_max``, or to the longest of these samples with ``trim``) and return it
        with the lengths ``[b]``. ``layers`` is ``[b, k]`` sites in any spelling."""
        samples = np.asarray(samples, dtype=np.int64).reshape(-1)
        layer_idx = np.array(
            [[self._layer_index(x) for x in row] for row in layers], dtype=np.int64
        ).reshape(len(samples), -1)
        return self.read_batch_index(samples, layer_idx, part, trim)

    def random_batch(
        self,
        b: int,
        rng: np.random.Generator,
        *,
        n_layers: int = 2,
        part: str = "response",
        trim: bool = False,
    ) -> dict[str, np.ndarray]:
        """The training pattern: ``b`` random samples, ``n_layers`` distinct random layers each.

        Returns ``acts [b, n_layers, T, H]``, ``lengths [b]``, ``samples [b]`` and
        ``layers [b, n_layers]`` (block indices; ``sites`` gives the names).
        """
        lay = self.layout
        if not 1 <= n_layers <= lay.n_layers:
            raise ConfigError(f"n_layers must lie in 1..{lay.n_layers}, not {n_layers}")
        samples = rng.integers(0, lay.n_samples, size=b)
        layer_idx = np.stack(
            [rng.choice(lay.n_layers, size=n_layers, replace=False) for _ in range(b)]
        )
        acts, lengths = self.read_batch_index(samples, layer_idx, part, trim)
        return {
            "acts": acts,
            "lengths": lengths,
            "samples": samples,
            "layers": np.asarray(lay.layers)[layer_idx],
            "sites": np.asarray(lay.sites)[layer_idx],
        }

    def read_batch_index(
        self, samples: np.ndarray, layer_idx: np.ndarray, part: str = "response", trim: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`read_batch` with positions on the ``L`` axis (``layer_idx [b, k]``)."""
        lengths = self.lengths(part)[samples]
        width = int(lengths.max(initial=0)) if trim else self.layout.max_len(part)
        acts = np.zeros(
            (len(samples), layer_idx.shape[1], width, self.layout.hidden_size), dtype=ACT_DTYPE
        )
        for j, i in enumerate(samples):
            k, local = self.locate(int(i))
            for m, idx in enumerate(layer_idx[j]):
                self.stores[k].read_rows(part, local, int(idx), acts[j, m, : lengths[j]])
        return acts, lengths

    def dataset(
        self, part: str = "response", *, n_layers: int = 2, seed: int = 0, trim: bool = False
    ):
        """A torch map-style Dataset of the training pattern (see :class:`ZarrPairDataset`)."""
        from .dataset import ZarrPairDataset

        return ZarrPairDataset(self, part=part, n_layers=n_layers, seed=seed, trim=trim)

    # ------------------------------------------------------------------ per-sample fields

    def _concat(self, name: str) -> np.ndarray | None:
        parts = [store.array(name) for store in self.stores]
        arrays = [p for p in parts if p is not None]
        return np.concatenate(arrays) if len(arrays) == len(parts) else None

    def array(self, name: str) -> np.ndarray | None:
        """A per-sample array over all samples (``"sample_key"``, ``"hallu_label"``, ``"split"``,
        ``"prompt_len_full"``, ``"prompt_token_ids"``...), checked, or None if absent."""
        return self._concat(f"arrays/{name}")

    @property
    def sample_keys(self) -> list[str]:
        keys = self._concat(SAMPLE_KEY)
        return [] if keys is None else [k.decode("ascii") for k in keys]

    @property
    def tokens(self) -> np.ndarray | None:
        """Token ids ``[n, P_max + R_max]`` (prompt then response, -1 where none), for
        stores that keep them."""
        prompt, response = self._concat(TOKEN_IDS["prompt"]), self._concat(TOKEN_IDS["response"])
        if prompt is None or response is None:
            return None
        return np.concatenate([prompt, response], axis=1)

    def token_ids(self, i: int, part: str = "prompt") -> np.ndarray | None:
        """Stored token ids of sample ``i``'s ``part`` (its real tokens), or None."""
        k, local = self.locate(i)
        ids = self.stores[k].array(TOKEN_IDS[part])
        if ids is None:
            return None
        return np.asarray(ids[local][: self.stores[k].lengths[part][local]])

    def text(self, i: int, part: str = "prompt") -> str | None:
        """The prompt or response text of sample ``i`` (from ``text/*.jsonl``), or None."""
        k, local = self.locate(i)
        store = self.stores[k]
        name = TEXT_FILES[part]
        if not store.exists(name):
            return None
        offsets = self._text_index.get((k, part))
        if offsets is None:
            data = (
                store.checks.read_bytes(name)
                if store.checks.enabled
                else store.files.read_bytes(name)
            )
            offsets = _line_offsets_of(data)
            if len(offsets) != store.n_samples:
                raise CorruptStoreError(
                    f"{store.url_of(name)} has {len(offsets)} lines for {store.n_samples} samples"
                )
            self._text_index[(k, part)] = offsets
            self.__dict__.setdefault("_texts", {})[(k, part)] = data
        data = self.__dict__.get("_texts", {}).get((k, part))
        if data is None:  # a worker process: the text is read (and checked) again
            data = (
                store.checks.read_bytes(name)
                if store.checks.enabled
                else store.files.read_bytes(name)
            )
            self.__dict__.setdefault("_texts", {})[(k, part)] = data
        start = int(offsets[local])
        line = bytes(data[start:]).split(b"\n", 1)[0]
        try:
            text = load_json(line)[part]
        except (ValueError, KeyError, TypeError) as err:
            raise CorruptStoreError(
                f"{store.url_of(name)}: the record of sample {local} is malformed ({err!r}); "
                "restore the file or re-create the store"
            ) from None
        if not isinstance(text, str):
            raise CorruptStoreError(
                f"{store.url_of(name)}: the {part} of sample {local} is not a string; restore "
                "the file or re-create the store"
            )
        return text

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_texts": {}}


# ---------------------------------------------------------------------------- helpers


def _line_offsets_of(data: bytes | memoryview) -> np.ndarray:
    """Start of each non-empty line of ``data`` (a text file read whole)."""
    offsets, pos = [], 0
    for line in bytes(data).split(b"\n"):
        if line.strip():
            offsets.append(pos)
        pos += len(line) + 1
    return np.asarray(offsets, dtype=np.int64)
