from pathlib import Path

from sandfork_runner.doclinks import anchors, broken_links, slug


def test_slugs_follow_github_and_mdbook() -> None:
    assert slug("The server in three floors") == "the-server-in-three-floors"
    assert slug("Idempotent creates and retries") == "idempotent-creates-and-retries"
    assert slug("`sandfork fork`: many children!") == "sandfork-fork-many-children"
    assert slug("A [link](x.md) heading") == "a-link-heading"


def test_repeated_headings_are_numbered_and_code_is_not_a_heading(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Top\n## Notes\n```sh\n# not a heading\n```\n## Notes\n")
    assert anchors(page) == {"top", "notes", "notes-1"}


def test_missing_files_and_headings_are_named_with_their_line(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/a.md").write_text("# A page\n## Its part\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[ok](docs/a.md) [ok too](docs/a.md#its-part) [web](https://example.invalid/x)\n"
        "[gone](docs/b.md)\n"
        "[no part](docs/a.md#another-part) `[code](not/a/link.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "[self](#nothing)\n"
    )
    assert broken_links(readme) == [
        f"{readme}:2: docs/b.md: no such file",
        f"{readme}:3: docs/a.md#another-part: no heading #another-part in a.md",
        f"{readme}:7: #nothing: no heading #nothing in README.md",
    ]
