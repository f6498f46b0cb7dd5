"""Line counts of the largest classes and functions in the project (not a test).

    python tools/code_size.py [--top 15] [paths...]

Walks every ``.py`` file under the given paths (default: redisdask, workers, nanny) with
``ast`` and prints the modules, classes and functions (methods included) with the most
lines, so a refactoring can say what it shrank, and by how much.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

DEFAULT_PATHS = ("redisdask", "workers", "nanny")


def _span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]


def measure(paths: list[Path]) -> tuple[list, list, list]:
    modules, classes, functions = [], [], []
    for root in paths:
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for path in files:
            text = path.read_text()
            modules.append((len(text.splitlines()), str(path)))
            tree = ast.parse(text, filename=str(path))
            stack: list[tuple[ast.AST, str]] = [(tree, "")]
            while stack:
                node, prefix = stack.pop()
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.ClassDef):
                        name = f"{prefix}{child.name}"
                        classes.append((_span(child), f"{path}:{name}"))
                        stack.append((child, name + "."))
                    elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                        name = f"{prefix}{child.name}"
                        functions.append((_span(child), f"{path}:{name}"))
                        stack.append((child, name + "."))
    return modules, classes, functions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    paths = args.paths or [Path(p) for p in DEFAULT_PATHS]
    modules, classes, functions = measure(paths)
    for title, rows in (("modules", modules), ("classes", classes), ("functions", functions)):
        print(f"## largest {title} (lines)")
        for lines, name in sorted(rows, reverse=True)[: args.top]:
            print(f"{lines:6d}  {name}")
        print()
    print(f"total: {sum(n for n, _ in modules)} lines in {len(modules)} modules")


if __name__ == "__main__":
    main()
