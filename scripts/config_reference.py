"""Write docs/config.md, the reference of every config key, from the typed schema (codatrain/config.py).

    python scripts/config_reference.py           # rewrite docs/config.md
    python scripts/config_reference.py --check   # exit 1 when docs/config.md is not what the schema gives

Each key's type and default come from its dataclass field, its line from the comment on or just
above the field in the source (codatrain/config.py; codatrain/model/config.py for model.*): a field
without one stops the script, so every key is documented. tests/test_config.py runs the check.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import io
import sys
import tokenize
import types
import typing
from pathlib import Path

from codatrain import config
from codatrain.model.config import LlamaConfig

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "config.md"
GROUPS = ("model", "block", "data", "optim", "logger")
PRESET_LINE = ("the model config: a preset with its training recipe (configs/model/<preset>.yaml), or hf: "
               "the architecture of checkpoint.init_from")
INTRO = """# Config reference

Every key of a run, generated from the typed schema (`codatrain/config.py`) by
`python scripts/config_reference.py`; `tests/test_config.py` fails when this page and the schema
disagree. Set a key on the command line (`python scripts/train.py train.steps=1000 data.seq_len=512`)
or choose a group file (`model=llama3_1b`, `data=files`). The defaults are the schema's: a group file
and a model's training recipe set some of them (the recipes set `optim.*` and
`train.tokens_per_step`); `python scripts/train.py --cfg job` prints the composed values of a run.
A misspelled key, a value of the wrong type or an unknown choice stops the run naming the key.
"""


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in `cls`'s source: the one on its line, after the comment lines just above
    it, joined into one line."""
    source = inspect.getsource(cls)
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whether the line holds only it)
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row = token.start[0]
            own_line = lines[row - 1].strip().startswith("#")
            comments[row] = (token.string.lstrip("#").strip(), own_line)
    found = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        parts, row = [], node.lineno - 1
        while row in comments and comments[row][1]:
            parts.insert(0, comments[row][0])
            row -= 1
        trailing = comments.get(node.end_lineno)
        if trailing and not trailing[1]:
            parts.append(trailing[0])
        found[node.target.id] = " ".join(parts)
    return found


def type_name(hint: object) -> str:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = [type_name(arg) for arg in typing.get_args(hint) if arg is not type(None)]
        return " or ".join(options) + " or null"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " \\| ".join(str(member.value) for member in hint)
    return getattr(hint, "__name__", str(hint))


def default_text(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


def cell(text: str) -> str:
    """Text for a table cell or a paragraph: `|` would end the cell, `<path>` would be read as HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def rows(node: type, prefix: str, comments: dict[str, str]) -> list[str]:
    """The table rows of a schema node's keys; nested nodes follow as rows of their own keys."""
    out, hints = [], typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        key, hint = f"{prefix}.{f.name}", hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += rows(hint, key, field_comments(hint))
            continue
        if not comments.get(f.name):
            raise SystemExit(f"error: {key} has no comment in the schema's source; add one line that says "
                             "what it sets")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(f"| `{key}` | {type_name(hint)} | `{default_text(default)}` | {cell(comments[f.name])} |")
    return out


def group_choices(group: str) -> str:
    names = sorted(path.stem for path in (REPO / "configs" / group).glob("*.yaml"))
    return ", ".join(f"`{group}={name}`" for name in names)


def reference_page() -> str:
    """docs/config.md as the schema gives it."""
    sections = [INTRO]
    hints = typing.get_type_hints(config.RunConfig)
    for f in dataclasses.fields(config.RunConfig):
        node = hints[f.name]
        if f.name == "model":  # generated from LlamaConfig: the field lines are LlamaConfig's
            comments = {"preset": PRESET_LINE, **field_comments(LlamaConfig)}
            intro = ("Every `LlamaConfig` field can be set; null keeps the preset's value "
                     "(`codatrain/model/config.py`).")
        else:
            comments = field_comments(node)
            intro = " ".join(node.__doc__.split())
            if intro.startswith(f"{node.__name__}("):  # the signature dataclasses write when it has none
                intro = ""
        choices = f"Choices: {group_choices(f.name)}." if f.name in GROUPS else ""
        about = cell(" ".join(filter(None, [intro, choices])))
        sections.append("\n".join([
            f"## {f.name}", "", *([about, ""] if about else []),
            "| key | type | default | meaning |", "|---|---|---|---|", *rows(node, f.name, comments), "",
        ]))
    return "\n".join(sections)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare docs/config.md with the schema")
    args = parser.parse_args()
    page = reference_page()
    if args.check:
        if PAGE.read_text() != page:
            print(f"{PAGE.relative_to(REPO)} differs from the schema: run python scripts/config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
