"""The manual: README.md stays a ten-minute read, every relative link resolves, and the site builds strictly.

* ``mkdocs build --strict`` (what ``make docs`` runs) succeeds into a temporary folder: a broken link or anchor in
  docs/, a missing page, or a docstring griffe cannot read fails ``make test`` (about 10 s here, so not ``slow``);
* README.md has at most 250 lines;
* every relative link (and image) in README.md and docs/**/*.md names a file that exists, and an ``#anchor`` on a
  Markdown page names one of its headings;
* each API page renders its module, and the README's module table reaches docs/modules.md;
* in the built site (the same build): no Sphinx role shows raw (docs/_griffe_ext.py makes them links), every name
  of each public package's ``__all__`` and every notebook verb has an entry in the search index, config fields
  show their help, and the trainers page its shapes;
* an ``Args:`` entry that documents several parameters at once (``a, b: ...``) names real parameters: the strict
  build lets griffe's warnings on that form through (docs/_hooks.py), so this test checks what griffe cannot.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
# the public modules whose docstrings make the API reference (docs/api/<name>.md holds `::: lightning_nb.<name>`)
API_MODULES = ("store", "tracing", "runners", "proxy", "engines", "trainers", "algorithm", "adapter", "agents",
               "tasks", "rewards", "types", "errors", "semconv")
# the packages whose __all__ is the public API: the site has an entry for every name in them
PUBLIC_PACKAGES = ("lightning_nb", *(f"lightning_nb.{name}" for name in API_MODULES), "lightning_nb.replay")
# the notebook verbs and the calls a step makes, every algorithm's (listed under Algorithm on the site)
ALGORITHM_VERBS = ("start", "run", "step", "pause", "resume", "wait", "stop", "progress", "state", "at_boundary",
                   "report_progress", "wait_for", "record", "metrics_df", "save", "load")
RAW_ROLE = re.compile(r":(meth|class|func|attr|exc|mod|data|obj):")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _without_code(text: str) -> str:
    """``text`` with fenced code blocks and inline code spans blanked (links there are not links)."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _links(text: str) -> list[str]:
    """Targets of the Markdown links and images of ``text``: ``[x](target)``, ``![x](target "title")``."""
    return [m.group(1) for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)",
                                            _without_code(text))]


def _anchors(page: Path) -> set[str]:
    """The heading ids of a Markdown page, as the ``toc`` extension writes them."""
    from markdown.extensions.toc import slugify

    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", re.sub(r"^(```|~~~).*?^\1", "", page.read_text(),
                                                          flags=re.S | re.M), re.M)
    return {slugify(re.sub(r"[`*_]", "", h), "-") for h in headings}


def test_readme_is_a_ten_minute_read():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail "
                                       "to a page under docs/ and link it from the README")


def test_every_relative_link_points_to_a_file_that_exists():
    broken = []
    for page in _pages():
        for target in _links(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: {dest.relative_to(ROOT)} has no heading #{anchor}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_checker_sees_links():
    """The link pattern finds the README's links to docs/ (so the test above checks something)."""
    links = _links((ROOT / "README.md").read_text())
    assert "docs/one-step.md" in links and "docs/glossary.md" in links, links


def test_api_pages_render_the_public_modules():
    for name in API_MODULES:
        page = ROOT / "docs" / "api" / f"{name}.md"
        assert page.exists(), f"no API page {page.relative_to(ROOT)}"
        assert re.search(rf"^::: lightning_nb\.{name}\s*$", page.read_text(), re.M), f"{page.name} lacks ::: lightning_nb.{name}"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """`make docs`' build (mkdocs build --strict) into a temporary folder, once for the tests below that read it."""
    out_dir = tmp_path_factory.mktemp("docs") / "site"
    t0 = time.perf_counter()
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out_dir)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    seconds = time.perf_counter() - t0
    print(f"\n[test_docs] mkdocs build --strict: {seconds:.1f} s")
    assert out.returncode == 0, f"mkdocs build --strict failed (rc {out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out_dir


def test_mkdocs_build_is_strict_and_passes(site):
    """Warnings are errors; the module table and every API page rendered."""
    modules = (site / "modules" / "index.html").read_text()
    assert "lightning_nb/cli/" in modules, "docs/modules.md did not include README.md's module table"
    for name in API_MODULES:
        html = (site / "api" / name / "index.html").read_text()
        assert f'id="lightning_nb.{name}"' in html, f"the API page of lightning_nb.{name} rendered no module"


def test_no_raw_sphinx_role_in_the_built_site(site):
    """docs/_griffe_ext.py turns every ``:meth:`x``` of a docstring into a link (or plain code): none shows raw."""
    raw = []
    for page in sorted(site.rglob("*.html")):
        for m in RAW_ROLE.finditer(page.read_text()):
            raw.append(f"{page.relative_to(site)}: ...{m.string[max(0, m.start() - 60):m.end() + 40]!r}")
    assert not raw, f"{len(raw)} raw Sphinx roles in the built HTML:\n" + "\n".join(raw[:20])
    algorithm = (site / "api" / "algorithm" / "index.html").read_text()
    links = re.findall(r'<a class="autorefs autorefs-internal"[^>]*href="([^"]*)"', algorithm)
    assert "#lightning_nb.algorithm.base.Algorithm.at_boundary" in links, "Algorithm's :meth:`at_boundary` is no link"
    assert len(links) > 100, f"only {len(links)} cross-reference links on the algorithm page"


def test_every_public_name_is_in_the_search_index(site):
    """Each name of each public package's ``__all__`` has an entry (a heading the search finds) on the site, and so
    do the notebook verbs of the Algorithm contract and LightningRL's save / load."""
    import importlib
    import json

    index = json.loads((site / "search" / "search_index.json").read_text())
    anchors = {d["location"].split("#", 1)[1] for d in index["docs"] if "#" in d["location"]}
    names = {a.rsplit(".", 1)[-1] for a in anchors}
    missing = []
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        missing += [f"{package}.{n}" for n in getattr(module, "__all__", ()) if n not in names]
    for verb in ALGORITHM_VERBS:
        if f"lightning_nb.algorithm.base.Algorithm.{verb}" not in anchors:
            missing.append(f"Algorithm.{verb}")
    for verb in ("save", "load"):
        if f"lightning_nb.algorithm.LightningRL.{verb}" not in anchors:
            missing.append(f"LightningRL.{verb}")
    assert not missing, "public names with no entry on the site (add them to a docs/api page, or give them a " \
                        "docstring or a #: comment):\n" + "\n".join(missing)


def test_config_help_defaults_and_shapes_render(site):
    """Config fields show their ``metadata["help"]``; a grouped ``critic, editor`` entry its default, not
    "required"; the trainers page explains the shape suffixes and lists shape-named parameters."""
    trainers = re.sub(r"<[^>]+>", " ", (site / "api" / "trainers" / "index.html").read_text())
    trainers = re.sub(r"\s+", " ", html.unescape(trainers))
    assert "learning_rate : float = 2e-05 AdamW learning rate" in trainers, "TrainerConfig's field help is missing"
    assert "Shapes" in trainers and "ids_B_T" in trainers and "mask_B_L" in trainers
    algorithm = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", (site / "api" / "algorithm" / "index.html").read_text()))
    row = re.search(r"critic, editor (.{0,900}?) resources_id", algorithm)
    assert row and "required" not in row.group(1) and row.group(1).rstrip().endswith("None"), \
        "APO's critic, editor row: " + (row.group(1) if row else "not found")


def test_grouped_parameter_entries_name_real_parameters():
    """An ``Args:`` entry ``a, b: ...`` (or ``a / b: ...``) documents parameters that exist (or a ``**kwargs``)."""
    griffe = pytest.importorskip("griffe")

    def walk(obj):
        for member in obj.members.values():
            if member.is_alias:
                continue
            yield member
            if member.is_module or member.is_class:
                yield from walk(member)

    package = griffe.load("lightning_nb", search_paths=[str(ROOT)], docstring_parser="google",
                          resolve_aliases=False)
    wrong, grouped = [], 0
    for obj in walk(package):
        if not (obj.is_function or obj.is_class) or obj.docstring is None:
            continue
        params = list(obj.parameters)
        if any(p.kind is not None and p.kind.value == "variadic keyword" for p in params):
            continue
        names = {p.name for p in params}
        for section in obj.docstring.parse("google", warnings=False):
            if section.kind.value != "parameters":
                continue
            for entry in section.value:
                if not re.search(r",|/", entry.name):
                    continue
                grouped += 1
                missing = [n for n in (x.strip() for x in re.split(r",|/", entry.name)) if n not in names]
                if missing:
                    wrong.append(f"{obj.path}: Args entry {entry.name!r} names {missing}, not parameters")
    assert grouped, "found no grouped Args entry: is the docstring parser still google?"
    assert not wrong, "\n".join(wrong)
