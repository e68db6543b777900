"""What a batch waiting for its copies keeps alive: the writer's fields of the source batch,
never its model inputs (on a GPU, a ring of ``copy_slots`` batches of inputs would stay in
device memory while their activations copy)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from actstore.capture import CaptureConfig, capture, load_model, open_source
from actstore.capture.copyout import Build, CopyOut, Sink
from actstore.formats import get_format, open_store


def _tensors(root: object) -> list[torch.Tensor]:
    """Tensors reachable from ``root`` through containers, partials and dataclasses."""
    found, seen, todo = [], set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, functools.partial):
            todo += [*obj.args, *obj.keywords.values()]
        elif isinstance(obj, dict):
            todo += list(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo += list(obj)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            todo += list(vars(obj).values())
    return found


class HoldAll(CopyOut):
    """A copy-out that holds every batch until ``close`` (as a ring holds ``copy_slots``)."""

    def __init__(self, sink: Sink) -> None:
        self.sink, self.held = sink, []

    def put(self, acts, build: Build) -> None:
        self.held.append(({name: a.clone() for name, a in acts.items()}, build))

    def close(self) -> None:
        for host, build in self.held:
            self.sink(build(host))


def test_a_batch_in_flight_holds_no_model_inputs(model_dir, text_file, tmp_path):
    rings: list[HoldAll] = []

    def copy_out(sink: Sink) -> HoldAll:
        rings.append(HoldAll(sink))
        return rings[-1]

    config = CaptureConfig(
        model=str(model_dir("gpt2")),
        dataset=str(text_file),
        sites=("resid.1",),
        context_length=16,
        batch_size=3,
        max_examples=7,
        progress=False,
    )
    spec = get_format("saev")
    out = str(tmp_path / "out")
    result = capture(config, lambda plan: spec.open_writer(plan, out), copy_out=copy_out)
    (ring,) = rings
    assert len(ring.held) == 3  # 3 + 3 + 1 examples
    assert [_tensors(build) for _, build in ring.held] == [[], [], []]
    assert [build.keywords["example_ids"].tolist() for _, build in ring.held] == [
        [0, 1, 2],
        [3, 4, 5],
        [6],
    ]
    reader = open_store(result.output)
    source = open_source(str(text_file), load_model(config.model), context_length=16)
    assert reader.n_examples == 7  # every batch written, in order
    np.testing.assert_array_equal(reader.tokens, source.token_ids[:7])
