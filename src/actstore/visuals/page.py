"""The static HTML index of a visuals directory: one section per latent, relative links only.

The page has no scripts and loads nothing from the network, so it opens from disk
(``file://``) or from any static file server.

Example:
    >>> page = index_html("run x", [("layer", "3")], [])
    >>> page.startswith("<!doctype html>") and "<title>run x</title>" in page
    True
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin: 1.6em 0 .3em; }
table.facts td { padding: 0 1em 0 0; } table.facts td:first-child { color: #666; }
nav a { margin-right: .6em; } .stats { color: #555; margin: 0 0 .4em; }
img { border: 1px solid #ddd; max-width: 100%; height: auto; image-rendering: auto; }
ol.contexts { font-family: ui-monospace, monospace; font-size: 13px; padding-left: 2.5em; }
ol.contexts li { margin: .25em 0; white-space: pre-wrap; }
span.peak { text-decoration: underline; font-weight: bold; }
ul.examples { color: #555; font-size: 13px; columns: 2; }
"""


@dataclass
class Section:
    """One latent: its statistics line, its PNG and the examples shown."""

    latent: int
    stats: str
    png: str
    png_size: tuple[int, int]
    examples: list[str] = field(default_factory=list)
    """One line per example (plain text, escaped on output)."""
    contexts_html: list[str] = field(default_factory=list)
    """Highlighted token contexts (already safe HTML), for text data."""


def index_html(title: str, facts: list[tuple[str, str]], sections: list[Section]) -> str:
    """The whole page."""
    esc = html.escape
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        '<table class="facts">',
        *(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in facts),
        "</table>",
    ]
    if sections:
        links = " ".join(f'<a href="#latent-{s.latent}">{s.latent}</a>' for s in sections)
        parts.append(f"<nav>Latents: {links}</nav>")
    for s in sections:
        w, h = s.png_size
        parts += [
            f'<section id="latent-{s.latent}">',
            f"<h2>Latent {s.latent}</h2>",
            f'<p class="stats">{esc(s.stats)}</p>',
            (
                f'<img src="{esc(s.png)}" width="{w}" height="{h}" '
                f'alt="top examples of latent {s.latent}">'
            ),
        ]
        if s.contexts_html:
            parts.append('<ol class="contexts">')
            parts += [f"<li>{c}</li>" for c in s.contexts_html]
            parts.append("</ol>")
        if s.examples:
            parts.append('<ul class="examples">')
            parts += [f"<li>{esc(e)}</li>" for e in s.examples]
            parts.append("</ul>")
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
