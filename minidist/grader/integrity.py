"""The grader's own code, kept honest, and the lines a teacher should read.

A student's file runs inside the grader's process, so it can reach the grader: replace a
check's helper, `referee.verdict_of`, `numpy.allclose` or the `run_check` that `__main__`
calls, and a file of untouched stubs would PASS. Python cannot forbid that; the grader
can notice it. `Snapshot()` records, before the student's file is imported, every
function and class the verdict depends on (minidist's modules, the grader's, numpy's,
builtins, `__main__`): the object each module name is bound to and its code object, and
the methods of minidist's classes. `changed()` compares after the student's code ran (on
import and after each check): any difference FAILs the whole file, naming what changed.

What this cannot prevent, said in the course map: code that undoes its change before the
grader looks, that changes state rather than functions (a counter, a cached array), or
that reads another student's file. `scan(source)` flags, for the teacher, the lines that
do such things on purpose or by accident: importing the grader or its checks, inspecting
stack frames, walking the garbage collector, touching MPI.COMM_WORLD, and taking an
exercise's answer from the package itself.
"""
import ast
import sys
import types

WATCHED = ("minidist", "numpy", "builtins", "__main__", "mpi4py")


def _watched(name):
    return any(name == w or name.startswith(w + ".") for w in WATCHED)


def _code(obj):
    return getattr(obj, "__code__", None)


class Snapshot:
    """Every watched function and class as it is now."""

    def __init__(self):
        self.entries = {}
        for modname, mod in list(sys.modules.items()):
            if mod is None or not _watched(modname) or modname.startswith("student_"):
                continue
            for key, value in list(vars(mod).items()):
                if callable(value) and not isinstance(value, types.ModuleType):
                    self.entries[(modname, key)] = (value, _code(value))
                    if isinstance(value, type) and value.__module__ == modname and modname.startswith("minidist"):
                        for attr, member in list(vars(value).items()):
                            if isinstance(member, (types.FunctionType, staticmethod, classmethod, property)):
                                fn = getattr(member, "__func__", getattr(member, "fget", member))
                                self.entries[(f"{modname}.{key}", attr)] = (member, _code(fn))

    def changed(self):
        """'module.name' of the first watched function or class that is no longer what it was, else None."""
        for (where, key), (obj, code) in self.entries.items():
            mod = sys.modules.get(where)
            space = vars(mod) if mod is not None else None
            if space is None:                      # a class's methods
                modname, _, clsname = where.rpartition(".")
                cls = vars(sys.modules[modname]).get(clsname) if modname in sys.modules else None
                space = vars(cls) if isinstance(cls, type) else {}
            now = space.get(key)
            if now is not obj:
                return f"{where}.{key}"
            fn = getattr(now, "__func__", getattr(now, "fget", now))
            if code is not None and _code(fn) is not code:
                return f"{where}.{key}"
        return None


# ----------------------------------------------------------------------------- what a teacher should read

FRAME_WORDS = {"_getframe", "f_back", "f_locals", "f_globals", "currentframe", "getouterframes", "stack",
               "settrace", "setprofile", "get_referrers", "get_objects", "tb_frame"}


def scan(source, exercises=()):
    """Notes on the source of a student's file: what it does that a teacher should read.
    exercises: the Exercise entries graded; a file that takes one's answer from the package
    (`from minidist.precision import update_scale`, or `precision.update_scale` of an
    imported minidist module) may PASS with nothing of its own: noted, by name."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    notes = set()
    answers = {e.name for e in exercises}
    modules = set()                       # names this file binds to minidist modules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {(a.asname or a.name.split(".")[0]) for a in node.names if a.name.startswith("minidist")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minidist"):
            modules |= {a.asname or a.name for a in node.names if a.name not in answers}
            taken = [a.name for a in node.names if a.name in answers]
            if taken:
                notes.add(f"imports the package's answer{'s' if len(taken) > 1 else ''} {', '.join(taken)} "
                          f"(from {node.module})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in answers:
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                notes.add(f"uses the package's answer {node.attr} ({ast.unparse(node)})")
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)      # the stub's own text names the command
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            names = []
        for name in names:
            if name.startswith(("minidist.grader", "minidist.grade")) or name == "minidist.grade":
                notes.add("imports the grader")
            if name in ("inspect", "gc", "traceback") or name.startswith(("inspect.", "gc.")):
                notes.add(f"imports {name.split('.')[0]}")
        if isinstance(node, ast.Attribute):
            if node.attr in FRAME_WORDS:
                notes.add(f"inspects frames or objects ({node.attr})")
            if node.attr == "COMM_WORLD":
                notes.add("uses MPI.COMM_WORLD (not the comm it is given)")
        if isinstance(node, ast.Name) and node.id in ("__main__", "__builtins__"):
            notes.add(f"touches {node.id}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "minidist.grade" in node.value \
                and id(node) not in docstrings:
            notes.add("names the grader in a string")
    return sorted(notes)
