"""ActivaultStream: every token once per epoch, shuffled within and across buffered files,
a new order each epoch, exact resume from state_dict, ids aligned with states."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_activault_s3 import make_run_data, write_run

from actstore.errors import ConfigError
from actstore.formats.activault import ActivaultStream
from actstore.sites import Site

SITE = Site("resid", 1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """40 examples x 8 tokens in 10 files of 4 rows; token t has value t in column 0."""
    plan, acts = make_run_data(n_examples=40, tokens=8, d=16, sites=(SITE,))
    location = write_run(
        str(tmp_path_factory.mktemp("stream") / "run"), plan, acts, rows_per_file=4
    )
    return location, acts


def token_ids(batches) -> list[int]:
    return torch.cat(batches)[:, 0].long().tolist()


def test_every_token_once_per_epoch_shuffled_across_files_new_order_each_epoch(run):
    location, acts = run
    stream = ActivaultStream(
        location, batch_size=24, mix_files=3, prefetch_files=2, seed=7, epochs=2
    )
    assert stream.n_tokens == 320 and len(stream) == 14
    batches = list(stream)
    assert [b.shape for b in batches[:2]] == [(24, 16), (24, 16)] and batches[13].shape == (8, 16)
    epoch0, epoch1 = token_ids(batches[:14]), token_ids(batches[14:])
    assert sorted(epoch0) == sorted(epoch1) == list(range(320))
    assert epoch0 != epoch1  # reshuffled per epoch
    files_in_first_batch = {t // 32 for t in epoch0[:24]}  # 32 tokens per file
    assert len(files_in_first_batch) > 1  # rows come from several buffered files
    np.testing.assert_array_equal(  # rows are whole vectors, not just column 0
        torch.cat(batches[:14]).numpy()[np.argsort(epoch0)], acts[str(SITE)].reshape(-1, 16)
    )
    again = ActivaultStream(location, batch_size=24, mix_files=3, seed=7, epochs=2)
    assert token_ids(list(again)) == epoch0 + epoch1  # a pure function of the seed


def test_unshuffled_stream_keeps_storage_order(run):
    location, _ = run
    stream = ActivaultStream(location, batch_size=50, shuffle=False)
    assert token_ids(list(stream)) == list(range(320))


@pytest.mark.parametrize("stop_after", [1, 5, 13, 16])
def test_state_dict_resumes_exactly(run, stop_after):
    location, _ = run
    kwargs = {"batch_size": 24, "mix_files": 2, "prefetch_files": 1, "seed": 3, "epochs": 2}
    reference = token_ids(list(ActivaultStream(location, **kwargs)))
    first = ActivaultStream(location, **kwargs)
    seen = []
    for i, batch in enumerate(first):
        seen.append(batch)
        if i + 1 == stop_after:
            break
    state = first.state_dict()
    second = ActivaultStream(location, **kwargs)
    second.load_state_dict(state)
    assert token_ids(seen) + token_ids(list(second)) == reference
    other = ActivaultStream(location, **{**kwargs, "seed": 4})
    with pytest.raises(ConfigError, match="different seed"):
        other.load_state_dict(state)


def test_ids_stay_with_their_rows_and_dataloader_works(run):
    location, _ = run
    stream = ActivaultStream(location, batch_size=32, seed=1, return_ids=True, dtype=torch.float64)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=0)
    batches = list(loader)
    states = torch.cat([b["states"] for b in batches])
    ids = torch.cat([b["input_ids"] for b in batches])
    assert states.dtype == torch.float64
    expected_ids = (np.arange(320, dtype=np.int64).reshape(40, 8) % 250) + 4  # conformance tokens
    np.testing.assert_array_equal(
        ids.numpy(), expected_ids.reshape(-1)[states[:, 0].long().numpy()]
    )
    assert stream.stats.files == 10 and stream.stats.tokens == 320


def test_worker_processes_are_refused(run):
    """Regression: with num_workers=1 the stream ran in the worker, so the main process's
    state_dict() stayed at the start and a resume repeated every token."""
    location, _ = run
    stream = ActivaultStream(location, batch_size=32)
    with pytest.raises(ConfigError, match="num_workers=0"):
        next(iter(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=1)))
