"""Render ``inference/<shard_hash>/visuals/`` for a run: PNGs, ``index.html``, ``latents.json``.

For each top latent (or the latents asked for) the highest-activating examples are drawn:
image patches highlighted for ViT data (images from the run's dataset link), token contexts
for text data (token ids from the shards' tokens.bin). For ViT data only patch tokens are
ranked (a CLS token is not a place in the image). The directory is built under a temporary
name and swapped in when complete.

``latents.json`` lists what was drawn: per latent its statistics and, per example, the
example index, the peak token and its activation.

Example:
    >>> from actstore.runs import Run
    >>> render_run(Run("runs/k3x9q2ab"), "val", VisualsConfig(n_latents=16))  # doctest: +SKIP
    PosixPath('runs/k3x9q2ab/inference/0c2e5a11/visuals')
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..errors import ConfigError, StoreNotFoundError
from ..formats.saev import SaevReader
from ..progress import bar_switch
from ..runs import Run
from ..sae.inference import PATCH_ACTS, load_inference
from ..sae.sparse import SparseActs
from ..storage import atomic_write_json, read_json
from .images import ModelView, open_images, render_example, tile_row
from .page import Section, index_html
from .select import Example, TokenRows, example_activations, summarise, top_examples, top_latents
from .text import Context, TokenText, context_html, render_contexts

log = logging.getLogger(__name__)

VISUALS = "visuals"


@dataclass(frozen=True, kw_only=True)
class VisualsConfig:
    """What to draw."""

    n_latents: int = 32
    """How many top latents (by total activation) to show."""
    latents: tuple[int, ...] = ()
    """Show exactly these latents instead of the top ones."""
    n_examples: int = 8
    """Examples per latent."""
    image_size: int = 160
    """Pixels per side of each example image."""
    context_before: int = 20
    """Text: tokens shown before the peak token."""
    context_after: int = 8
    """Text: tokens shown after the peak token."""

    def __post_init__(self) -> None:
        for name in ("n_latents", "n_examples", "image_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.context_before < 0 or self.context_after < 0:
            raise ConfigError("context_before and context_after must be >= 0")


def render_run(
    run: Run, shards: str = "val", config: VisualsConfig | None = None, *, progress: bool = True
) -> Path:
    """Draw the top latents of the run's SAE on ``shards`` (``train``, ``val`` or a path)."""
    config = config or VisualsConfig()
    shard_dir, split = run.resolve_shards(shards)
    out_dir = run.inference_dir(shard_dir)
    if not (out_dir / PATCH_ACTS).is_file():
        raise StoreNotFoundError(
            f"run {run.path} has no inference for {shard_dir} ({out_dir / PATCH_ACTS} is "
            f"missing); run `actstore inference --run {run.path} --shards {shards}` first"
        )
    record, acts = load_inference(out_dir)
    reader = SaevReader(shard_dir)
    md = reader.metadata
    is_text = reader.tokens is not None
    skip = (0,) if md.cls_token and not is_text and record["first_token"] == 0 else ()
    rows = TokenRows(
        rows_per_example=record["rows_per_example"],
        first_token=record["first_token"],
        n_examples=record["n_examples"],
        skip_tokens=skip,
    )
    if config.latents:
        summaries = [summarise(acts, rows, latent) for latent in config.latents]
    else:
        summaries = top_latents(acts, rows, config.n_latents)
    dataset = _dataset(run, split, md, needed=not is_text)
    tmp = out_dir / f".{VISUALS}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if is_text:
            sections, listing = _draw_text(reader, acts, rows, summaries, config, tmp, progress)
        else:
            sections, listing = _draw_images(
                reader, acts, rows, summaries, config, dataset, tmp, progress
            )
        facts = _facts(run, record, md, dataset, acts)
        title = f"SAE latents of run {run.run_id} on {shard_dir.name}"
        (tmp / "index.html").write_text(index_html(title, facts, sections), encoding="utf-8")
        atomic_write_json(tmp / "latents.json", {"shards": str(shard_dir), "latents": listing})
        final = out_dir / VISUALS
        _swap_in(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %d latents to %s", len(sections), final / "index.html")
    return final


def _dataset(run: Run, split: str | None, md, *, needed: bool) -> Path:
    """The original dataset: the run's link for a linked split, else the shards' metadata.
    Text visuals read tokens.bin and only name the dataset, so a moved text file is fine."""
    try:
        return run.dataset(split) if split else Path(md.dataset)
    except StoreNotFoundError:
        if needed:
            raise
        return Path(md.dataset)


def _stats_line(summary, rows: TokenRows) -> str:
    n_tokens = rows.n_examples * (rows.rows_per_example - len(rows.skip_tokens))
    mean = summary.total / summary.count if summary.count else 0.0
    return (
        f"active on {summary.count} of {n_tokens} tokens "
        f"({100 * summary.count / max(n_tokens, 1):.2f}%), peak {summary.peak:.3g}, "
        f"mean when active {mean:.3g}"
    )


def _listing(summary, examples: list[Example], extra: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "latent": summary.latent,
        "count": summary.count,
        "total": summary.total,
        "peak": summary.peak,
        "examples": [
            {"example": e.example, "token": e.token, "value": e.value, **x}
            for e, x in zip(examples, extra)
        ],
    }


def _draw_images(
    reader: SaevReader,
    acts: SparseActs,
    rows: TokenRows,
    summaries,
    config,
    dataset: Path,
    out: Path,
    progress: bool,
):
    md = reader.metadata
    images = open_images(dataset, md.n_examples)
    view = ModelView.load(md.ckpt)
    labels, classes = reader.labels, reader.classes
    patch_rows = np.arange(rows.rows_per_example)
    patch_rows = patch_rows[~np.isin(rows.first_token + patch_rows, rows.skip_tokens)]
    if len(patch_rows) != md.patches_per_ex:
        raise ConfigError(
            f"the inference holds {len(patch_rows)} patch rows per example but the shards "
            f"have {md.patches_per_ex} patches; rerun inference with --force"
        )
    sections, listing = [], []
    for summary in tqdm(summaries, desc="visuals", unit="latent", **bar_switch(progress)):
        examples = top_examples(acts, summary.latent, rows, config.n_examples)
        tiles, lines, extra = [], [], []
        for e in examples:
            heat = example_activations(acts, summary.latent, rows, e.example)[patch_rows]
            name = images.describe(e.example)
            label = ""
            if labels is not None and classes is not None:
                label = classes[int(labels[e.example, 0])]
            caption = f"#{e.example} {label} {e.value:.3g}".replace("  ", " ")
            tiles.append(
                render_example(
                    view(images.load(e.example)),
                    heat,
                    scale_max=summary.peak,
                    size=config.image_size,
                    caption=caption,
                )
            )
            lines.append(f"#{e.example} {name}: peak {e.value:.4g} at token {e.token}")
            extra.append({"image": name, "label": label or None})
        png = f"latent_{summary.latent:05d}.png"
        size = _save_png(tile_row(tiles) if tiles else None, out / png)
        sections.append(
            Section(
                latent=summary.latent,
                stats=_stats_line(summary, rows),
                png=png,
                png_size=size,
                examples=lines,
            )
        )
        listing.append(_listing(summary, examples, extra))
    return sections, listing


def _draw_text(
    reader: SaevReader,
    acts: SparseActs,
    rows: TokenRows,
    summaries,
    config,
    out: Path,
    progress: bool,
):
    md = reader.metadata
    text = TokenText.load(md.ckpt)
    token_ids = reader.tokens
    assert token_ids is not None  # only text stores (with tokens.bin) are drawn as text
    sections, listing = [], []
    for summary in tqdm(summaries, desc="visuals", unit="latent", **bar_switch(progress)):
        examples = top_examples(acts, summary.latent, rows, config.n_examples)
        contexts, extra = [], []
        for e in examples:
            values = np.zeros(md.tokens_per_ex, dtype=np.float32)
            values[rows.first_token :] = example_activations(acts, summary.latent, rows, e.example)
            start = max(0, e.token - config.context_before)
            stop = min(md.tokens_per_ex, e.token + config.context_after + 1)
            pieces = text.pieces(token_ids[e.example, start:stop])
            contexts.append(
                Context(
                    example=e.example,
                    peak_token=e.token,
                    pieces=pieces,
                    values=values[start:stop],
                    start=start,
                )
            )
            extra.append({"text": "".join(pieces)})
        png = f"latent_{summary.latent:05d}.png"
        image = render_contexts(contexts, scale_max=summary.peak) if contexts else None
        size = _save_png(image, out / png)
        sections.append(
            Section(
                latent=summary.latent,
                stats=_stats_line(summary, rows),
                png=png,
                png_size=size,
                contexts_html=[context_html(c, summary.peak) for c in contexts],
            )
        )
        listing.append(_listing(summary, examples, extra))
    return sections, listing


def _save_png(image, path: Path) -> tuple[int, int]:
    from PIL import Image

    if image is None:  # a latent that never fires: a small blank placeholder
        image = Image.new("RGB", (120, 24), "white")
    image.save(path, format="PNG", optimize=False)
    return image.size


def _facts(
    run: Run, record: dict[str, Any], md, dataset: Path, acts: SparseActs
) -> list[tuple[str, str]]:
    facts = [
        ("run", str(run.path)),
        ("model", f"{md.ckpt} ({md.family})"),
        ("layer", str(record["layer"])),
        ("shards", record["shards"]),
        ("dataset", str(dataset)),
    ]
    try:
        trained = read_json(run.config_path)
    except StoreNotFoundError:
        trained = {}
    sae = trained.get("sae", {})
    if sae:
        kind = f"TopK (k={sae['k']})" if sae.get("kind") == "topk" else "ReLU + L1"
        facts.append(("SAE", f"{kind}, {sae['d_sae']} latents over d_model={sae['d_model']}"))
    val = trained.get("metrics", {}).get("val", {})
    if val:
        facts.append(
            (
                "held-out",
                (
                    f"explained variance {val['explained_variance']:.3f}, "
                    f"L0 {val['l0']:.1f}, dead {100 * val['dead_fraction']:.1f}%"
                ),
            )
        )
    l0 = acts.nnz / max(acts.n_rows, 1)
    facts.append(("tokens here", f"{acts.n_rows} rows, {l0:.1f} active latents per token"))
    return facts


def _swap_in(tmp: Path, final: Path) -> None:
    """Replace ``final`` by ``tmp``: the old directory is renamed aside, then deleted."""
    old = final.parent / f".{final.name}.old.{os.getpid()}"
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
