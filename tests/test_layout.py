"""The package's shape: no import cycle between kvtier's modules, every file says its job in its first line, and the
module lists in docs/DESIGN.md and README.md match the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "kvtier"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """kvtier modules ``name`` imports explicitly, anywhere in the file (function bodies and ``if TYPE_CHECKING:``
    included: an import for a type annotation is a dependency too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            if base in known:
                out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
    out.discard(name)
    return out


def test_no_import_cycle_between_kvtier_modules():
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    # Tarjan's strongly connected components: any component of more than one module is a cycle
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in graph:
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"
    # the kernels' home is below the decode math and the step: it imports neither
    up = {m: sorted(x for x in graph[m] if x.startswith(("kvtier.attention", "kvtier.step")))
          for m in graph if m.startswith("kvtier.kernels")}
    assert len(up) >= 4 and not any(up.values()), f"kvtier/kernels/ imports attention/ or step/: {up}"
    # the cycle check sees what it should: a known edge and a function-level one
    assert "kvtier.tiers.planner" in graph["kvtier.cache.state"]
    assert "kvtier.tiers.tiermap" in graph["kvtier.make"]


def test_every_file_says_its_job_in_its_first_line():
    for p in list(PKG.rglob("*.py")) + list(PKG.rglob("*.cpp")):
        first = p.read_text(encoding="utf-8").splitlines()[0] if p.stat().st_size else ""
        assert first.startswith(('"""', "//")) and len(first.strip('"/ ')) > 10, f"{p.relative_to(ROOT)}: {first!r}"


def _block_after(doc: Path, marker: str) -> str:
    text = doc.read_text(encoding="utf-8")
    assert marker in text, f"{doc.name} lost its {marker!r} marker"
    after = text.split(marker, 1)[1]
    return after.split("```text", 1)[1].split("```", 1)[0]


def test_design_module_list_matches_the_tree():
    listed = re.findall(r"^(kvtier/\S+\.py)\b", _block_after(ROOT / "docs" / "DESIGN.md", "<!-- modules:"), re.M)
    tree = sorted(str(p.relative_to(ROOT)) for p in PKG.rglob("*.py"))
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(listed) == tree, (f"in the tree, not in DESIGN.md: {sorted(set(tree) - set(listed))}; "
                                    f"in DESIGN.md, not in the tree: {sorted(set(listed) - set(tree))}")


def test_readme_folder_list_matches_the_tree():
    listed = re.findall(r"^kvtier/(\w+)/", _block_after(ROOT / "README.md", "<!-- folders:"), re.M)
    tree = sorted(p.parent.name for p in PKG.glob("*/__init__.py"))
    assert sorted(listed) == tree
