#!/usr/bin/env python3
"""api_check.py - the moe package's API against a running cluster: the
generic calls (status, model_info, stats, dataplane_info, call), the error
classes (one per wire code, the same codes as the C library's), the msgpack
codec, forward_train's stats, and `import moe` without torch.

    python3 python/api_check.py --url tcp://127.0.0.1:7000

Prints one line per check and "N passed, M failed"; exit status 1 on a failure.
"""
import argparse
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import moe  # noqa: E402
from moe import _msgpack  # noqa: E402

passed = failed = 0


def check(ok, what):
    global passed, failed
    print("%s %s" % ("PASS" if ok else "FAIL", what))
    if ok:
        passed += 1
    else:
        failed += 1


def raises(cls, fn, *args, **kw):
    """The exception fn raised if it is a cls (else None)."""
    try:
        fn(*args, **kw)
    except cls as e:
        return e
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        print("     raised %s: %s" % (type(e).__name__, e))
        return None
    print("     raised nothing")
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=os.environ.get("MOE_URL", "tcp://127.0.0.1:7000"))
    a = ap.parse_args()

    # the codec
    v = {"a": [0, 1, -1, -33, 127, 128, 255, 65536, 2 ** 40, -(2 ** 40), 1.5, None, True, False],
         "s": "x" * 40, "long": "y" * 70000, "b": b"\x00\x01", "m": {"k": list(range(20))}}
    check(_msgpack.unpackb(_msgpack.packb(v)) == v, "msgpack: a value survives packb/unpackb")
    check(_msgpack.packb({"ok": True}) == bytes.fromhex("81a26f6bc3"),
          "msgpack: {ok: true} is docs/PROTOCOL.md's bytes")

    # the error classes: one per wire code, the C library's codes
    lib = moe.client._lib
    same = all(lib.moe_err_code(n).decode() == moe.errors._CODES[n] for n in range(1, 16))
    check(same, "moe.errors has the C library's 15 wire codes (moe_err_code)")
    check(len(moe.ERROR_CLASSES) == 15 and
          all(issubclass(c, moe.Error) and c.code == code for code, c in moe.ERROR_CLASSES.items()),
          "one moe.Error subclass per wire code, .code set")
    e = moe.error_from_code("busy", "queue full")
    check(isinstance(e, moe.BusyError) and e.code == "busy" and e.number == 3,
          "error_from_code('busy') is a BusyError")
    check(type(moe.error_from_code("no_such_code")) is moe.InternalError,
          "an unknown code is an InternalError")

    c = moe.Client(a.url)
    name = "api_%d" % os.getpid()  # a fresh model on every run
    check(isinstance(c.client_id, int) and c.client_id != 0, "client_id")
    c.ping()
    check(isinstance(c.version(), str) and c.version() != "", "version: %s" % c.version())
    st = c.status()
    check(st.get("ready") is True and len(st.get("workers", [])) == st.get("expected_workers"),
          "status: ready, %d workers" % len(st.get("workers", [])))
    H, F, E, K, T = 32, 48, 4, 2, 10
    c.model_create(name, layers=2, d_model=H, d_ff=F, n_experts=E, top_k=K, seed=2)
    info = c.model_info(name)
    check(info["config"]["d_model"] == H and info["config"]["layers"] == 2 and
          len(info["placement"]) == E, "model_info: config and placement")
    check(c.info(name) == info, "info is model_info")
    dp = c.dataplane_info()
    check("generation" in dp and "workers" in dp, "dataplane_info")
    check(c.call("cluster.status")["generation"] == st["generation"], "call('cluster.status')")

    x = np.random.default_rng(0).uniform(-1, 1, (T, H)).astype(np.float32)
    y, h, fst = c.forward_train(name, 1, x, return_stats=True)
    check(sum(fst["tokens_per_expert"]) == T * K and fst["aux_loss"] > 0,
          "forward_train(return_stats=True): stats with aux_loss %.4f" % fst["aux_loss"])
    dx = c.backward(h, np.ones_like(y))
    check(dx.shape == x.shape, "backward")
    e = raises(moe.FailedPreconditionError, c.backward, h, np.ones_like(y))
    check(e is not None and e.code == "failed_precondition", "a handle used twice: %s" % e)
    n, norm = c.step(name, lr=1e-3)
    check(n == 1 and norm > 0, "step: step %d, grad norm %.4f" % (n, norm))
    e = raises(moe.FailedPreconditionError, c.step, name)
    check(e is not None, "step with no gradients: FailedPreconditionError: %s" % e)
    y, h = c.forward_train(name, 0, x)
    c.backward(h, np.ones_like(y))
    e = raises(moe.FailedPreconditionError, c.step, name, expect_step=7)
    check(e is not None and "at step 1" in str(e),
          "step with a wrong expect_step: FailedPreconditionError: %s" % e)
    stats = c.stats()
    check(stats["models"][name]["forward_total"] >= 1 and
          len(stats["models"][name]["layers"]) == 2, "stats: per model and layer")

    e = raises(moe.NotFoundError, c.forward, "no_such_model", 0, x)
    check(isinstance(e, moe.Error) and e.code == "not_found", "unknown model: NotFoundError")
    e = raises(moe.InvalidArgumentError, c.forward, name, 0, np.zeros((T, H + 1), np.float32))
    check(e is not None and e.code == "invalid_argument", "wrong d_model: InvalidArgumentError")
    e = raises(moe.UnknownMethodError, c.call, "no.such.method")
    check(e is not None and e.code == "unknown_method", "unknown method: UnknownMethodError")
    e = raises(moe.InvalidArgumentError, c.model_create, name, 2, H, F + 1, E, K)
    check(e is not None, "model_create of an existing name with another config")
    c.close()
    check(c.closed, "closed")
    e = raises(moe.ClosedError, c.status)
    check(e is not None and e.code == "closed", "a closed client raises ClosedError")

    # import moe with no torch: torch made unimportable in a child process
    code = ("import sys; sys.modules['torch'] = None; sys.path.insert(0, %r); import moe; "
            "c = moe.Client(%r); c.ping(); c.close()\n"
            "try:\n    moe.torch\nexcept ImportError:\n    print('no torch: ok')\n" % (HERE, a.url))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    check(r.returncode == 0 and "no torch: ok" in r.stdout,
          "import moe works without torch; moe.torch raises ImportError %s" % r.stderr[-300:])
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
