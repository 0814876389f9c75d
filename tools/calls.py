#!/usr/bin/env python3
"""calls.py - the coordinator's files call each other in one order, downward.

layers.py checks the include graph; between the coordinator's files the
includes are flat (all share server/coord.h), so the order that matters is
that of their calls. This reads it from the built objects: for each
build/server/<name>.o, `nm -P` gives the symbols it defines (T, D, R, B, ...)
and those it needs (U); file a calls file b when a needs a symbol b defines.
It checks:

  1. the declared order: the line "call order: a < b < ..." in
     server/coord.h (lowest first); a listed file calls only files listed
     before it (no call upward, none between a file and itself aside);
  2. no circle between any of the server's objects (listed or not).

Run by `make lint` (after the server's objects are built) and by
tests/unit/test_layers.c. --self-test compiles a planted pair of objects (a
call upward that closes a circle) in a temporary directory and proves both
are caught.

Usage: tools/calls.py [--self-test] [ROOT]
       exit 0 clean, 1 violations (one per line), 2 objects missing.
"""
import glob
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from layers import find_cycles  # noqa: E402 (Tarjan, shared with the include check)

ORDER_RE = re.compile(r"call order:\s*([A-Za-z0-9_]+(?:\s*<\s*[A-Za-z0-9_]+)+)")


def declared_order(header):
    """The file names of the "call order:" line of header, lowest first."""
    with open(header, encoding="utf-8") as fh:
        m = ORDER_RE.search(fh.read())
    if not m:
        return None
    return [n.strip() for n in m.group(1).split("<")]


def symbols(obj):
    """(defined, undefined) global symbol names of an object file."""
    out = subprocess.run(["nm", "-P", obj], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        name, kind = parts[0], parts[1]
        if kind == "U":
            undefined.add(name)
        elif kind.isupper():  # global: T text, D data, R read-only, B bss, C common, ...
            defined.add(name)
    return defined, undefined


def call_graph(objdir):
    """{file: {callee file: sorted symbols}} over objdir/*.o (file = stem)."""
    syms = {}
    for obj in sorted(glob.glob(os.path.join(objdir, "*.o"))):
        syms[os.path.basename(obj)[:-2]] = symbols(obj)
    owner = {}
    for name, (defined, _) in syms.items():
        for s in defined:
            owner.setdefault(s, name)
    graph = {}
    for name, (_, undefined) in syms.items():
        edges = graph.setdefault(name, {})
        for s in undefined:
            to = owner.get(s)
            if to and to != name:
                edges.setdefault(to, []).append(s)
    for edges in graph.values():
        for k in edges:
            edges[k].sort()
    return graph


def check(objdir, order):
    """The violations of order (lowest first) and circles, one string each."""
    errors = []
    graph = call_graph(objdir)
    if not graph:
        return [f"no objects in {objdir}: build first (make)"]
    rank = {n: i for i, n in enumerate(order)}
    for n in order:
        if n not in graph:
            errors.append(f"{n}: listed in the call order but {objdir}/{n}.o is missing")
    for a in sorted(graph):
        if a not in rank:
            continue
        for b, syms in sorted(graph[a].items()):
            if b in rank and rank[b] > rank[a]:
                errors.append(f"{a} -> {b} ({', '.join(syms)}): calls up the order {' < '.join(order)}")
    for comp in find_cycles({a: set(e) for a, e in graph.items()}):
        errors.append("call circle: " + " -> ".join(comp))
    return errors


PLANTED = {
    # jobs, at the bottom, calls registry by name: an upward call closing a circle
    "jobs.c": "void coord_maybe_form(void);\nvoid coord_job_pump(void) { coord_maybe_form(); }\n",
    "registry.c": "void coord_job_pump(void);\nvoid coord_maybe_form(void) { coord_job_pump(); }\n",
    "state.c": "int coord_up_workers(void) { return 0; }\n",
}


def self_test():
    """Plant an upward call in compiled objects; 0 when it is caught."""
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(prefix="moe-calls-") as d:
        for name, text in PLANTED.items():
            src = os.path.join(d, name)
            with open(src, "w") as fh:
                fh.write(text)
            subprocess.run([cc, "-c", src, "-o", src[:-2] + ".o"], check=True)
        order = ["state", "jobs", "registry"]
        errors = check(d, order)
        want = ["jobs -> registry (coord_maybe_form): calls up", "call circle: jobs -> registry"]
        missing = [w for w in want if not any(e.startswith(w) for e in errors)]
        if missing:
            print("calls.py self-test: not caught: " + "; ".join(missing))
            for e in errors:
                print("  got: " + e)
            return 1
        # without the planted call upward there is nothing to report
        os.remove(os.path.join(d, "jobs.o"))
        with open(os.path.join(d, "jobs.c"), "w") as fh:
            fh.write("int coord_up_workers(void);\nint coord_job_pump(void) { return coord_up_workers(); }\n")
        subprocess.run([cc, "-c", os.path.join(d, "jobs.c"), "-o", os.path.join(d, "jobs.o")], check=True)
        left = check(d, order)
        if left:
            print("calls.py self-test: clean objects reported: " + "; ".join(left))
            return 1
    print("calls.py self-test: a planted upward call and circle are caught")
    return 0


def main(argv):
    args = [a for a in argv[1:] if a != "--self-test"]
    if "--self-test" in argv[1:]:
        return self_test()
    root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    root = os.path.abspath(root)
    order = declared_order(os.path.join(root, "server", "coord.h"))
    if not order:
        print('server/coord.h: no "call order: a < b < ..." line')
        return 1
    objdir = os.path.join(root, "build", "server")
    if not glob.glob(os.path.join(objdir, "*.o")):
        print(f"{objdir}: no objects: build first (make)")
        return 2
    errors = check(objdir, order)
    for e in errors:
        print(e)
    if errors:
        print(f"calls: {len(errors)} violation(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
