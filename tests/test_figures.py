"""The docs' figures and the results files they come from: every image a page embeds exists and is small, every
figure of benchmarks/plots.py draws from the committed results files, and every current results file says where,
when, how and from which commit it was measured."""

import re

import pytest

from tests.docs_pages import PAGES, ROOT, prose
from tests.helpers import benchmark

RESULTS = ROOT / "benchmarks" / "results"
MAX_IMAGE_BYTES = 150_000
HEADER = re.compile(r"^Machine: .+; date: \d{4}-\d{2}-\d{2}.*; command: `.+`; commit: [0-9a-f]{7,}")


def _plots():
    return benchmark("plots")


def _embedded():
    return [(page, target) for page in PAGES for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", prose(page))]


@pytest.mark.parametrize("page, target", _embedded(), ids=[f"{p.name}:{t}" for p, t in _embedded()])
def test_every_embedded_image_exists_and_is_small(page, target):
    image = (page.parent / target).resolve()
    assert image.is_file(), f"{page.name} embeds {target}, which does not exist"
    assert image.stat().st_size < MAX_IMAGE_BYTES, f"{target}: {image.stat().st_size} bytes"


def test_every_figure_draws_from_the_committed_results_files_and_is_embedded(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    plots = _plots()
    written = plots.render(images=tmp_path)
    assert sorted(path.name for path in written) == sorted(figure.image for figure in plots.FIGURES)
    for path in written:
        assert path.stat().st_size < MAX_IMAGE_BYTES, f"{path.name}: {path.stat().st_size} bytes"
    embedded = {(page.parent / target).resolve() for page, target in _embedded()}
    assert {(plots.IMAGES / figure.image).resolve() for figure in plots.FIGURES} <= embedded


CURRENT = sorted(RESULTS.glob("*.md")) + [RESULTS / "gpu_kit_h100" / "bench.md"]


@pytest.mark.parametrize("path", CURRENT, ids=[str(p.relative_to(RESULTS)) for p in CURRENT])
def test_every_current_results_file_starts_with_machine_date_command_and_commit(path):
    first = path.read_text().splitlines()[0]
    assert HEADER.match(first), f"{path.relative_to(ROOT)}: its first line is {first[:120]!r}"
