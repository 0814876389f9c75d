#!/usr/bin/env python3
"""layers.py - the include graph has no circle and no arrow pointing up.

Reads every `#include "..."` in the C and CUDA sources under a root (the
repository by default) and checks:

  1. every project include is folder-qualified from the root
     ("proto/proto.h", never "proto.h") and names a file that exists;
  2. a file includes only headers of its own folder or of a lower floor
     (FLOORS below); folders on one floor do not include each other;
  3. no circle between files (a header that, through others, includes
     itself), anywhere.

Every folder holding C or CUDA sources must be on a floor: a new folder is
placed here on purpose. Run by `make lint` and by tests/unit/test_layers.c,
which also plants violations in a temporary tree to prove they are caught.

Usage: tools/layers.py [ROOT]   exit 0 clean, 1 violations (one per line).
"""
import os
import re
import sys

# The floors, lowest first. A folder's floor is that of its longest listed
# prefix (kernels/cuda before kernels; tests/unit is tests).
FLOORS = [
    ["base"],  # moe.h (the public header: errors, dtypes, calls), wire codes, bf16
    ["proto"],  # msgpack reader/writer, rpc framing, tensors
    ["common"],  # config, logging, params, model config, files, hashes
    ["kernels", "rpc", "client"],  # CPU kernels; the RPC server; libmoe's calls, moectl
    ["kernels/cuda"],  # CUDA kernels (over the CPU reference's header)
    ["worker", "server"],  # the two daemons: neither includes the other
    ["bench", "tests", "fuzz"],  # programs that may use any floor below
]

SOURCE_EXT = (".c", ".h", ".cu", ".cuh")
SKIP_DIRS = {".git", "build", "bin", "lib", "node_modules", "__pycache__",
             "run"}  # run/: the ignored scratch folder of device calls (.gitignore)
INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def floor_of(folder):
    """(floor index, declared folder) of a source folder, or (None, None)."""
    best = (None, None)
    for i, names in enumerate(FLOORS):
        for name in names:
            if folder == name or folder.startswith(name + "/"):
                if best[1] is None or len(name) > len(best[1]):
                    best = (i, name)
    return best


def sources(root):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for f in sorted(filenames):
            if f.endswith(SOURCE_EXT):
                yield os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")


def includes(root, path):
    with open(os.path.join(root, path), encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    for m in INCLUDE_RE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        yield line, m.group(1)


def find_cycles(graph):
    """The strongly connected components with a circle (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check(root):
    errors = []
    graph = {}
    for path in sources(root):
        folder = path.rsplit("/", 1)[0] if "/" in path else "."
        floor, _ = floor_of(folder)
        if floor is None:
            errors.append(f"{path}: folder '{folder}' is on no floor (tools/layers.py FLOORS)")
            continue
        graph.setdefault(path, set())
        for line, inc in includes(root, path):
            where = f"{path}:{line}"
            if "/" not in inc:
                errors.append(f'{where}: "{inc}" is not folder-qualified from the root')
                continue
            if not os.path.isfile(os.path.join(root, inc)):
                errors.append(f'{where}: "{inc}" does not exist')
                continue
            graph[path].add(inc)
            to_folder = inc.rsplit("/", 1)[0]
            to_floor, to_name = floor_of(to_folder)
            if to_floor is None:
                errors.append(f'{where}: "{inc}" is in a folder on no floor')
            elif to_folder == folder:
                continue
            elif to_floor > floor:
                errors.append(
                    f'{where}: includes "{inc}": {folder} (floor {floor}) '
                    f"points up to {to_name} (floor {to_floor})"
                )
            elif to_floor == floor and floor_of(folder)[1] != to_name:
                errors.append(
                    f'{where}: includes "{inc}": {folder} and {to_name} '
                    f"share floor {floor} and must not include each other"
                )
    for comp in find_cycles(graph):
        errors.append("include circle: " + " -> ".join(comp))
    return errors


def main(argv):
    root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    errors = check(os.path.abspath(root))
    for e in errors:
        print(e)
    if errors:
        print(f"layers: {len(errors)} violation(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
