"""checklib.py - what the GPU check scripts share (python/*_check.py run on
a cluster, and bench/pipeline_bench.py): PASS/FAIL lines counted, relative
errors, the summary line and exit status, a model name made free.

    from checklib import Checks, rel
    ck = Checks()
    ck.check(err <= 1e-5, "y: rel err %.2e" % err)
    sys.exit(ck.done())     # prints "N passed, M failed"; 1 on a failure
"""
import numpy as np

import moe


class Checks:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def check(self, ok, what):
        print("%s %s" % ("PASS" if ok else "FAIL", what))
        if ok:
            self.passed += 1
        else:
            self.failed += 1

    def done(self):
        print("%d passed, %d failed" % (self.passed, self.failed))
        return 1 if self.failed else 0


def rel(a, b):
    """||a - b|| / ||b|| in float64 (b of norm 0: ||a - b|| / 1e-30)"""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def drop_model(c, name):
    """deletes model name where the cluster has it (a run before left it)"""
    try:
        c.model_delete(name)
    except moe.NotFoundError:
        pass
