"""The documentation's promises that can be checked without a network: every ``pip install`` line
names extras that pyproject.toml declares and installs this package from a checkout (it is not on
a package index), and every relative link in README.md and the docs reaches a file of the
repository, and a heading of it where the link names one."""

from __future__ import annotations

import functools
import importlib
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]["name"]
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])

#: Markdown a person reads: the README, docs/, and the benchmark history linked from docs/.
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks" / "results").glob("*.md")])

# `pip install ...` up to the end of the line, an inline code span's end, a shell comment or the next `&&` / `;`.
INSTALL = re.compile(r"pip install ([^`\n;&#]*)")
INLINE_CODE = re.compile(r"(?<!`)`[^`]+`(?!`)")
EXTRAS_OF_CHECKOUT = re.compile(r"""(?:^|\s)['"]?\.\[([^\]]*)\]['"]?""")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def install_commands(text: str) -> list[str]:
    """Every ``pip install`` command of a document, in code blocks and inline code alike (an inline
    code span that wraps onto the next line is read as one line)."""
    text = INLINE_CODE.sub(lambda span: span.group(0).replace("\n", " "), text)
    return [match.group(1).strip() for match in INSTALL.finditer(text)]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r"#{1,6}\s+(.*)", line)
        if not match:
            continue
        anchor = github_anchor(match.group(1))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        result.add(anchor if count == 0 else f"{anchor}-{count}")
    return result


def relative_links(path: Path) -> list[str]:
    links = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not files here
                links.append(target)
    return links


def test_the_helpers_see_what_they_are_meant_to():
    assert install_commands('run `pip install -e ".[s3]"` or\n```\npip install obstore && x\n```') == [
        '-e ".[s3]"',
        "obstore",
    ]
    assert install_commands('a cluster (`pip install -e\n".[convert]"`; a local one)') == ['-e ".[convert]"']
    assert EXTRAS_OF_CHECKOUT.findall('-e ".[test,napari]"') == ["test,napari"]
    assert github_anchor("Adaptive dispatch of shard writes (`dispatch.py`)") == (
        "adaptive-dispatch-of-shard-writes-dispatchpy"
    )
    assert github_anchor("Throughput against footprint (pick a budget)") == "throughput-against-footprint-pick-a-budget"
    assert prose_lines("a\n```\n[x](gone.md)\n```\nb") == ["a", "b"]
    assert LINK.findall('see [the API](docs/api.md#writer-recording) and ![shot](docs/recorder.png "t")') == [
        "docs/api.md#writer-recording",
        "docs/recorder.png",
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_install_lines_install_this_package_from_a_checkout_with_extras_it_declares(doc):
    for command in install_commands(doc.read_text(encoding="utf-8")):
        words = command.replace('"', " ").replace("'", " ").split()
        assert not any(re.match(rf"{PROJECT}(\[|$)", word) for word in words), (
            f"{doc.name}: `pip install {command}` asks an index for {PROJECT}, which is installed from a "
            f'checkout: pip install -e ".[extra]"'
        )
        for group in EXTRAS_OF_CHECKOUT.findall(command):
            for extra in filter(None, (name.strip() for name in group.split(","))):
                assert extra in EXTRAS, f"{doc.name}: `pip install {command}` names extra {extra!r}: not in {EXTRAS}"


def test_the_readme_shows_how_to_install_every_extra_a_user_needs():
    readme = ROOT / "README.md"
    named = {
        extra.strip()
        for command in install_commands(readme.read_text(encoding="utf-8"))
        for group in EXTRAS_OF_CHECKOUT.findall(command)
        for extra in group.split(",")
    }
    assert EXTRAS - {"lint"} <= named, f"README.md never shows how to install {sorted(EXTRAS - {'lint'} - named)}"


def test_extras_that_name_other_extras_name_ones_that_exist():
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items():
        for requirement in requirements:
            match = re.match(rf"{PROJECT}\[([^\]]*)\]", requirement)
            if match:
                assert set(match.group(1).split(",")) <= EXTRAS, f"extra {extra!r}: {requirement!r}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_of_the_repository_and_its_heading(doc):
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no heading with that anchor in {path.relative_to(ROOT)})")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


#: the pages a user reads (the benchmark notebook and history in benchmarks/results/ keep their work notes)
USER_PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
#: notes only the people who wrote them can use: tracker numbers, work logs, the device kit, device calls
INTERNAL_NOTE = re.compile(r"\b(?:issues? \d+|sessions? \d+)|\.kit/|GPU machine, call", re.IGNORECASE)
BENCHMARKS_MAX_LINES = 300


@pytest.mark.parametrize("doc", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_carry_no_internal_notes(doc):
    found = [
        f"line {number}: {match.group(0)!r}"
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
        for match in INTERNAL_NOTE.finditer(line)
    ]
    assert not found, f"{doc.relative_to(ROOT)}: " + "; ".join(found)


def test_the_benchmarks_page_stays_one_table_per_question():
    lines = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= BENCHMARKS_MAX_LINES, (
        f"docs/benchmarks.md has {len(lines)} lines (at most {BENCHMARKS_MAX_LINES})"
    )


def _commands(text: str) -> list[str]:
    """The shell commands of a document's fenced and inline code, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", text)
    return re.findall(r"(?:^|`)[^`\n]*?\b((?:benchmarks|scripts)/[\w/]+\.(?:py|sh)\b[^`\n#]*)", text, re.M)


@pytest.mark.parametrize("doc", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_benchmark_commands_name_scripts_and_options_that_exist(doc):
    bad = []
    for command in _commands(doc.read_text(encoding="utf-8")):
        script = ROOT / command.split()[0]
        if not script.exists():
            bad.append(f"{command.split()[0]} (no such script)")
            continue
        source = script.read_text(encoding="utf-8")
        bad += [
            f"{script.name} {flag} (no such option)"
            for flag in re.findall(r"\s(--[\w-]+)", command)
            if f'"{flag}"' not in source and script.suffix == ".py"
        ]
    assert not bad, f"{doc.relative_to(ROOT)}: " + "; ".join(bad)


def test_api_md_names_every_public_name():
    import napari_tileshard
    from napari_tileshard.apps import inspect_shards

    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    public = [*napari_tileshard.__all__, "inspect_array", "list_images", "Inspection", "ShardInfo", "ImageEntry"]
    assert set(public[-5:]) <= set(inspect_shards.__all__)
    missing = [name for name in public if not re.search(rf"`[^`]*\b{re.escape(name)}\b[^`]*`", api)]
    assert not missing, f"docs/api.md never names {missing}"


#: modules whose ``__all__`` docs/api.md lists beside the top-level names
DOCUMENTED_MODULES = (
    "napari_tileshard.format",
    "napari_tileshard.format.layout",
    "napari_tileshard.storage.urls",
    "napari_tileshard.reader.shard_reader",
    "napari_tileshard.apps.mmcore",
    "napari_tileshard.testing",
)


@pytest.mark.parametrize("module", DOCUMENTED_MODULES)
def test_api_md_names_every_public_name_of_the_subpackages_it_lists(module):
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert f"`{module}`" in api, f"docs/api.md has no row for {module}"
    names = importlib.import_module(module).__all__
    missing = [name for name in names if not re.search(rf"`[^`]*\b{re.escape(name)}\b[^`]*`", api)]
    assert not missing, f"docs/api.md never names {module}'s {missing}"


#: a file name in inline code: ``a/b.py``, ``tests/x/test_y.py::test_z``, ``run.sh``
CODE_FILE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|sh))\b")
#: file names the pages use as placeholders (a user's script)
PLACEHOLDER_FILES = {"x.py"}


@functools.cache
def _repository_files() -> tuple[Path, ...]:
    """The checkout's files, less what a clean clone lacks (hidden folders, build outputs)."""
    return tuple(
        path
        for path in ROOT.rglob("*")
        if path.is_file()
        and not any(
            part.startswith(".") or part.endswith(".egg-info") or part == "__pycache__"
            for part in path.relative_to(ROOT).parts
        )
    )


@pytest.mark.parametrize("doc", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_the_pages_name_exist(doc):
    """A path is looked for from the repository root, the package, benchmarks/ and tests/, or as
    the end of any file's path; a bare name as any file's name."""
    files = _repository_files()
    names = {path.name for path in files}
    parts = [path.relative_to(ROOT).parts for path in files]
    ends = {"/".join(path[i:]) for path in parts for i in range(len(path))}
    missing = []
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        for code in re.findall(r"`([^`]+)`", line):
            for match in CODE_FILE.finditer(code):
                name = match.group(1)
                if name in PLACEHOLDER_FILES or (name in names if "/" not in name else name in ends):
                    continue
                missing.append(f"line {number}: {name}")
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: " + "; ".join(missing)


def test_the_memory_defaults_are_stated_as_the_code_has_them():
    """README and api.md say the GPU backend's default budget in the same words, from its constants."""
    from napari_tileshard.engine.backends.gpu import GpuBackend as gpu

    def gib(n: int) -> str:
        return f"{n >> 30} GiB"

    part = {0.125: "an eighth", 0.25: "a quarter", 0.5: "half"}
    expected = [
        f"{gib(gpu.DEFAULT_MAX_DEVICE_BYTES)} device (at most {part[gpu.DEFAULT_DEVICE_FRACTION]} of the free "
        f"device memory) and {gib(gpu.DEFAULT_MAX_HOST_BYTES)} pinned",
        f"at least {gib(gpu.LARGE_DEVICE_FREE)} free in a host with at least {gib(gpu.LARGE_HOST_RAM)} of RAM",
        f"up to {gib(gpu.LARGE_MAX_DEVICE_BYTES)} device ({part[gpu.LARGE_DEVICE_FRACTION]} the free memory) "
        f"and {gib(gpu.LARGE_MAX_HOST_BYTES)} pinned",
        f"pinned memory never more than {part[gpu.DEFAULT_HOST_FRACTION]} of the RAM",
    ]
    for doc in ("README.md", "docs/api.md"):  # docs/benchmarks.md refers to the README's
        text = " ".join((ROOT / doc).read_text(encoding="utf-8").split())
        assert all(phrase in text for phrase in expected), f"{doc}: {[p for p in expected if p not in text]}"


def test_the_readme_mda_example_attaches_the_sink_so_its_overflow_stop_can_land():
    """api.md: only ``sink.attach(core)`` hands frames over on the MDA thread and lets the sink stop
    an MDA it cannot keep up with; the README's example must be the one that works."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Record from Micro-Manager") :]
    example = section[section.index("```python") : section.index("```\n", section.index("```python") + 9)]
    assert "sink.attach(core)" in example and "output=sink" not in example
    assert "sink.attach(core)" in (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
