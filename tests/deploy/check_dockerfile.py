#!/usr/bin/env python3
"""A docker-less lint of deploy/Dockerfile (the build context is the
repository root):

- at least two stages; the first, named ``build``, runs ``make``;
- every ``COPY`` source exists in the context and is not left out of it by
  .dockerignore; every ``COPY --from=`` names an earlier stage;
- the last stage installs (apt-get) the Debian package of every shared
  library the built daemons load (ldd + dpkg -S), apart from the base
  image's and those the listed packages pull in.

Usage: check_dockerfile.py [REPO_ROOT]. Exit 0 ok, 1 with the problems.
"""
import fnmatch
import glob
import os
import re
import shlex
import subprocess
import sys

# in every Debian image, or pulled in by the packages the stage installs
# (libnng1 -> mbedtls; libopenblas0-pthread -> libgfortran5 -> libquadmath0)
IMPLIED = {
    "libc6", "libgcc-s1", "libstdc++6", "libgfortran5", "libquadmath0",
    "libmbedtls14", "libmbedx509-1", "libmbedcrypto7",
}


def logical_lines(text):
    """Dockerfile instructions: continuations joined, comments dropped."""
    out, cur = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not cur and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip():
            out.append(cur.strip())
        cur = ""
    if cur.strip():
        out.append(cur.strip())
    return out


def parse_stages(lines):
    stages = []
    for ln in lines:
        word, _, rest = ln.partition(" ")
        word = word.upper()
        if word == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?$", rest.strip(), re.I)
            if not m:
                raise SystemExit(f"check_dockerfile: cannot parse FROM {rest}")
            stages.append({"name": m.group(2), "ins": []})
        elif word == "ARG" and not stages:
            continue
        elif not stages:
            raise SystemExit(f"check_dockerfile: {word} before the first FROM")
        else:
            stages[-1]["ins"].append((word, rest.strip()))
    return stages


def dockerignore(root):
    path = os.path.join(root, ".dockerignore")
    pats = []
    if os.path.exists(path):
        for ln in open(path):
            ln = ln.strip()
            if ln and not ln.startswith("#"):
                pats.append(ln.rstrip("/"))
    return pats


def ignored(src, pats):
    parts = os.path.normpath(src).split(os.sep)
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        for p in pats:
            if fnmatch.fnmatch(prefix, p) or fnmatch.fnmatch(prefix, p.replace("**/", "")):
                return True
    return False


def apt_packages(ins):
    pkgs = set()
    for word, rest in ins:
        if word != "RUN":
            continue
        for cmd in re.split(r"&&|;", rest):
            toks = shlex.split(cmd)
            if "apt-get" in toks and "install" in toks:
                pkgs.update(t for t in toks[toks.index("install") + 1:] if not t.startswith("-"))
    return pkgs


def needed_packages(root):
    """The Debian packages of the libraries bin/moe-* load: {pkg: lib}."""
    need = {}
    for b in ("moe-coordinator", "moe-worker", "moectl"):
        exe = os.path.join(root, "bin", b)
        if not os.path.exists(exe):
            continue
        out = subprocess.run(["ldd", exe], capture_output=True, text=True).stdout
        for m in re.finditer(r"=>\s+(/\S+)", out):
            lib = os.path.realpath(m.group(1))
            r = subprocess.run(["dpkg", "-S", lib], capture_output=True, text=True)
            if r.returncode != 0:  # not from a package: e.g. a CUDA toolkit's NCCL
                r = subprocess.run(["dpkg", "-S", m.group(1)], capture_output=True, text=True)
            if r.returncode == 0:
                pkg = r.stdout.split(":")[0].strip()
                need.setdefault(pkg, os.path.basename(m.group(1)))
    return need


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    text = open(os.path.join(root, "deploy", "Dockerfile")).read()
    stages = parse_stages(logical_lines(text))
    errs = []
    if len(stages) < 2:
        errs.append("fewer than two stages (a build stage and a runtime stage)")
    if not stages or stages[0]["name"] != "build":
        errs.append("the first stage is not named build")
    elif not any(w == "RUN" and re.search(r"\bmake\b", r) for w, r in stages[0]["ins"]):
        errs.append("the build stage does not run make")
    pats = dockerignore(root)
    names = []
    for st in stages:
        for word, rest in st["ins"]:
            if word not in ("COPY", "ADD"):
                continue
            toks = shlex.split(rest)
            opts = [t for t in toks if t.startswith("--")]
            args = [t for t in toks if not t.startswith("--")]
            frm = [o.split("=", 1)[1] for o in opts if o.startswith("--from=")]
            if len(args) < 2:
                errs.append(f"{word} {rest}: no source or destination")
                continue
            if frm:
                if frm[0] not in names:
                    errs.append(f"COPY --from={frm[0]}: no earlier stage of that name")
                continue
            for src in args[:-1]:
                if not glob.glob(os.path.join(root, src)):
                    errs.append(f"{word} source {src} does not exist in the build context")
                elif ignored(src, pats):
                    errs.append(f"{word} source {src} is left out by .dockerignore")
        names.append(st["name"])
    if stages:
        have = apt_packages(stages[-1]["ins"])
        for pkg, lib in sorted(needed_packages(root).items()):
            if pkg not in have and pkg not in IMPLIED:
                errs.append(f"the runtime stage does not install {pkg} (for {lib})")
    if errs:
        for e in errs:
            print("check_dockerfile: " + e)
        return 1
    print(f"check_dockerfile: ok ({len(stages)} stages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
