"""The preflight plan is the plan capture makes, so "Already captured" and the space
check, answered before any weights load, speak about the store capture would write."""

from __future__ import annotations

import pytest

from actstore.capture import CaptureConfig, plan_capture
from actstore.capture.preflight import check_dataset, check_device, preflight
from actstore.errors import ConfigError, StoreNotFoundError
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


def _main(argv: list[str], capsys) -> tuple[int, str]:
    """Run the ``actstore`` console script in-process; its exit code and stderr."""
    import sys

    from actstore.cli import main

    saved = sys.argv
    sys.argv = ["actstore", *argv]
    try:
        main()
        code = 0
    except SystemExit as stop:
        code = int(stop.code or 0)
    finally:
        sys.argv = saved
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name", ["auto", "balanced", "balanced_low_0", "sequential"])
def test_a_device_map_strategy_given_as_device_is_refused_naming_device_map(name):
    with pytest.raises(ConfigError) as err:
        check_device(name)
    assert str(err.value) == (
        f"--device {name} is a device map strategy, not a device; use --device-map {name} "
        "(it spreads the model over this machine's devices)"
    )


def test_device_auto_is_one_line_before_the_dataset_is_read(tmp_path, model_dir, capsys):
    out = tmp_path / "out"
    args = ["capture", "--model", str(model_dir("gpt2")), "--dataset", str(tmp_path / "x.txt")]
    code, err = _main([*args, "--device", "auto", "--out", str(out), "--no-progress"], capsys)
    assert code == 2 and err.splitlines() == [
        (
            "error: --device auto is a device map strategy, not a device; use --device-map auto "
            "(it spreads the model over this machine's devices)"
        )
    ]
    assert not out.exists()


def test_a_missing_dataset_names_every_kind_token_files_included(tmp_path):
    with pytest.raises(StoreNotFoundError) as err:
        check_dataset(str(tmp_path / "train.bin"))
    assert str(err.value) == (
        f"dataset {tmp_path / 'train.bin'} does not exist; give an image folder, a .txt, "
        ".jsonl, .json, .csv, .parquet or .arrow file (or a folder of them), a .npy or .bin "
        "token file, a directory written by datasets' save_to_disk, or a Hub id (org/name)"
    )
