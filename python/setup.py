"""setup.py - only what pyproject.toml cannot say: put a copy of libmoe.so
inside the installed package (the repository's lib/libmoe.so, built by
`make`, or the file $MOE_LIB names). Without one the package still installs
and looks for the library at run time ($MOE_LIB, the system's path).
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))


def libmoe():
    p = os.environ.get("MOE_LIB") or os.path.join(HERE, "..", "lib", "libmoe.so")
    return p if os.path.isfile(p) else None


class BuildPy(build_py):
    def run(self):
        super().run()
        src = libmoe()
        if src:
            self.copy_file(src, os.path.join(self.build_lib, "moe", "libmoe.so"))
        else:
            print("moe: no lib/libmoe.so (run make first, or set MOE_LIB): the package will "
                  "look for libmoe.so at run time")


class BinaryDistribution(Distribution):
    # with libmoe.so inside, a wheel is for this platform only
    def has_ext_modules(self):
        return libmoe() is not None


setup(cmdclass={"build_py": BuildPy}, distclass=BinaryDistribution)
