"""Models larger than one GPU, on CPU with tiny real models: truncated loading (only blocks
0..L exist, later blocks' weights are never read) and device maps (accelerate's dispatch
hooks, with part of the model offloaded to disk), each bit-identical to today's capture."""

from __future__ import annotations

import dataclasses
import gc
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from actstore.capture import ActivationRecorder, CaptureConfig, capture, load_model
from actstore.capture.models import plan_model
from actstore.capture.placement import Placement, gpus_per_worker, parse_placement
from actstore.capture.weights import Checkpoint
from actstore.dist import capture_distributed
from actstore.errors import ConfigError, CorruptStoreError, StoreNotFoundError
from actstore.formats import get_format, open_store
from actstore.formats.registry import parse_options
from actstore.hub import resolve_checkpoint
from actstore.sites import SITE_KINDS, Site

VISION = {
    "clip": transformers.CLIPVisionModel,
    "siglip": transformers.SiglipVisionModel,
    "dinov2": transformers.Dinov2Model,
}
KINDS = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "bert", *VISION)
KINDS += ("embedded",)


def _name(kind: str, model_dir) -> str:
    return "embedded" if kind == "embedded" else str(model_dir(kind))


def _todays_model(model, kind: str):
    """The same model loaded as capture did before truncation: the whole checkpoint with
    ``from_pretrained``, then ``.to(device)``."""
    path = resolve_checkpoint(model.ckpt if kind != "embedded" else "embedded")
    module = VISION.get(kind, transformers.AutoModel).from_pretrained(path, dtype=torch.float32)
    module.eval().to("cpu")
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    blocks = next(m for m in lists if len(m) == model.n_layers)
    return dataclasses.replace(model, module=module, blocks=blocks)


def _inputs(kind: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    if kind in VISION:
        return {"pixel_values": torch.randn(2, 3, 32, 32)}
    ids = torch.randint(4, 300, (2, 9))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_model_holds_blocks_0_to_L_and_gives_todays_values(kind, model_dir):
    sites = [Site(k, 1) for k in SITE_KINDS]
    model = load_model(_name(kind, model_dir), sites=sites)
    today = _todays_model(model, kind)
    assert len(model.blocks) == 2 and len(today.blocks) == model.n_layers >= 4
    # later blocks are not allocated: the model holds blocks 0..1 and nothing else of them
    per_block = sum(p.numel() for p in today.blocks[0].parameters())
    block_params = sum(p.numel() for p in model.blocks.parameters())
    assert block_params == 2 * per_block
    full = dict(today.module.named_parameters())
    for name, param in model.module.named_parameters():
        assert name in full and param.shape == full[name].shape, name
    with torch.inference_mode():
        with ActivationRecorder(model, sites) as rec:
            got = rec.run(_inputs(kind))
        with ActivationRecorder(today, sites) as rec:
            want = rec.run(_inputs(kind))
    assert sorted(got) == sorted(want) and len(got) == len(SITE_KINDS)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_the_final_norm_of_a_truncated_model_is_never_run(model_dir):
    model = load_model(str(model_dir("llama")), sites=["resid.1"])
    with pytest.raises(ConfigError, match="norm was not loaded"), torch.inference_mode():
        model.module(**_inputs("llama"))  # the whole forward, no recorder to stop it
    with pytest.raises(ConfigError, match="needs block 3, but .* through block 1"):
        ActivationRecorder(model, [Site("resid", 3)])


def _sharded_copy(src: Path, dst: Path) -> dict[str, str]:
    """``src`` (tiny llama) saved in ~40 KB shards: about one block per file."""
    lm = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    lm.save_pretrained(dst, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]


def _capture_store(model: str, tmp_path: Path, tag: str, **overrides):
    cfg = CaptureConfig(
        model=model,
        dataset=overrides.pop("dataset"),
        sites=overrides.pop("sites", ("resid.0", "mlp_out.1", "resid.1")),
        batch_size=3,
        context_length=16,
        max_examples=7,
        progress=False,
        **overrides,
    )
    fmt = "activault"
    spec = get_format(fmt)
    options = parse_options(spec, ["rows_per_file=2", "dtype=float32"])
    out = str(tmp_path / tag)
    return open_store(capture(cfg, lambda plan: spec.open_writer(plan, out, options)).output)


def _assert_same_values(a, b) -> None:
    assert list(a.sites) == list(b.sites)
    for site in a.sites:
        got = np.concatenate([a.read_block(x) for x in a.blocks(site)])
        want = np.concatenate([b.read_block(x) for x in b.blocks(site)])
        np.testing.assert_array_equal(got, want)


def test_capture_needs_no_file_of_later_blocks(model_dir, text_file, tmp_path):
    """Shards holding only later blocks (and the final norm, the LM head) are deleted or
    overwritten with garbage: early sites still capture, with the intact model's values."""
    ckpt = tmp_path / "sharded"
    weight_map = _sharded_copy(model_dir("llama"), ckpt)
    plan = plan_model(str(ckpt), sites=["resid.1"])
    keep = plan.keep()
    later = sorted(
        {
            f
            for f in set(weight_map.values())
            if not any(keep(k) for k, g in weight_map.items() if g == f)
        }
    )
    assert len(later) >= 3 and len(set(weight_map.values())) - len(later) >= 3
    (ckpt / later[0]).unlink()
    for name in later[1:]:
        (ckpt / name).write_bytes(b"\xff" * 4096)
    kept, files = Checkpoint.find(str(ckpt)).read_plan(keep)
    assert not set(files) & set(later) and kept > 0
    intact = _capture_store(str(model_dir("llama")), tmp_path, "intact", dataset=str(text_file))
    damaged = _capture_store(str(ckpt), tmp_path, "damaged", dataset=str(text_file))
    _assert_same_values(damaged, intact)
    # the damage is real: a site in a later block cannot load
    with pytest.raises((StoreNotFoundError, CorruptStoreError)) as err:
        load_model(str(ckpt), sites=["resid.3"])
    assert "\n" not in str(err.value)


def test_corrupt_bytes_of_later_blocks_are_never_read(model_dir, text_file, tmp_path):
    """One model.safetensors whose later blocks' bytes are overwritten with NaN: the early
    sites load and equal the intact model's; the whole model reads the NaNs."""
    src = model_dir("llama")
    ckpt = tmp_path / "corrupt"
    shutil.copytree(src, ckpt)
    path = ckpt / "model.safetensors"
    raw = bytearray(path.read_bytes())
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    hit = 0
    for name, info in header.items():
        if ".layers.2." in name or ".layers.3." in name:
            start, stop = (8 + length + o for o in info["data_offsets"])
            raw[start:stop] = b"\xff" * (stop - start)
            hit += 1
    assert hit == 18  # 9 tensors per block
    path.write_bytes(bytes(raw))
    sites = [Site("resid", 1), Site("mlp_out", 1)]
    damaged, intact = load_model(str(ckpt), sites=sites), load_model(str(src), sites=sites)
    with torch.inference_mode():
        with ActivationRecorder(damaged, sites) as rec:
            got = rec.run(_inputs("llama"))
        with ActivationRecorder(intact, sites) as rec:
            want = rec.run(_inputs("llama"))
        assert all(torch.equal(got[k], want[k]) for k in want)
        whole = load_model(str(ckpt))
        assert torch.isnan(whole.blocks[2].mlp.up_proj.weight).all()


# ---------------------------------------------------------------- device maps

#: llama's modules: blocks 0 and 2 on the CPU, block 1 on disk (accelerate's offload hooks
#: stream it in for each forward); block 3 is after the deepest site, so never loaded.
DISK_MAP = {
    "embed_tokens": "cpu",
    "rotary_emb": "cpu",
    "layers.0": "cpu",
    "layers.1": "disk",
    "layers.2": "cpu",
    "layers.3": "disk",
    "norm": "cpu",
}


@pytest.mark.parametrize(
    ("fmt", "sites", "opts"),
    [
        ("saev", ("resid.0", "resid.1", "resid.2"), ["patches_per_shard=128"]),
        ("pickle", ("resid.1", "resid.2"), ["samples_per_shard=4"]),
        ("activault", ("attn_in.1", "mlp_out.1", "resid_pre.2"), ["rows_per_file=2"]),
        ("zarr", ("resid_mid.1", "attn_out.1", "resid.2"), []),
        ("saelens", ("resid.1", "mlp_out.2"), []),
    ],
)
def test_disk_offloaded_block_captures_todays_values_in_every_format(
    fmt, sites, opts, model_dir, text_file, tmp_path
):
    spec = get_format(fmt)
    options = parse_options(spec, opts)

    def run(tag: str, **placement):
        cfg = CaptureConfig(
            model=str(model_dir("llama")),
            dataset=str(text_file),
            sites=sites,
            batch_size=3,
            context_length=16,
            max_examples=7,
            progress=False,
            clean_tokens=spec.clean_tokens,
            **placement,
        )
        out = str(tmp_path / tag)
        result = capture(cfg, lambda plan: spec.open_writer(plan, out, options))
        return open_store(result.output)

    one = run("one")
    spread = run(
        "spread", device_map=json.dumps(DISK_MAP), offload_folder=str(tmp_path / "offload")
    )
    _assert_same_values(spread, one)


def test_auto_map_with_a_memory_cap_offloads_and_keeps_values(model_dir, text_file, tmp_path):
    model = str(model_dir("llama"))
    placement = parse_placement("auto", "cpu=120KB", str(tmp_path / "off"))
    plan = plan_model(model, sites=["resid.2"])
    device_map = plan.device_map(placement)
    assert set(device_map.values()) == {
        "cpu",
        "disk",
    }  # 120 KB: embeddings, block 0 (accelerate keeps room for the largest block)
    loaded = load_model(model, sites=["resid.2"], placement=placement)
    assert loaded.device_map == device_map and loaded.device == torch.device("cpu")
    # blocks 1 and 2 went to a folder of this load's own; block 3 was never read
    (folder,) = (tmp_path / "off").iterdir()
    assert {p.name.split(".")[1] for p in folder.glob("layers.*")} == {"1", "2"}
    # what the plan said each device holds is what the loaded model holds
    rows = {
        r.device: r for r in plan.memory(device_map, device="cpu", site_blocks=[2], batch_tokens=48)
    }
    held = {"cpu": 0, "disk": 0}
    for tensor in [*loaded.module.parameters(), *loaded.module.buffers()]:
        held["disk" if tensor.is_meta else "cpu"] += tensor.numel() * tensor.element_size()
    assert held == {"cpu": rows["cpu"].weights, "disk": rows["disk"].weights}
    del loaded
    gc.collect()
    assert not folder.exists()  # removed with the model
    spread = _capture_store(
        model,
        tmp_path,
        "auto",
        dataset=str(text_file),
        sites=("resid.2",),
        device_map="auto",
        max_memory="cpu=120KB",
        offload_folder=str(tmp_path / "off2"),
    )
    one = _capture_store(model, tmp_path, "one", dataset=str(text_file), sites=("resid.2",))
    _assert_same_values(spread, one)


def test_machine_slices_with_a_device_map_give_the_one_process_store(
    model_dir, text_file, tmp_path
):
    cfg = CaptureConfig(
        model=str(model_dir("llama")),
        dataset=str(text_file),
        sites=("resid.1", "resid.2"),
        batch_size=3,
        context_length=16,
        max_examples=9,
        progress=False,
    )
    spec = get_format("pickle")
    options = parse_options(spec, ["samples_per_shard=3"])
    one = capture(cfg, lambda plan: spec.open_writer(plan, str(tmp_path / "one"), options))
    spread = dataclasses.replace(
        cfg, device_map=json.dumps(DISK_MAP), offload_folder=str(tmp_path / "off")
    )
    out = str(tmp_path / "parts")
    for machine in (0, 1):
        done = capture_distributed(spread, "pickle", out, options, machine_id=machine, n_machines=2)
    _assert_same_values(open_store(done.published), open_store(one.output))


def test_placement_syntax():
    assert parse_placement("balanced").device_map == "balanced"
    p = parse_placement('{"embed_tokens": 0, "layers": "cuda:1", "norm": "CPU"}')
    assert p.device_map == {"embed_tokens": 0, "layers": 1, "norm": "cpu"}
    assert gpus_per_worker(p) == 2
    p = parse_placement("auto", '{"0": "70GiB", "cpu": 1000}')
    assert p.max_memory == {0: 70 * 2**30, "cpu": 1000} and gpus_per_worker(p) == 1
    p = parse_placement("sequential", "0=1.5GB, cuda:3=2MiB")
    assert p.max_memory == {0: 1_500_000_000, 3: 2 * 2**20} and gpus_per_worker(p) == 4
    assert gpus_per_worker(parse_placement("auto")) is None and not Placement().spread
    for args, message in [
        (("{'layers': 0}",), "not valid JSON"),
        (("[1, 2]",), "non-empty JSON object"),
        (("fastest",), "give one of auto, balanced"),
        (('{"layers": "tpu"}',), "'tpu' is not a device"),
        (('{"layers": -1}',), "-1 is not a device"),
        (("auto", "0=lots"), "'lots' is not a size"),
        (("auto", "0:70GiB"), "is not DEVICE=SIZE"),
        ((None, "0=70GiB"), "give --device-map auto"),
        (('{"": 0}', "0=70GiB"), "an explicit map already says"),
        (("missing.json",), "cannot read it"),
    ]:
        with pytest.raises(ConfigError, match=message) as err:
            parse_placement(*args)
        assert "\n" not in str(err.value)


# ---------------------------------------------------------------- the command


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run the ``actstore`` console script in-process; its exit code, stdout, stderr."""
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
    out = capsys.readouterr()
    return code, out.out, out.err


LLAMA_TOP = '"embed_tokens": "cpu", "rotary_emb": "cpu", "norm": "cpu"'


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--device-map", '{"embed_tokens": 0,'], "not valid JSON"),
        (
            ["--device-map", "{" + LLAMA_TOP + ', "layers": "cpu", "lm_head": "cpu"}'],
            "names 'lm_head', which is not a module of LlamaModel",
        ),
        (["--device-map", "{" + LLAMA_TOP + ', "layers.7": "cpu"}'], "the model has 4 blocks"),
        (["--device-map", '{"embed_tokens": "cpu"}'], "gives no device for 'layers.0."),
        (["--device-map", '{"": 0}'], "names cuda:0, but this machine has no CUDA devices"),
        (["--device-map", "auto", "--max-memory", "0=lots"], "'lots' is not a size"),
        (["--device-map", '{"": "disk"}'], "give --offload-folder DIR"),
        (["--device", "cuda", "--device-map", "auto"], "not both"),
    ],
)
def test_bad_placement_is_one_line_exit_2_nothing_written(
    extra, message, model_dir, text_file, tmp_path, capsys
):
    out = tmp_path / "acts"
    args = ["capture", "--model", str(model_dir("llama")), "--dataset", str(text_file)]
    code, _, err = _main([*args, "--layers", "1", "--out", str(out), *extra], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert message in errors[0], errors[0]
    assert not out.exists()


def test_dry_run_prints_each_devices_memory_and_loads_nothing(
    model_dir, text_file, tmp_path, capsys
):
    out, offload = tmp_path / "acts", tmp_path / "offload"
    args = ["capture", "--model", str(model_dir("llama")), "--dataset", str(text_file)]
    code, text, err = _main(
        [
            *args,
            "--sites",
            "resid.0,mlp_out.1",
            "--format",
            "zarr",  # saev stores the residual stream only
            "--batch-size",
            "4",
            "--context-length",
            "64",
            "--device-map",
            json.dumps(DISK_MAP),
            "--offload-folder",
            str(offload),
            "--dry-run",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    lines = text.splitlines()
    assert lines[0] == "Dry run: nothing loaded, nothing written."
    assert "blocks 0..1 of 4 loaded for resid.0, mlp_out.1" in lines[1]
    # embeddings (300 x 32) + blocks 0, 1 (9,216 values each), float32; the LM head and
    # blocks 2, 3 are not read
    assert lines[2].startswith("reads    110.0 KiB of 220.1 KiB from 1 of 1 checkpoint")
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("cpu", "disk"))}
    assert rows["cpu"][1] == "0" and rows["disk"][1] == "1"
    # both sites run on the CPU (block 1's weights stream in from disk): 2 x 4 x 64 x 32 x 4 B
    assert rows["cpu"][4:6] == ["64.0", "KiB"] and rows["disk"][4:6] == ["0", "B"]
    assert not out.exists() and not offload.exists()


def test_slurm_script_passes_the_device_map_and_checks_its_syntax():
    from typer.testing import CliRunner

    from actstore.cli import app

    runner = CliRunner()
    head = ["slurm-script", "--num-machines", "2", "--gpus-per-task", "8", "--"]
    args = ["--model", "gpt2", "--device-map", "auto", "--max-memory", "0=70GiB,cpu=200GiB"]
    ok = runner.invoke(app, [*head, *args])
    assert ok.exit_code == 0, ok.output
    assert "--gpus-per-task=8" in ok.output and "--device-map auto" in ok.output
    bad = runner.invoke(
        app, [*head, "--model", "gpt2", "--device-map", "auto", "--max-memory", "0=lots"]
    )
    assert bad.exit_code != 0 and "'lots' is not a size" in str(bad.exception)


def test_dry_run_reads_headers_and_downloads_no_weights(model_dir, monkeypatch):
    """``find(download=False)`` reads a local checkpoint as ``find`` does; a Hub checkpoint
    that is not on this machine (and a Hub that cannot be asked: offline) is not downloaded,
    and its size is reported unknown."""
    import huggingface_hub

    local = str(model_dir("llama"))
    plan = plan_model(local, sites=["resid.1"])
    assert Checkpoint.find(local, download=False) == Checkpoint.find(local)
    kept, files = Checkpoint.find(local, download=False).read_plan(plan.keep())
    assert (kept, files) == Checkpoint.find(local).read_plan(plan.keep()) and kept > 0
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    remote = Checkpoint.find("actstore-tests/never-downloaded", download=False)
    assert remote == Checkpoint(
        source="actstore-tests/never-downloaded", weight_map={}, total_size=None, mapped=False
    )
    assert remote.files == ["model.safetensors"]
    assert remote.read_plan(plan.keep()) == (None, ["model.safetensors"])


def test_a_device_map_strategy_is_not_a_device(model_dir):
    with pytest.raises(ConfigError) as err:
        load_model(str(model_dir("llama")), device="auto", sites=["resid.1"])
    assert str(err.value) == (
        "device 'auto' is a device map strategy, not a device; pass "
        "placement=parse_placement('auto') (--device-map auto)"
    )


def test_a_failed_load_leaves_no_offload_folder_behind(model_dir, tmp_path):
    ckpt, offload = tmp_path / "broken", tmp_path / "offload"
    shutil.copytree(model_dir("llama"), ckpt)
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 4096)
    placement = parse_placement(json.dumps(DISK_MAP), offload_folder=str(offload))
    with pytest.raises(CorruptStoreError) as err:
        load_model(str(ckpt), sites=["resid.2"], placement=placement)
    assert str(err.value).startswith(f"{ckpt / 'model.safetensors'} is not a readable")
    assert offload.is_dir() and list(offload.iterdir()) == []
