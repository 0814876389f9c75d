#!/usr/bin/env python3
"""install_check.py - `pip install ./python` into a fresh virtual
environment works, and the installed package loads the libmoe.so copied
into it (not the repository's).

A copy of python/ and lib/libmoe.so, in the repository's layout, goes to a
temporary directory; a venv with the system's site packages (for pip,
setuptools and NumPy; no network: --no-index --no-build-isolation) installs
the package from there; then, outside any source tree and without MOE_LIB,
`import moe` must find its own libmoe.so, and with --url the client pings
the coordinator.

    python3 python/install_check.py [--url tcp://127.0.0.1:7000]

Prints one line per check and "N passed, M failed" (exit status 1 on a
failure), or "SKIP: reason" (exit status 0) when the venv module, pip or a
setuptools that builds wheels is missing.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

passed = failed = 0


def check(ok, what):
    global passed, failed
    print("%s %s" % ("PASS" if ok else "FAIL", what))
    if ok:
        passed += 1
    else:
        failed += 1


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None, help="a coordinator to ping from the venv")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    a = ap.parse_args()
    try:
        import venv  # noqa: F401
    except ImportError:
        print("SKIP: the venv module is missing (python3-venv)")
        return 0
    lib = os.path.join(ROOT, "lib", "libmoe.so")
    if not os.path.exists(lib):
        print("SKIP: lib/libmoe.so is not built (make)")
        return 0
    tmp = tempfile.mkdtemp(prefix="moe-install-")
    try:
        return install(a, tmp, lib)
    finally:
        if a.keep:
            print("kept %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def install(a, tmp, lib):
    src = os.path.join(tmp, "src")
    os.makedirs(os.path.join(src, "lib"))
    shutil.copy(lib, os.path.join(src, "lib", "libmoe.so"))
    shutil.copytree(os.path.join(HERE, "moe"), os.path.join(src, "python", "moe"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for f in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(HERE, f), os.path.join(src, "python", f))

    env = dict(os.environ)
    env.pop("MOE_LIB", None)
    env.pop("PYTHONPATH", None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    vdir = os.path.join(tmp, "venv")
    r = run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", vdir],
            env=env)
    if r.returncode != 0:
        print("SKIP: python3 -m venv failed: %s" % r.stderr.strip()[-300:])
        return 0
    py = os.path.join(vdir, "bin", "python")
    # pip and setuptools come from the system's site packages; setuptools
    # builds wheels by itself from 70.1, older ones need the wheel package
    probe = ("import setuptools\n"
             "import pip\n"
             "v = tuple(int(x) for x in setuptools.__version__.split('.')[:2])\n"
             "if v < (70, 1):\n    import wheel\n"
             "print(setuptools.__version__)\n")
    r = run([py, "-c", probe], env=env, cwd=tmp)
    if r.returncode != 0:
        print("SKIP: no pip, or no setuptools that builds wheels (>= 70.1, or the wheel "
              "package) in the system's site packages: %s" % r.stderr.strip()[-300:])
        return 0
    print("setuptools %s" % r.stdout.strip())
    r = run([py, "-m", "pip", "install", "--no-index", "--no-build-isolation", "--no-deps",
             "--ignore-installed", "--no-cache-dir", os.path.join(src, "python")],
            env=env, cwd=tmp)
    check(r.returncode == 0, "pip install ./python into a fresh venv%s" %
          ("" if r.returncode == 0 else ":\n" + (r.stdout + r.stderr)[-2000:]))
    if r.returncode != 0:
        return 1

    code = ("import os, moe\n"
            "print('file', moe.__file__)\n"
            "print('lib', moe.lib_path)\n"
            "print('client', moe.Client.__name__)\n")
    if a.url:
        code += ("c = moe.Client(%r)\nc.ping()\nprint('version', c.version())\nc.close()\n"
                 % a.url)
    r = run([py, "-c", code], env=env, cwd=tmp)
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    check(r.returncode == 0, "import moe in the venv%s" %
          ("" if r.returncode == 0 else ": " + r.stderr[-1500:]))
    pkg = os.path.dirname(out.get("file", ""))
    check(pkg.startswith(vdir + os.sep), "the package is the venv's: %s" % out.get("file"))
    check(out.get("lib") == os.path.join(pkg, "libmoe.so"),
          "it loads the libmoe.so installed inside it: %s" % out.get("lib"))
    if a.url:
        check("version" in out, "the installed client pings the coordinator (version %s)"
              % out.get("version"))
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
