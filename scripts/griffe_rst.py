"""A griffe extension (mkdocs.yml) that renders the docstrings' reStructuredText habits as markdown for the API pages.

The docstrings are written to read well in ``help()`` and in the source: Sphinx roles (``:class:`~hf_paged.BlockPool```)
and literal blocks introduced by ``::``. The site renders markdown, so a role becomes inline code (the name, or its
last part after ``~``) and a ``::`` block a fenced Python block. Nothing else changes.
"""

from __future__ import annotations

import re
import textwrap

import griffe

ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|obj|exc):`(~?)([^`]+)`")
LITERAL = re.compile(r"^(?P<indent>[ \t]*)(?P<lead>.*?)::[ \t]*\n\n(?P<body>(?:(?P=indent)[ \t]+\S.*\n|[ \t]*\n)+)",
                     re.M)


def _role(match: re.Match) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _literal(match: re.Match) -> str:
    indent, lead = match["indent"], match["lead"]
    body = textwrap.dedent(match["body"]).strip("\n")
    head = f"{indent}{lead}:" if lead.strip() else ""
    fenced = "\n".join(indent + line if line else "" for line in ["```python", *body.split("\n"), "```"])
    return f"{head}\n\n{fenced}\n\n" if head else f"{fenced}\n\n"


def to_markdown(text: str) -> str:
    """``text`` with Sphinx roles as inline code and ``::`` literal blocks as fenced Python blocks."""
    text = ROLE.sub(_role, text)
    return LITERAL.sub(_literal, text + "\n").rstrip("\n")


class RstToMarkdown(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
