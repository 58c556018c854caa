"""The command line the exporter-fixture scripts share (``sklearn_fixtures``, ``paddle_fixtures``,
``jax_fixtures``): ``--out``, the fixtures made there, and their ``manifest.json`` beside them. It
imports nothing but the standard library, so each script runs it in its exporter's own virtualenv."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def make_fixtures(doc: str, default_out: Path, make: Callable[[Path], dict[str, Any]]) -> tuple[dict[str, Any], Path]:
    """Parse ``--out``, run ``make`` there and write its manifest; returns the manifest and the folder."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=default_out)
    out: Path = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    manifest = make(out)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest, out
