"""mkdocs hooks: the docs site built from the repository as it is laid out.

Every Markdown file links the way a forge's file view resolves links: relative to the file's own
place in the repository (docs/strategies/zero.md links `../../benchmarks/results/zero-...md`).
The site holds docs/ plus benchmarks/results/ (served under results/), so these hooks
- regenerate docs/configuration.md from config.py before each build (docs/gen_config_ref.py);
- add the files of benchmarks/results/ to the site;
- rewrite each relative link from its repository path to its site path, and warn (a failure under
  --strict) for one that points outside docs/ and benchmarks/results/; mkdocs itself then warns
  for a rewritten link whose page or anchor does not exist;
- check README.md's relative links, which no page build would see.
"""

from __future__ import annotations

import importlib.util
import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results"
RESULTS_IN_SITE = "results"
log = logging.getLogger("mkdocs.hooks.paratrain")

# [text](target) and ![alt](target), with an optional "title"; code spans and fences are cut out
# before matching, so commands that show brackets are not taken for links
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def _repo_path(src_uri: str) -> str:
    """Where a site file lives in the repository."""
    if src_uri.startswith(RESULTS_IN_SITE + "/"):
        return RESULTS + src_uri[len(RESULTS_IN_SITE) :]
    return "docs/" + src_uri


def _site_path(repo_path: str) -> str | None:
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/") :]
    if repo_path.startswith(RESULTS + "/"):
        return RESULTS_IN_SITE + repo_path[len(RESULTS) :]
    return None


def _is_relative(target: str) -> bool:
    return not (target.startswith(("#", "/")) or re.match(r"^[a-z][a-z0-9+.-]*:", target))


def _links(markdown: str):
    """Each link outside code, as a match: group 2 is the target."""
    spans = [m.span() for m in CODE.finditer(markdown)]
    for m in LINK.finditer(markdown):
        if not any(a <= m.start() < b for a, b in spans):
            yield m


def on_pre_build(config) -> None:
    spec = importlib.util.spec_from_file_location("gen_config_ref", ROOT / "docs" / "gen_config_ref.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    generator.main([])
    _check_readme()


def _check_readme() -> None:
    text = (ROOT / "README.md").read_text()
    for m in _links(text):
        target = m.group(2).split("#", 1)[0]
        if target and _is_relative(target) and not (ROOT / target).exists():
            log.warning("README.md links to '%s', which does not exist", target)


def on_files(files, config):
    for path in sorted((ROOT / RESULTS).glob("*.md")):
        files.append(File.generated(config, f"{RESULTS_IN_SITE}/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    here = posixpath.dirname(_repo_path(page.file.src_uri))
    site_here = posixpath.dirname(page.file.src_uri)

    def rewrite(m: re.Match) -> str:
        target = m.group(2)
        if not _is_relative(target):
            return m.group(0)
        path, _, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(here, path))
        site_path = _site_path(repo_path)
        if site_path is None:  # a source file, the Makefile...: no page of the site holds it
            log.warning(
                "%s links to '%s' (%s), which is outside docs/ and benchmarks/results/",
                _repo_path(page.file.src_uri),
                target,
                repo_path,
            )
            return m.group(0)
        new = posixpath.relpath(site_path, site_here or ".") + (f"#{anchor}" if anchor else "")
        return m.group(1) + new + m.group(3)

    out, last = [], 0
    for m in _links(markdown):
        out += [markdown[last : m.start()], rewrite(m)]
        last = m.end()
    return "".join(out) + markdown[last:]
