"""The README's code runs as written: every ``python`` block marked ``<!-- readme-test -->`` is run,
in order, in one namespace, in an empty folder (the Minimal API section: Writer, ShardReader,
zero-copy input, OME-Zarr), on this machine whatever its GPU."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
MARKED = re.compile(r"^[ \t]*<!-- readme-test -->[ \t]*\n([ \t]*)```python[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)


def readme_blocks() -> list[str]:
    return [textwrap.dedent(code) for _, code in MARKED.findall(README.read_text())]


def test_the_marked_blocks_are_the_minimal_api_sections_code():
    text = README.read_text()
    section = text[text.index("## Minimal API") : text.index("\n## ", text.index("## Minimal API") + 1)]
    blocks = readme_blocks()
    assert len(blocks) == section.count("```python") == 4  # every snippet of the section, and only those
    assert "ShardReader(" in blocks[1] and "owned_by(rank, world_size)" in blocks[1]


def test_the_readme_snippets_run_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for number, code in enumerate(readme_blocks()):
        try:
            exec(compile(code, f"README.md block {number}", "exec"), namespace)
        except Exception as exc:  # noqa: BLE001 - which block failed, with its code
            pytest.fail(f"README block {number} failed: {exc!r}\n{code}")
    reader = namespace["r"]
    assert namespace["rows"].shape == (800, 2048) and namespace["a"].shape == (10, 2048, 512)
    assert reader.backend in ("cpu", "gpu") and namespace["mine"].reads
    assert {read.index % 2 for read in namespace["mine"].reads} == {0}  # worker 0 of 2
    assert namespace["w"].pyramid.levels > 1  # the OME block's Writer
    reader.close()
