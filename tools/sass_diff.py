#!/usr/bin/env python3
"""sass_diff.py - are the kernels of two sets of CUDA objects instruction-identical?

Dumps the SASS of every function in the OLD objects and in the NEW ones
(`cuobjdump -sass`; objects, archives or executables), splits the listings
per (arch, kernel) - the kernel named by its demangled name with anonymous
namespaces (and any --strip-ns namespace) taken out, so that moving a kernel
to another file or namespace keeps its key - and compares each kernel's
instructions in order. Per instruction it compares the text without the
address, with symbol names (mangled names, `(...)` relocation targets) made
anonymous, and the 128-bit encoding (scheduling bits included) except where
the instruction carries a relocation (a symbol or @lo/@hi operand). With
--res it also compares each kernel's resource usage (`cuobjdump -res-usage`:
registers, stack, shared, local memory...).

Used to prove that a refactor of the CUDA sources (kernels/cuda/gemm/: the
kcu_gemm.cu split) changed no kernel:

    python3 tools/sass_diff.py build/old/kcu_gemm.o -- build/kernels/cuda/gemm/*.o

Prints a table, one row per (arch, kernel), and a summary per arch; exit 0
when every kernel is present on both sides and identical, 1 otherwise, 2 on
a usage or tool error. cuobjdump and nvdisasm are looked for in PATH,
$CUDA_HOME/bin, /usr/local/cuda/bin and .tools/cuobjdump/nvidia/cu13/bin
(`make deps`); NVDISASM_PATH is honoured by cuobjdump itself.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

TOOL_DIRS = [
    os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin"),
    "/usr/local/cuda/bin",
    ".tools/cuobjdump/nvidia/cu13/bin",
    ".tools/nvdisasm/nvidia/cu13/bin",
]

ARCH_RE = re.compile(r"^\s*arch = (\S+)")
CODE_FOR_RE = re.compile(r"^\s*code for (\S+)")
FUNC_RE = re.compile(r"^\s*Function : (\S+)")
INSN_RE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\*\s*(0x[0-9a-f]+)\s*\*/\s*$")
ENC_RE = re.compile(r"^\s*/\*\s*(0x[0-9a-f]+)\s*\*/\s*$")
MANGLED_RE = re.compile(r"\b_Z[A-Za-z0-9_$.]+")
RELOC_RE = re.compile(r"`\([^)]*\)|@(lo|hi)\(|\$[A-Za-z_.][A-Za-z0-9_$.]*")
ANON_RE = re.compile(r"\(anonymous namespace\)::")
RES_RE = re.compile(r"^\s*Function (\S+?):\s*(.*)$")


def find_tool(name):
    p = shutil.which(name)
    if p:
        return p
    for d in TOOL_DIRS:
        c = os.path.join(d, name)
        if os.access(c, os.X_OK):
            return c
    return None


def tool_env():
    env = dict(os.environ)
    extra = [d for d in TOOL_DIRS if os.path.isdir(d)]
    env["PATH"] = os.pathsep.join([env.get("PATH", "")] + [os.path.abspath(d) for d in extra])
    if "NVDISASM_PATH" not in env:
        nvd = find_tool("nvdisasm")
        if nvd:
            env["NVDISASM_PATH"] = os.path.dirname(nvd)
    return env


def demangle(names):
    names = list(names)
    if not names:
        return {}
    filt = shutil.which("c++filt")
    if not filt:
        return {n: n for n in names}
    out = subprocess.run([filt], input="\n".join(names) + "\n", capture_output=True, text=True,
                         check=True).stdout.split("\n")
    return {n: (out[i] if i < len(out) and out[i] else n) for i, n in enumerate(names)}


def key_name(dem, strip_ns):
    k = ANON_RE.sub("", dem)
    for ns in strip_ns:
        k = re.sub(r"\b" + re.escape(ns) + r"::", "", k)
    return k


def run_cuobjdump(cuobjdump, flag, path, env):
    r = subprocess.run([cuobjdump, flag, path], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        msg = r.stderr.strip()
        if "does not contain device code" in msg or "no device code" in msg.lower():
            return ""
        sys.exit("sass_diff: cuobjdump %s %s failed: %s" % (flag, path, msg))
    return r.stdout


def parse_sass(text):
    """{(arch, mangled): [(text, encoding), ...]}"""
    funcs = {}
    arch, cur, pending = None, None, None
    for line in text.split("\n"):
        m = ARCH_RE.match(line) or CODE_FOR_RE.match(line)
        if m:
            arch = m.group(1)
            continue
        m = FUNC_RE.match(line)
        if m:
            cur = funcs.setdefault((arch, m.group(1)), [])
            if cur:  # the same function twice (two objects): compare the first
                cur = []
            pending = None
            continue
        if cur is None:
            continue
        m = INSN_RE.match(line)
        if m:
            pending = [m.group(2).rstrip(" ;"), m.group(3)]
            cur.append(pending)
            continue
        m = ENC_RE.match(line)
        if m and pending is not None:
            pending[1] += m.group(1)
            pending = None
    return funcs


def parse_res(text):
    """{(arch, mangled): "REG:n STACK:n SHARED:n ..."} (the line after each Function)"""
    res = {}
    arch, cur = None, None
    for line in text.split("\n"):
        m = ARCH_RE.match(line) or CODE_FOR_RE.match(line)
        if m:
            arch = m.group(1)
            continue
        m = RES_RE.match(line)
        if m:
            cur = (arch, m.group(1).rstrip(":"))
            if m.group(2).strip():
                res[cur] = " ".join(m.group(2).split())
                cur = None
            continue
        if cur is not None and line.strip():
            res[cur] = " ".join(line.split())
            cur = None
    return res


def norm_insn(txt):
    t = RELOC_RE.sub("<reloc>", MANGLED_RE.sub("<sym>", txt))
    return " ".join(t.split())


def has_reloc(txt):
    return bool(MANGLED_RE.search(txt) or RELOC_RE.search(txt))


def collect(paths, strip_ns, cuobjdump, env, want_res):
    funcs, res = {}, {}
    for p in paths:
        for k, v in parse_sass(run_cuobjdump(cuobjdump, "-sass", p, env)).items():
            if k in funcs:
                sys.exit("sass_diff: %s for %s defined twice in one side" % (k[1], k[0]))
            funcs[k] = v
        if want_res:
            res.update(parse_res(run_cuobjdump(cuobjdump, "-res-usage", p, env)))
    dem = demangle({k[1] for k in funcs})
    out, outres, raw = {}, {}, {}
    for (arch, name), insns in funcs.items():
        key = (arch, key_name(dem[name], strip_ns))
        if key in out:
            sys.exit("sass_diff: two functions map to key %s / %s" % key)
        out[key] = insns
        raw[key] = name
        if (arch, name) in res:
            outres[key] = res[(arch, name)]
    return out, outres, raw


def compare(a, b):
    """None when identical, else a description of the first difference."""
    if len(a) != len(b):
        n = min(len(a), len(b))
    else:
        n = len(a)
    for i in range(n):
        ta, ea = a[i]
        tb, eb = b[i]
        if norm_insn(ta) != norm_insn(tb):
            return "insn %d: %r != %r" % (i, ta, tb)
        if not (has_reloc(ta) or has_reloc(tb)) and ea != eb:
            return "insn %d (%s): encoding %s != %s" % (i, ta, ea, eb)
    if len(a) != len(b):
        return "%d instructions != %d" % (len(a), len(b))
    return None


def main():
    ap = argparse.ArgumentParser(
        description="compare the SASS of every kernel in OLD objects with NEW ones",
        usage="%(prog)s [options] OLD.o... -- NEW.o...")
    ap.add_argument("--strip-ns", action="append", default=[],
                    help="namespace left out of kernel keys (anonymous ones always are)")
    ap.add_argument("--res", action="store_true", help="also compare cuobjdump -res-usage")
    ap.add_argument("--quiet", action="store_true", help="print only differences and the summary")
    ap.add_argument("objs", nargs="*")
    argv = sys.argv[1:]
    if "--" not in argv:
        ap.print_usage(sys.stderr)
        return 2
    i = argv.index("--")
    opts = ap.parse_args(argv[:i])
    old_paths, new_paths = opts.objs, argv[i + 1:]
    if not old_paths or not new_paths:
        ap.print_usage(sys.stderr)
        return 2
    cuobjdump = find_tool("cuobjdump")
    if not cuobjdump:
        print("sass_diff: cuobjdump not found", file=sys.stderr)
        return 2
    env = tool_env()
    old, old_res, _ = collect(old_paths, opts.strip_ns, cuobjdump, env, opts.res)
    new, new_res, _ = collect(new_paths, opts.strip_ns, cuobjdump, env, opts.res)

    keys = sorted(set(old) | set(new))
    summary = {}
    bad = 0
    rows = []
    for k in keys:
        arch, name = k
        s = summary.setdefault(arch, [0, 0, 0])  # kernels, identical, differing
        s[0] += 1
        if k not in old:
            st, why = "ONLY-NEW", ""
        elif k not in new:
            st, why = "ONLY-OLD", ""
        else:
            why = compare(old[k], new[k])
            if why is None and opts.res and old_res.get(k) != new_res.get(k):
                why = "resources: %s != %s" % (old_res.get(k), new_res.get(k))
            st = "identical" if why is None else "DIFFERENT"
        if st == "identical":
            s[1] += 1
        else:
            s[2] += 1
            bad += 1
        rows.append((arch, st, len(old.get(k, ())), len(new.get(k, ())), name, why or ""))

    w = max([len(r[4]) for r in rows] + [6])
    if not opts.quiet or bad:
        print("%-7s %-9s %7s %7s  %s" % ("arch", "status", "old", "new", "kernel"))
    for arch, st, no, nn, name, why in rows:
        if opts.quiet and st == "identical":
            continue
        print("%-7s %-9s %7d %7d  %-*s%s" % (arch, st, no, nn, w, name,
                                            ("  " + why) if why else ""))
    print("summary:")
    for arch in sorted(summary):
        n, same, diff = summary[arch]
        print("  %-7s %3d kernels: %3d identical, %3d different or missing" %
              (arch, n, same, diff))
    print("RESULT: %s" % ("all identical" if not bad else "%d kernel(s) differ" % bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
