"""The preflight plan is the plan capture makes, so "Already captured" and the space
check, answered before any weights load, speak about the store capture would write."""

from __future__ import annotations

import pytest

from actstore.capture import CaptureConfig, plan_capture
from actstore.capture.preflight import preflight
from actstore.formats.registry import get_format, parse_options


@pytest.mark.parametrize(("kind", "fmt"), [("gpt2", "saev"), ("llama", "pickle")])
def test_preflight_plan_equals_the_capture_plan(tmp_path, model_dir, text_file, kind, fmt):
    config = CaptureConfig(
        model=str(model_dir(kind)),
        dataset=str(text_file),
        sites=("resid.1", "resid.-1"),
        context_length=32,
        max_examples=20,
        progress=False,
    )
    spec = get_format(fmt)
    pre = preflight(config, spec, str(tmp_path / "out"), parse_options(spec, []))
    try:
        assert not pre.complete and pre.writer is not None
        _, _, plan = plan_capture(config)
        assert pre.plan == plan
        assert pre.take_writer(plan) is not None and pre.writer is None
    finally:
        pre.release()


def test_image_models_get_the_cheap_checks_only(tmp_path, model_dir, image_folder):
    config = CaptureConfig(
        model=str(model_dir("clip")), dataset=str(image_folder), sites=("resid.-1",)
    )
    spec = get_format("saev")
    pre = preflight(config, spec, str(tmp_path / "out"), parse_options(spec, []))
    assert pre.writer is None and pre.plan is None and not pre.complete
    assert pre.sites[0].layer == pre.model.n_layers - 1 and pre.model.is_vision
    assert not (tmp_path / "out").exists()
