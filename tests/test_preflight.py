"""The preflight plan is the plan capture makes, so "Already captured" and the space
check, answered before any weights load, speak about the store capture would write."""

from __future__ import annotations

import pytest

from actstore.capture import CaptureConfig, plan_capture
from actstore.capture.preflight import preflight
from actstore.formats.registry import get_format, parse_options


@pytest.mark.parametrize(
    ("kind", "fmt"),
    [
        ("gpt2", "saev"),
        ("llama", "pickle"),
        ("clip", "saev"),
        ("siglip", "saev"),
        ("dinov2", "saev"),
    ],
)
def test_preflight_plan_equals_the_capture_plan(
    tmp_path, model_dir, text_file, image_folder, kind, fmt
):
    vision = kind in ("clip", "siglip", "dinov2")
    config = CaptureConfig(
        model=str(model_dir(kind)),
        dataset=str(image_folder if vision else text_file),
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


def test_prompt_response_gets_the_cheap_checks_only(tmp_path, model_dir):
    data = tmp_path / "qa.jsonl"
    data.write_text('{"prompt": "a b", "response": "c d"}\n')
    config = CaptureConfig(
        model=str(model_dir("gpt2")), dataset=str(data), sites=("resid.-1",), mode="prompt_response"
    )
    spec = get_format("zarr")
    pre = preflight(config, spec, str(tmp_path / "out"), parse_options(spec, []))
    assert pre.writer is None and pre.plan is None and not pre.complete
    assert pre.sites[0].layer == pre.model.n_layers - 1 == 3
    assert not (tmp_path / "out").exists()
