"""The layers import downward only: zero.py and fsdp.py never import each other, and
minidist/plan/ imports nothing of minidist outside plan/ and no mpi4py.

The flat sharded buffer, its partition, gather and reduce-scatter live in
minidist/parallel/flat_shards.py, below both; fsdp.py builds FSDP from zero.ZeRO, and zero.py
takes stage 3's units as an argument. The small rules the engine and the planner share
live in plan/rules.py, and the engine imports them from there. Every import is read from
the source with ast, at module level and inside functions, so a function-level import
cannot hide a cycle.
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


# ----------------------------------------------------------------------------- plan/ is a leaf

PLAN = PARALLEL.parent / "plan"


def absolute_imports(path, package):
    """Every module name `path` (a module of `package`) imports, anywhere in the file:
    `import a.b`, `from a import b` (as a and a.b), relative imports resolved against
    package, and importlib.import_module / __import__ of a literal name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names if a.name != "*")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("import_module", "__import__"):
                out.add(node.args[0].value)
    return out


def outside_plan(names):
    """The names that break plan/'s rule: minidist modules outside minidist.plan, mpi4py."""
    def bad(name):
        parts = name.split(".")
        if parts[0] == "mpi4py":
            return True
        return parts[0] == "minidist" and len(parts) > 1 and parts[1] != "plan"
    return sorted(n for n in names if bad(n))


def test_plan_imports_nothing_of_minidist_outside_plan_and_no_mpi4py():
    """minidist/plan/ is arithmetic the engine and the lessons build on: it imports no
    other minidist package (the engine imports its small rules from plan/rules.py) and no
    mpi4py, so `python -m minidist.plan` runs where MPI is not installed."""
    modules = sorted(PLAN.rglob("*.py"))
    assert len(modules) > 10, f"found only {modules} under {PLAN}"
    broken = {}
    for path in modules:
        package = ".".join(("minidist",) + path.relative_to(PLAN.parent).parent.parts)
        bad = outside_plan(absolute_imports(path, package))
        if bad:
            broken[str(path.relative_to(PLAN.parent.parent))] = bad
    assert not broken, f"plan/ must import nothing of minidist outside plan/, nor mpi4py: {broken}"


def test_the_plan_rule_sees_every_kind_of_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import importlib\nfrom . import cost\nfrom .. import comm\n"
                     "def f():\n    from mpi4py import MPI\n    import minidist.progress\n"
                     "    from minidist import lessons\n"
                     "    importlib.import_module('minidist.lessons.07_3d_parallel')\n")
    got = absolute_imports(probe, "minidist.plan")
    assert "minidist.plan.cost" in got
    assert outside_plan(got) == ["minidist.comm", "minidist.lessons",
                                 "minidist.lessons.07_3d_parallel", "minidist.progress",
                                 "mpi4py", "mpi4py.MPI"]


def test_the_engine_imports_the_shared_rules_from_plan_not_a_copy():
    """chunk_bounds, padded_vocab, assign_buckets, segments and parameter_count live once,
    in plan/rules.py: the engine's names are the same functions."""
    from minidist import memory, recompute
    from minidist.comm import chunk_bounds
    from minidist.parallel import data_parallel, tensor_parallel, zero
    from minidist.plan import rules
    assert chunk_bounds is rules.chunk_bounds
    assert tensor_parallel.padded_vocab is rules.padded_vocab
    assert data_parallel.assign_buckets is rules.assign_buckets is zero.assign_buckets
    assert recompute.segments is rules.segments
    assert memory.parameter_count is rules.parameter_count


# ----------------------------------------------------------------------------- lessons/ is on top

PACKAGE = PARALLEL.parent


def lesson_imports(path, package):
    """The minidist.lessons modules `path` (a module of `package`) imports, anywhere in it."""
    return sorted(n for n in absolute_imports(path, package)
                  if n == "minidist.lessons" or n.startswith("minidist.lessons."))


def test_nothing_below_the_lessons_imports_them():
    """The lessons are the top layer: flags, the report and the comparison they share live in
    minidist/cli.py, report.py and equivalence.py, which bench/, checkpoint/ and the engine
    use. Only the grader, which runs lessons, imports minidist.lessons."""
    checked, broken = 0, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        top = path.relative_to(PACKAGE).parts[0]
        if top in ("lessons", "grader"):
            continue
        checked += 1
        found = lesson_imports(path, ".".join(("minidist",) + path.relative_to(PACKAGE).parent.parts))
        if found:
            broken[str(path.relative_to(PACKAGE.parent))] = found
    assert checked > 40, f"found only {checked} modules under {PACKAGE}"
    assert not broken, f"minidist.lessons is imported from below it: {broken}"


def test_the_lessons_rule_sees_relative_and_function_level_imports(tmp_path):
    probe = tmp_path / "minidist" / "bench" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from ..lessons import harness\n"
                     "def f():\n    from minidist.lessons.common import mpi_reduce\n")
    assert lesson_imports(probe, "minidist.bench") == [
        "minidist.lessons", "minidist.lessons.common", "minidist.lessons.common.mpi_reduce",
        "minidist.lessons.harness"]


# ----------------------------------------------------------------------------- no import circles

# The autograd engine's three modules call each other by design (a Tensor's methods run ops,
# ops build Tensors, fused kernels are ops); every other module imports one way.
ENGINE = {"minidist.tensor", "minidist.ops", "minidist.fused"}


def module_graph(root):
    """{module: the modules of the package under `root` it imports}, read with ast from every
    file, at module level and inside functions, relative imports resolved. `from p import x`
    is an edge to p.x when that is a module, else to p (its __init__). The packages a name
    passes through (`import a.b.c` runs a/__init__ first) are left out: an __init__ that
    re-exports its modules would otherwise make every package one circle."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name,) + path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                mod = node.module
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    mod = f"{base}.{mod}" if mod else base
                subs = [f"{mod}.{a.name}" for a in node.names]
                out.update(s for s in subs if s in files)
                if any(s not in files for s in subs):
                    out.add(mod)
        graph[name] = out & set(files) - {name}
    return graph


def circles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while not part or v not in part:
                part.add(stack.pop())
            if len(part) > 1:
                found.append(part)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_but_the_engines():
    """Each layer imports only below itself, at module level or inside a function: a
    function-level import hides a circle from Python at start-up, not from a reader."""
    graph = module_graph(PACKAGE)
    assert len(graph) > 100 and "minidist.comm.dispatch" in graph["minidist.comm"]
    found = [sorted(c) for c in circles(graph) if c != ENGINE]
    assert not found, f"modules that import each other, directly or round a circle: {found}"


def test_the_circle_rule_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "minidist" / "comm"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from minidist.comm.low import f\n")
    (pkg / "low.py").write_text("def f():\n    from .high import g\n")     # the hidden way back
    (pkg / "high.py").write_text("from . import low\nfrom .. import comm\n")
    (pkg / "top.py").write_text("import minidist.comm.high\n")
    graph = module_graph(tmp_path / "minidist")
    assert graph["minidist.comm.high"] == {"minidist.comm.low", "minidist.comm"}
    assert graph["minidist.comm.top"] == {"minidist.comm.high"}
    assert circles(graph) == [{"minidist.comm", "minidist.comm.low", "minidist.comm.high"}]
    (pkg / "low.py").write_text("def f():\n    pass\n")
    assert circles(module_graph(tmp_path / "minidist")) == []
