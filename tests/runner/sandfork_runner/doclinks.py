"""The relative links of Markdown files outside the book (the README): each
names a file that exists and, after `#`, a heading of it. The book itself is
checked as built HTML by linkchecker (scripts/docs.sh), which does not read
Markdown.

Usage: python3 -m sandfork_runner.doclinks FILE.md...
"""

import functools
import re
import sys
from pathlib import Path

# [text](target) and [text](target "title"); images too
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and mdBook make it: inline code and link
    syntax dropped, lower case, punctuation other than `-` and `_` removed,
    spaces as `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


@functools.cache  # a page is linked to many times
def anchors(path: Path) -> frozenset[str]:
    found: set[str] = set()
    for _, line in prose_lines(path.read_text()):
        if m := HEADING.match(line):
            base = slug(m.group(1))
            # a repeated heading's anchor gets -1, -2, ...
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return frozenset(found)


def broken_links(markdown: Path) -> list[str]:
    """`file:line: target: why` for each relative link that leads nowhere."""
    broken = []
    for number, line in prose_lines(markdown.read_text()):
        # inline code is not a link
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # a URL with a scheme: not checked offline
            file, _, fragment = target.partition("#")
            path = (markdown.parent / file).resolve() if file else markdown.resolve()
            where = f"{markdown}:{number}: {target}"
            if not path.exists():
                broken.append(f"{where}: no such file")
            elif fragment and path.suffix == ".md" and fragment not in anchors(path):
                broken.append(f"{where}: no heading #{fragment} in {path.name}")
    return broken


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    broken = [b for name in argv for b in broken_links(Path(name))]
    for line in broken:
        print(line, file=sys.stderr)
    print(f"doclinks: {len(broken)} broken link(s) in {', '.join(argv)}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
