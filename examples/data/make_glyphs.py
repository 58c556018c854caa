"""Recipe: 62-class character images (FEMNIST's classes) with each font family a writer.

    .venv/bin/python -m examples.data.make_glyphs                 # apt-get downloads the font packages into a temp folder
    .venv/bin/python -m examples.data.make_glyphs --debs DIR      # the .deb files already downloaded into DIR

No package ships handwriting with writer ids that this machine can fetch, so this is the derived
fallback of notMNIST (Bulatov 2011: glyphs rendered from many fonts): the writers are the 165 font
families of the 90 Debian (bookworm) font packages pinned in ``PACKAGES``, among them handwriting
fonts (fonts-bwht, fonts-dkg-handwriting, fonts-sjfonts, fonts-femkeklaver, fonts-kristi...). A
family's styles (regular, bold, italic...) are its writer's pens. Rendering needs Pillow and
fontTools (both come with matplotlib, the ``sim`` extra); the .deb files are only unpacked into the
temp folder, never installed. Steps:

1. ``apt-get download`` each pinned package and ``dpkg-deb -x`` it; every ``.ttf`` / ``.otf`` file
   whose character map has all 62 characters ``0-9A-Za-z`` is a candidate, grouped by its family
   name (``ImageFont.getname()``); symbol and keyboard fonts (``EXCLUDED``) are dropped.
2. A writer writes each of the 62 characters once, in a style drawn (seeded by the family's name)
   from the family's styles.
3. A glyph is drawn white on black at 4x size so that the capital H's ink is ``CAP`` pixels tall
   once reduced, its baseline at row ``BASELINE`` and its ink centred across; then box-filtered down
   to ``SIDE`` x ``SIDE`` (16x16) and rounded to 0, 0.5 or 1 (which keeps the files at about 5 MB).
   Case stays visible (``o`` is smaller than ``O``), unlike glyphs scaled to fill the box.
4. Labels are FEMNIST's: 0-9 digits, 10-35 ``A-Z``, 36-61 ``a-z``. Per writer, a seeded 20% of its
   examples go to test/ and the rest to train/ (LEAF's ``--by_sample`` split).

The files are LEAF's JSON layout (``examples/data/glyphs/{train,test}/data.json``): ``x`` 256
floats in [0, 1] (row-major 16x16), ``y`` the class; ``load_data("leaf:examples/data/glyphs")``.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import string
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from examples.data._leaf_files import write_leaf

CHARACTERS = string.digits + string.ascii_uppercase + string.ascii_lowercase  # FEMNIST's class order
SIDE, CAP, BASELINE, SUPERSAMPLE = 16, 9, 12, 4
TEST_SHARE = 0.2
OUT = Path(__file__).resolve().parent / "glyphs"
#: Families that are symbols under letters' code points, keycaps, or math-only.
EXCLUDED = frozenset(
    {"D050000L", "Standard Symbols PS", "STIX Math", "Berenis ADF Pro Math", "Linux Biolinum Keyboard O"}
)
PACKAGES = (
    "fonts-adf-accanthis=0.20190904-2 fonts-adf-baskervald=0.20190904-2 fonts-adf-berenis=0.20190904-2 "
    "fonts-adf-gillius=0.20190904-2 fonts-adf-ikarius=0.20190904-2 fonts-adf-irianis=0.20190904-2 "
    "fonts-adf-libris=0.20190904-2 fonts-adf-mekanus=0.20190904-2 fonts-adf-oldania=0.20190904-2 "
    "fonts-adf-romande=0.20190904-2 fonts-adf-switzera=0.20190904-2 fonts-adf-tribun=0.20190904-2 "
    "fonts-adf-universalis=0.20190904-2 fonts-adf-verana=0.20190904-2 fonts-anonymous-pro=1.003-4 "
    "fonts-arkpandora=2.04-1.1 fonts-averia-gwf=1.00-3.1 fonts-averia-sans-gwf=1.00-2.1 "
    "fonts-averia-serif-gwf=1.00-2.1 fonts-beteckna=0.5-3 fonts-blankenburg=0.1-3 fonts-breip=1:0.5.1-3 "
    "fonts-bwht=0.1-3 fonts-cabin=1.5-3 fonts-cantarell=0.303.1-1 fonts-century-catalogue=001.001-8 "
    "fonts-cmu=0.7.0-5 fonts-comfortaa=3.001-3 fonts-comic-neue=2.51-4 fonts-courier-prime=0+git20190115-3 "
    "fonts-crosextra-caladea=20200211-1 fonts-crosextra-carlito=20220224-1 fonts-dancingscript=1.2-2 "
    "fonts-dejavu-core=2.37-6 fonts-dkg-handwriting=0.17-1 fonts-dustin=20030517-14 "
    "fonts-ebgaramond=0.016+git20210310.42d4f9f2-1 fonts-ecolier-court=1.00-6 fonts-ecolier-lignes-court=1.00-7 "
    "fonts-f500=1.0-10 fonts-fantasque-sans=1.7.2~alpha.3~dfsg-2 fonts-fanwood=1.1-7 fonts-femkeklaver=1.0-4 "
    "fonts-firacode=6.2-2 fonts-freefont-ttf=20120503-10 fonts-gfs-artemisia=1.1-6 fonts-gfs-baskerville=1.1-6 "
    "fonts-gfs-didot=1.1-7 fonts-go=0~20170330-1 fonts-goudybookletter=2010.07.03-6 fonts-hack=3.003-3 "
    "fonts-humor-sans=1.0-4 fonts-inconsolata=001.010-6 fonts-isabella=1.202-4 fonts-jura=5.103-3 "
    "fonts-karla=20201218-1 fonts-kristi=20101220-1 fonts-lato=2.0-2.1 fonts-league-spartan=2.210-1 "
    "fonts-leckerli-one=20120409-1 fonts-liberation=1:1.07.4-11 fonts-lindenhill=1.2-6 "
    "fonts-linuxlibertine=5.3.0-6 fonts-lobster=2.0-2.1 fonts-lobstertwo=2.0-2.1 fonts-monofur=1.0-3 "
    "fonts-mononoki=1.5+dfsg-1 fonts-noto-mono=20201225-1 fonts-oflb-euterpe=1.1-6 fonts-oldstandard=2.2really-4 "
    "fonts-open-sans=1.11-2 fonts-play=1.002+20150307.1-0.1 fonts-prociono=2.3-6 fonts-quattrocento=1.1-2.1 "
    "fonts-radisnoir=0.9b-5 fonts-roboto-unhinted=2:0~20170802-3 fonts-rufscript=010-6 fonts-sil-andika=6.101-2 "
    "fonts-sil-charis=6.101-1 fonts-sil-doulos=6.101-1 fonts-sil-gentium=20081126:1.03-4 fonts-sjfonts=2.1-2 "
    "fonts-staypuft=0.04-10 fonts-stix=1.1.1-4.1 fonts-texgyre=20180621-6 fonts-tomsontalks=1.1-9 "
    "fonts-tuffy=20120614-2.1 fonts-urw-base35=20200910-7 fonts-vollkorn=4.105-2 "
    "fonts-yanone-kaffeesatz=2.0+git20211102+ds-1"
).split()


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def download(folder: Path) -> Path:
    """``apt-get download`` the pinned packages into ``folder`` (needs ``apt-get update`` once)."""
    subprocess.run(["apt-get", "download", "-q", *PACKAGES], cwd=folder, check=True)
    return folder


def unpack(debs: Path, into: Path) -> list[Path]:
    """Every font file of the .deb files in ``debs``, each package unpacked into its own folder."""
    files = sorted(debs.glob("*.deb"))
    if len(files) < len(PACKAGES):
        raise SystemExit(f"{debs} holds {len(files)} .deb files; this recipe reads the {len(PACKAGES)} in PACKAGES")
    for deb in files:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(into / deb.name.split("_")[0])], check=True)
    return sorted(p for p in into.rglob("*") if p.suffix.lower() in (".ttf", ".otf") and p.is_file())


def families(fonts: list[Path]) -> dict[str, list[Path]]:
    """Family name -> its font files that have all 62 characters (other files are skipped)."""
    from fontTools.ttLib import TTFont
    from PIL import ImageFont

    out: dict[str, list[Path]] = {}
    for path in fonts:
        try:
            cmap = TTFont(path, lazy=True, fontNumber=0).getBestCmap() or {}
            family, _style = ImageFont.truetype(str(path), 20).getname()
        except Exception:  # noqa: BLE001 - a font file Pillow or fontTools cannot read is not a writer
            continue
        if family and family not in EXCLUDED and all(ord(c) in cmap for c in CHARACTERS):
            out.setdefault(family.strip(), []).append(path)
    return out


def render(path: Path, character: str) -> np.ndarray | None:
    """``SIDE`` x ``SIDE`` float32 in {0, 0.5, 1}: ``character`` in the font at ``path``, or None
    where it draws no ink."""
    from PIL import Image, ImageDraw, ImageFont

    probe = ImageFont.truetype(str(path), 100)
    _, top, _, bottom = probe.getbbox("H", anchor="ls")
    font = ImageFont.truetype(str(path), max(1, round(100 * CAP * SUPERSAMPLE / max(1, bottom - top))))
    side = SIDE * SUPERSAMPLE
    canvas = Image.new("L", (2 * side, 2 * side), 0)
    ImageDraw.Draw(canvas).text((side, BASELINE * SUPERSAMPLE + side // 2), character, fill=255, font=font, anchor="ls")
    columns = np.nonzero(np.asarray(canvas).max(axis=0))[0]
    if len(columns) == 0:
        return None
    left = (columns.min() + columns.max()) // 2 - side // 2
    glyph = canvas.crop((left, side // 2, left + side, side // 2 + side)).reduce(SUPERSAMPLE)
    return np.round(np.asarray(glyph, dtype=np.float32) / 255 * 2) / 2


def _pixels(image: np.ndarray) -> list[float | int]:
    return [int(v) if v in (0.0, 1.0) else float(v) for v in image.ravel()]


def build(debs: Path, out: Path = OUT) -> dict[str, int]:
    splits: dict[str, dict] = {"train": {}, "test": {}}
    with tempfile.TemporaryDirectory() as tmp:
        by_family = families(unpack(debs, Path(tmp)))
        for family, paths in sorted(by_family.items()):
            rng = np.random.default_rng(_seed(family))
            user = re.sub(r"[^a-z0-9]+", "_", family.lower()).strip("_")
            examples = []
            for label, character in enumerate(CHARACTERS):
                image = render(sorted(paths)[rng.integers(len(paths))], character)
                if image is not None and image.any():
                    examples.append((_pixels(image), label))
            test = set(rng.permutation(len(examples))[: round(len(examples) * TEST_SHARE)].tolist())
            for split, held_out in (("train", False), ("test", True)):
                chosen = [e for i, e in enumerate(examples) if (i in test) == held_out]
                splits[split][user] = {"x": [x for x, _ in chosen], "y": [y for _, y in chosen]}
    return write_leaf(out, splits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--debs", type=Path, help="a folder holding the pinned .deb files (default: apt-get download them)"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for path, size in build(args.debs or download(Path(tmp)), args.out).items():
            print(f"{path}: {size:,} bytes")


if __name__ == "__main__":
    main()
