"""MkDocs hook: renders the generated references (`<!-- generated: NAME -->`) from the code at
every build, with `clora.infra.docgen`, so that the settings, metrics, policy and OpenAPI pages
cannot drift from what they describe. Named in mkdocs.yml (`hooks:`)."""

from __future__ import annotations

from clora.infra import docgen


def on_page_markdown(markdown: str, page, config, files) -> str:
    try:
        return docgen.expand(markdown)
    except KeyError as e:
        raise ValueError(f"{page.file.src_path}: {e.args[0]}") from e
