"""Generated responses load the whole model on ``--device``: a device map, which spreads
only the truncated capture model, is refused with them in one line, before anything loads."""

from __future__ import annotations

import sys

import pytest

from actstore.capture import CaptureConfig
from actstore.errors import ConfigError

REFUSAL = (
    "--generate-max-new-tokens loads the whole model on --device to generate, without "
    "--device-map: drop --device-map and give a --device that holds the model, or generate "
    "the responses first and give them with --response-field"
)


@pytest.mark.parametrize("device_map", ["auto", '{"": "cpu"}'])
def test_generated_responses_with_a_device_map_are_refused(device_map):
    with pytest.raises(ConfigError) as err:
        CaptureConfig(
            mode="prompt_response",
            generate_max_new_tokens=4,
            device_map=device_map,
            sites=("resid.-1",),
        )
    assert str(err.value) == REFUSAL
    # without generation the map is taken
    config = CaptureConfig(mode="prompt_response", device_map=device_map, sites=("resid.-1",))
    assert config.placement.spread


def test_generated_responses_with_a_device_map_are_one_line_from_the_cli(
    tmp_path, model_dir, capsys
):
    from actstore.cli import main

    data, out = tmp_path / "qa.jsonl", tmp_path / "out"
    data.write_text('{"prompt": "a b"}\n')
    argv = ["actstore", "capture", "--model", str(model_dir("gpt2")), "--dataset", str(data)]
    argv += ["--mode", "prompt-response", "--format", "zarr", "--generate-max-new-tokens", "3"]
    argv += ["--device-map", "auto", "--out", str(out), "--no-progress"]
    saved, sys.argv = sys.argv, argv
    try:
        with pytest.raises(SystemExit) as stop:
            main()
    finally:
        sys.argv = saved
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {REFUSAL}"]
    assert not out.exists()
