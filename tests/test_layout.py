"""The engine's shape, beyond what `lint-imports` checks (pyproject.toml: no circle, the layers, the
ZeroGPU adapter on its own): how deep a reader climbs, and how much one file holds."""

from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
MAX_CHAIN = 7  # modules on the longest import chain inside aot/, its ends included
MAX_LINES = 500


def test_no_engine_module_is_over_500_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "aot").glob("*.py")}
    assert len(sizes) > 20, sizes
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_the_longest_import_chain_inside_the_engine_is_at_most_7_modules():
    # grimp reads every import, function-local ones included, as lint-imports does.
    graph = grimp.build_graph("aot")
    modules = sorted(m for m in graph.modules if m.startswith("aot."))
    imports = {m: {n for n in graph.find_modules_directly_imported_by(m) if n.startswith("aot.")} for m in modules}
    assert imports["aot.apply"], "grimp found no imports: the graph is not the engine's"
    chains: dict[str, list[str]] = {}

    def longest(module: str, path: tuple[str, ...]) -> list[str]:
        assert module not in path, f"import circle: {' -> '.join([*path, module])}"
        if module not in chains:
            below = [longest(n, (*path, module)) for n in sorted(imports[module])]
            chains[module] = [module, *max(below, key=len, default=[])]
        return chains[module]

    chain = max((longest(m, ()) for m in modules), key=len)
    assert len(chain) <= MAX_CHAIN, " -> ".join(chain)
