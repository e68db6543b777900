"""The writer thread: bounded queue, back-pressure, order kept, errors surfaced."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from actstore.batch import Batch
from actstore.capture import BackgroundWriter
from actstore.errors import CaptureError, StoreNotFoundError
from actstore.formats.writerbase import WriterBase


class SlowWriter(WriterBase):
    def __init__(self, delay=0.0, fail_at=None):
        self.delay, self.fail_at, self.seen, self.closed = delay, fail_at, [], False
        self.max_pending = 0

    def write(self, batch):
        if self.fail_at is not None and int(batch.example_ids[0]) == self.fail_at:
            raise OSError("disk full")
        time.sleep(self.delay)
        self.seen.append(int(batch.example_ids[0]))

    @classmethod
    def from_plan(cls, plan, location, options=None):
        return cls()

    def close(self):
        self.closed = True
        return "done"

    def abort(self):
        pass


def batch(i):
    return Batch(acts={"resid.0": torch.zeros(1, 2, 3)}, example_ids=np.array([i]))


def test_full_queue_blocks_the_producer_and_drops_nothing():
    writer = SlowWriter(delay=0.02)
    bg = BackgroundWriter(writer, queue_size=2)
    sizes = []
    for i in range(20):
        bg.put(batch(i))
        sizes.append(bg._queue.qsize())
    assert bg.close() == "done" and writer.closed
    assert writer.seen == list(range(20))  # every batch, in order
    assert max(sizes) <= 2  # memory bounded by the queue
    assert bg.blocked_s > 0.1  # the producer waited instead of dropping


def test_writer_error_reaches_the_producer():
    bg = BackgroundWriter(SlowWriter(fail_at=3), queue_size=1)
    with pytest.raises(CaptureError, match="disk full"):
        for i in range(50):
            bg.put(batch(i))
        bg.close()
    assert not any(t.name == "actstore-writer" and t.is_alive() for t in threading.enumerate())


def test_a_failing_writer_aborts_the_capture_and_publishes_nothing(
    model_dir, image_folder, tmp_path
):
    """A real writer failing on its thread: capture raises in the main thread, the writer
    thread is gone, and nothing a reader accepts was published."""
    from actstore.capture import CaptureConfig, capture
    from actstore.formats.saev import SaevReader, SaevWriter

    def open_writer(plan):  # a store keeping token ids, but image batches carry none
        return SaevWriter.from_plan(dataclasses.replace(plan, has_tokens=True), tmp_path)

    cfg = CaptureConfig(
        model=str(model_dir("clip")),
        dataset=str(image_folder),
        sites=("resid.1",),
        batch_size=4,
        progress=False,
    )
    with pytest.raises(CaptureError, match="the writer failed: .*keeps token ids"):
        capture(cfg, open_writer)
    assert not any(t.name == "actstore-writer" and t.is_alive() for t in threading.enumerate())
    assert list(tmp_path.iterdir()) == []  # nothing was durable: no partial is left behind
    with pytest.raises(StoreNotFoundError):
        SaevReader(tmp_path)
