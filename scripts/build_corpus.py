"""Rebuild the embedded corpus (`codatrain/data/corpus/python_docs.jsonl.gz`) from the running CPython.

The shipped file is the source of truth: training reads it, never the interpreter, because the
documentation differs between Python versions and the corpus must be the same bytes on every machine.
This script records how the file was made (see codatrain/data/corpus/README.md); after running it, update
`EMBEDDED_SHA256` in `codatrain/data/sources.py`.

    python scripts/build_corpus.py                      # rewrites the shipped file
    python scripts/build_corpus.py --out /tmp/corpus.gz  # elsewhere, to compare
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import io
import json
import sys
import sysconfig
from pathlib import Path
from pydoc_data.topics import topics

from codatrain.data.sources import EMBEDDED_PATH

# Tests, demos, deprecated tooling, generated codec tables and the topic data itself (included
# directly) are not documentation worth training on.
SKIPPED_PACKAGES = {
    "test", "idlelib", "lib2to3", "turtledemo", "ensurepip", "pydoc_data", "distutils", "encodings",
}


def _module_files(stdlib: Path) -> list[tuple[str, Path]]:
    """Public pure-Python stdlib modules and their public submodules, by dotted name."""
    found = []
    for name in sorted(n for n in sys.stdlib_module_names if not n.startswith("_")):
        if name in SKIPPED_PACKAGES:
            continue
        if (stdlib / f"{name}.py").is_file():
            found.append((name, stdlib / f"{name}.py"))
        elif (stdlib / name / "__init__.py").is_file():
            for path in sorted((stdlib / name).rglob("*.py")):
                parts = path.relative_to(stdlib).with_suffix("").parts
                private = any(p.startswith("_") and p != "__init__" for p in parts)
                if private or {"test", "tests"} & set(parts):
                    continue
                dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found.append((dotted, path))
    return found


def _definitions(body: list[ast.stmt], indent: str) -> list[str]:
    """Signature and docstring of every public documented class and function, recursing into classes."""
    out = []
    for node in body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if node.name.startswith("_") and node.name != "__init__":
            continue
        doc = ast.get_docstring(node)
        if isinstance(node, ast.ClassDef):
            bases = ", ".join(ast.unparse(b) for b in node.bases)
            header = f"class {node.name}({bases})" if bases else f"class {node.name}"
        else:
            header = f"def {node.name}({ast.unparse(node.args)})"
        if doc:
            body_text = "\n".join(f"{indent}    {line}".rstrip() for line in doc.splitlines())
            out.append(f"{indent}{header}\n{body_text}\n")
        if isinstance(node, ast.ClassDef):
            out.extend(_definitions(node.body, indent + "    "))
    return out


def module_document(name: str, path: Path) -> str | None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree)
    definitions = _definitions(tree.body, "")
    if not doc and not definitions:
        return None
    title = f"Module {name}"
    parts = [f"{title}\n{'=' * len(title)}\n"]
    if doc:
        parts.append(doc + "\n")
    parts.extend(definitions)
    return "\n".join(parts)


def build() -> bytes:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    records = [{"title": f"topic:{key}", "text": topics[key]} for key in sorted(topics)]
    for name, path in _module_files(stdlib):
        text = module_document(name, path)
        if text:
            records.append({"title": f"module:{name}", "text": text})
    raw = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode()
    buffer = io.BytesIO()
    # mtime=0 and no file name in the header, so the same text always gives the same bytes.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as f:
        f.write(raw)
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=EMBEDDED_PATH,
                        help="where to write (default: the shipped file)")
    out = parser.parse_args().out
    data = build()
    out.write_bytes(data)
    print(f"wrote {out} ({len(data)} bytes) from Python {sys.version.split()[0]}")
    print(f"sha256 {hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
