"""The docs cite dated results by their section in docs/bench-history.md
("DATE, COMMIT: subject"); a citation must name a section that exists, so a
reader who follows it finds the figures."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
HISTORY = ROOT / "docs" / "bench-history.md"
# bench-history.md, then the section's title in quotes, possibly across lines
CITE = re.compile(r'bench-history\.md[,:]?\s*(?:section\s*)?"([^"]+)"', re.S)


def _citations():
    files = sorted(ROOT.glob("docs/*.md")) + [ROOT / "README.md"]
    files += sorted(ROOT.glob("tracer/**/*.py")) + sorted(ROOT.glob("bench/*.py"))
    for path in files:
        if path == HISTORY:
            continue
        text = path.read_text()
        for m in CITE.finditer(text):
            title = " ".join(re.sub(r"\s*#\s*", " ", m.group(1)).split())
            yield path.relative_to(ROOT), title


def test_history_citations_name_existing_sections():
    headings = {line[3:].strip() for line in HISTORY.read_text().splitlines()
                if line.startswith("## ")}
    cites = list(_citations())
    assert cites, "no citation of docs/bench-history.md found: the pattern is stale"
    missing = [f"{p}: {t!r}" for p, t in cites if t not in headings]
    assert not missing, "citations of missing sections:\n" + "\n".join(missing)
