"""moe - the Python client of the moe distributed Mixture-of-Experts service.

    import moe, numpy as np
    c = moe.Client("tcp://127.0.0.1:7000")
    c.model_create("m", layers=1, d_model=512, d_ff=1024, n_experts=8, top_k=2)
    y, stats = c.forward("m", 0, np.random.rand(16, 512).astype(np.float32))
    y, h = c.forward_train("m", 0, x);  dx = c.backward(h, dy);  c.step("m", lr=1e-3)
    c.status(); c.model_info("m"); c.stats()

Tensors are NumPy arrays or torch tensors (CPU or CUDA; f32, f16, bf16).
Failures raise subclasses of moe.Error (moe.BusyError, moe.NotFoundError,
moe.ExpiredError, ...), each with .code, the stable wire code.

moe.torch.RemoteMoE (imported on first use, so that `import moe` needs no
torch) is a torch.nn.Module for one MoE layer held by the service.

The client runs over the C library libmoe.so: $MOE_LIB, else the
repository's lib/ when run from a source tree, else the copy installed with
the package (`make && pip install ./python`); moe.lib_path says which.
"""
from typing import Any

from .client import (Client, from_bf16, lib_path, read_checkpoint, read_safetensors, strerror,
                     to_bf16)
from .errors import (ERROR_CLASSES, BusyError, ClosedError, DeadlineExceededError, Error,
                     ExpiredError, FailedPreconditionError, InternalError, InvalidArgumentError,
                     IoError, MalformedError, NotFoundError, ResourceExhaustedError,
                     TooLargeError, UnauthenticatedError, UnavailableError, UnknownMethodError,
                     error_from_code)

__version__ = "0.2.0"

__all__ = [
    "Client", "Error", "ERROR_CLASSES", "BusyError", "ClosedError", "DeadlineExceededError",
    "ExpiredError", "FailedPreconditionError", "InternalError", "InvalidArgumentError",
    "IoError", "MalformedError", "NotFoundError", "ResourceExhaustedError", "TooLargeError",
    "UnauthenticatedError", "UnavailableError", "UnknownMethodError", "error_from_code",
    "from_bf16", "to_bf16", "lib_path", "read_checkpoint", "read_safetensors", "strerror",
]


def __getattr__(name: str) -> Any:
    # moe.torch on first use: `import moe` works without torch installed
    if name == "torch":
        import importlib
        return importlib.import_module(".torch", __name__)
    raise AttributeError("module 'moe' has no attribute %r" % name)
