"""Example sources for capture: image folders, text and JSONL files, token files (.npy,
.bin), and Hugging Face datasets (``save_to_disk`` directories, parquet/arrow/json/csv files
or folders of them, local copies of Hub repositories, and Hub ids).

Every source has a fixed, deterministic example order and a known ``n_examples`` before
capture starts (the store's metadata and content hash depend on it), and can restart at
any example (resume). Text is tokenised once, in batches and only as far as the example
budget needs, and packed into fixed-length contexts (:mod:`.packing`); a column of token
ids is packed as is (:mod:`.columns` says which column is which).

Modules, by concern: :mod:`.base` (the :class:`ExampleSource` contract), :mod:`.packing`
(tokenising and packing text), :mod:`.columns` (text or token ids), :mod:`.text_files`
(.txt, .jsonl, the embedded corpus), :mod:`.token_files` (.npy, .bin), :mod:`.hf`
(``datasets``), :mod:`.images`, :mod:`.opening` (:func:`open_source`).

Example:
    >>> src = open_source("embedded", model)  # doctest: +SKIP
    >>> src.n_examples, src.tokens_per_example  # doctest: +SKIP
    (1009, 128)
"""

from .base import ExampleSource, SourceBatch
from .columns import TOKEN_COLUMNS
from .hf import BUILDERS, HFDataset, check_hub_reachable, load_saved, looks_like_hub_id
from .images import IMAGE_SUFFIXES, ImageSource, image_files
from .opening import KINDS_HINT, model_vocab_size, open_source
from .packing import TextSource, pack_documents, pack_token_rows
from .text_files import EMBEDDED_DATASET, embedded_documents
from .token_files import TOKEN_FILE_SUFFIXES

__all__ = [
    "BUILDERS",
    "EMBEDDED_DATASET",
    "IMAGE_SUFFIXES",
    "KINDS_HINT",
    "TOKEN_COLUMNS",
    "TOKEN_FILE_SUFFIXES",
    "ExampleSource",
    "HFDataset",
    "ImageSource",
    "SourceBatch",
    "TextSource",
    "check_hub_reachable",
    "embedded_documents",
    "image_files",
    "load_saved",
    "looks_like_hub_id",
    "model_vocab_size",
    "open_source",
    "pack_documents",
    "pack_token_rows",
]
