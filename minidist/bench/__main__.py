"""Run a benchmark by name.

    python -m minidist.bench model                 # GPT training step, beside PyTorch when importable
    mpirun -n 4 python -m minidist.bench collectives  # nccl-tests style table, ring beside MPI's own
"""
import importlib
import sys

from minidist.failfast import agreed_exit

# name: what it times (and whether it needs MPI)
COMMANDS = {
    "model": "one GPT training step (forward, backward, AdamW), tokens/s and MFU, beside PyTorch "
             "eager when torch is importable; one process, no MPI needed",
    "collectives": "all-reduce: minidist's ring and auto beside MPI's Allreduce, time and busbw "
                   "(GB/s) per size, nccl-tests' table; under mpirun",
}
USAGE = f"usage: python -m minidist.bench {{{','.join(COMMANDS)}}} [flags]"


def help_text():
    lines = [USAGE, "", "Benchmarks of minidist beside a reference.", "", "commands:"]
    for name, what in COMMANDS.items():
        words, line = what.split(), f"  {name:<12}"
        for w in words:                                   # wrap at 100 columns, hanging indent
            if len(line) + 1 + len(w) > 100:
                lines.append(line)
                line = " " * 14 + w
            else:
                line += ("" if line.endswith(" ") else " ") + w
        lines.append(line)
    lines += ["", "python -m minidist.bench COMMAND --help lists the command's flags."]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help"):
        print(help_text())
        agreed_exit(0)
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        given = f" (not {sys.argv[1]!r})" if len(sys.argv) >= 2 else ""
        print(f"{USAGE}{given}; --help says what each does", file=sys.stderr)
        agreed_exit(2)
    name = sys.argv.pop(1)
    agreed_exit(importlib.import_module(f"minidist.bench.{name}").main())
