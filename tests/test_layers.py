"""The strategy modules import downward only: zero.py and fsdp.py never import each other.

The flat sharded buffer, its partition, gather and reduce-scatter live in
minidist/parallel/flat_shards.py, below both; fsdp.py builds FSDP from zero.ZeRO, and zero.py
takes stage 3's units as an argument. Every import is read from the source with ast, at
module level and inside functions, so a function-level import cannot hide a cycle.
"""
import ast
import pathlib

PARALLEL = pathlib.Path(__file__).resolve().parent.parent / "minidist" / "parallel"


def imported(path):
    """The minidist.parallel modules `path` imports, anywhere in the file (short names)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:                      # relative: resolve against minidist.parallel
                base = "minidist.parallel" if node.level == 1 else "minidist"
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["minidist", "parallel"] and len(parts) > 2:
                out.add(parts[2])
    return out


def graph():
    return {p.stem: imported(p) - {p.stem} for p in sorted(PARALLEL.glob("*.py"))}


def test_zero_and_fsdp_do_not_import_each_other():
    g = graph()
    assert not ("fsdp" in g["zero"] and "zero" in g["fsdp"]), \
        f"zero.py imports {sorted(g['zero'])} and fsdp.py imports {sorted(g['fsdp'])}: a cycle"


def test_flat_shards_is_below_both():
    g = graph()
    assert not g["flat_shards"] & {"zero", "fsdp"}, f"flat_shards.py imports {sorted(g['flat_shards'])}"
    assert "flat_shards" in g["zero"] and "flat_shards" in g["fsdp"]


def test_the_parser_sees_function_level_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from minidist.parallel.zero import ZeRO\n    from minidist.parallel import fsdp\n")
    assert imported(probe) == {"zero", "fsdp"}
