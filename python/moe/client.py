"""moe.client - the Python client of the moe service, over the C library
libmoe.so (ctypes).

Tensors are NumPy arrays or PyTorch tensors (CPU or CUDA, float32, float16
or bfloat16; results come back as the same kind). In NumPy, bf16 travels as
uint16 arrays holding bfloat16 bits; ``to_bf16`` and ``from_bf16`` convert.
The rows go straight to the workers (the data plane); on the same host
through shared memory, with no copy for arrays from ``Client.buffer``, and
GPU to GPU for CUDA tensors (CUDA IPC).

    import moe, numpy as np
    c = moe.Client("tcp://127.0.0.1:7000")
    c.model_create("m", layers=1, d_model=512, d_ff=1024, n_experts=8, top_k=2)
    y, stats = c.forward("m", 0, np.random.rand(16, 512).astype(np.float32))
    y, h = c.forward_train("m", 0, x);  dx = c.backward(h, dy);  c.step("m", lr=1e-3)

Errors raise a subclass of moe.Error (moe.BusyError, moe.NotFoundError, ...)
with .code, the stable wire code (e.g. "busy").

Where libmoe.so is found: $MOE_LIB if set (only there); else the
repository's lib/ when this package runs from a source tree (python/moe);
else the copy installed inside the package (pip install ./python); else
the system's library path.
"""
import ctypes
import json
import os
import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _msgpack
from .errors import Error, error_from

_DTYPES = {"f32": 0, "bf16": 1, "f16": 2}

#: a tensor argument: a NumPy array or a torch.Tensor (CPU or CUDA)
Tensor = Any


def _lib_candidates() -> List[str]:
    env = os.environ.get("MOE_LIB")
    if env:
        return [env]  # asked for explicitly: that one or an error
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    out = []
    if os.path.exists(os.path.join(root, "base", "moe.h")):  # python/moe in the repository
        out.append(os.path.join(root, "lib", "libmoe.so"))
    out.append(os.path.join(here, "libmoe.so"))  # installed with the package
    out.append("libmoe.so")  # the system's library path (ldconfig, LD_LIBRARY_PATH)
    return out


def _load() -> Tuple[Optional[ctypes.CDLL], str, str]:
    """(the library or None, its path, why it failed)."""
    why = []
    for p in _lib_candidates():
        if os.sep in p and not os.path.exists(p):
            why.append("%s: no such file" % p)
            continue
        try:
            return ctypes.CDLL(p), p, ""
        except OSError as e:
            why.append(str(e))
    return None, "", "; ".join(why)


_lib, lib_path, _lib_why = _load()


def _need_lib() -> ctypes.CDLL:
    if _lib is None:
        raise OSError("libmoe.so not found (%s): build it (make) and install the package "
                      "(pip install ./python), or set MOE_LIB" % _lib_why)
    return _lib


class _Opts(ctypes.Structure):
    _fields_ = [("timeout_ms", ctypes.c_int), ("max_msg", ctypes.c_size_t),
                ("auth_token", ctypes.c_char_p), ("data_path", ctypes.c_char_p),
                ("tls_ca", ctypes.c_char_p), ("tls_cert", ctypes.c_char_p),
                ("tls_key", ctypes.c_char_p)]


class _ModelCfg(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("layers", ctypes.c_int), ("d_model", ctypes.c_int),
                ("d_ff", ctypes.c_int), ("n_experts", ctypes.c_int), ("top_k", ctypes.c_int),
                ("activation", ctypes.c_char_p), ("renormalize", ctypes.c_int),
                ("capacity_factor", ctypes.c_double), ("dtype", ctypes.c_int),
                ("seed", ctypes.c_uint64), ("aux_loss_coef", ctypes.c_double),
                ("z_loss_coef", ctypes.c_double)]


class _FwdInfo(ctypes.Structure):
    _fields_ = [("n_experts", ctypes.c_int), ("tokens_per_expert", ctypes.POINTER(ctypes.c_int64)),
                ("dropped", ctypes.POINTER(ctypes.c_int64)), ("imbalance", ctypes.c_double),
                ("gate_s", ctypes.c_double), ("dispatch_s", ctypes.c_double),
                ("experts_s", ctypes.c_double), ("combine_s", ctypes.c_double),
                ("total_s", ctypes.c_double), ("aux_loss", ctypes.c_double),
                ("z_loss", ctypes.c_double), ("handle", ctypes.c_uint64)]


class _AdamW(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("max_grad_norm", ctypes.c_double), ("check_step", ctypes.c_int),
                ("expect_step", ctypes.c_int64)]


class _Reply(ctypes.Structure):
    _fields_ = [("buf", ctypes.POINTER(ctypes.c_uint8)), ("len", ctypes.c_size_t),
                ("result_off", ctypes.c_size_t), ("err", ctypes.c_int),
                ("message", ctypes.c_char * 512), ("transport", ctypes.c_int)]


_P = ctypes.c_void_p


def _declare(lib: ctypes.CDLL):
    lib.moe_client_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Opts), ctypes.POINTER(_P)]
    lib.moe_client_close.argtypes = [_P]
    lib.moe_client_id.argtypes = [_P]
    lib.moe_client_id.restype = ctypes.c_uint64
    lib.moe_last_error.restype = ctypes.c_char_p
    lib.moe_err_code.restype = ctypes.c_char_p
    lib.moe_err_code.argtypes = [ctypes.c_int]
    lib.moe_strerror.restype = ctypes.c_char_p
    lib.moe_strerror.argtypes = [ctypes.c_int]
    lib.moe_call.argtypes = [_P, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                             ctypes.POINTER(_Reply)]
    lib.moe_reply_free.argtypes = [ctypes.POINTER(_Reply)]
    lib.moe_ping.argtypes = [_P]
    lib.moe_model_create.argtypes = [_P, ctypes.POINTER(_ModelCfg)]
    lib.moe_model_delete.argtypes = [_P, ctypes.c_char_p]
    lib.moe_model_create_from_hf.argtypes = [_P, ctypes.c_char_p, ctypes.c_char_p,
                                             ctypes.c_char_p]
    lib.moe_forward.argtypes = [_P, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, _P,
                                ctypes.c_int64, ctypes.c_int64, _P, ctypes.POINTER(_FwdInfo)]
    lib.moe_forward_train.argtypes = lib.moe_forward.argtypes
    lib.moe_fwd_info_free.argtypes = [ctypes.POINTER(_FwdInfo)]
    lib.moe_backward.argtypes = [_P, ctypes.c_uint64, ctypes.c_int, _P, ctypes.c_int64,
                                 ctypes.c_int64, _P]
    lib.moe_optimizer_step.argtypes = [_P, ctypes.c_char_p, ctypes.POINTER(_AdamW),
                                       ctypes.POINTER(ctypes.c_int64),
                                       ctypes.POINTER(ctypes.c_double)]
    lib.moe_buffer_alloc.argtypes = [_P, ctypes.c_size_t]
    lib.moe_buffer_alloc.restype = ctypes.c_void_p
    lib.moe_buffer_free.argtypes = [_P, _P]
    lib.moe_cuda_register.argtypes = [_P, _P, ctypes.c_size_t, ctypes.c_char_p]
    lib.moe_cuda_unregister.argtypes = [_P, _P]
    lib.moe_checkpoint_save.argtypes = [_P, ctypes.c_char_p, ctypes.c_char_p]
    lib.moe_checkpoint_load.argtypes = [_P, ctypes.c_char_p, ctypes.c_char_p,
                                        ctypes.POINTER(ctypes.c_int64)]


if _lib is not None:
    _declare(_lib)


def _last_error() -> str:
    return _need_lib().moe_last_error().decode(errors="replace")


def _check(err: int):
    if err != 0:
        raise error_from(err, _last_error())


def strerror(err: int) -> str:
    """The C library's description of a moe_err value (Error.number)."""
    return _need_lib().moe_strerror(int(err)).decode(errors="replace")


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 array -> uint16 array of bfloat16 bits (round to nearest even)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u >> 16) & 1) + 0x7FFF
    out = ((u + r) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(a, dtype=np.float32))
    out[nan] = 0x7FC0
    return out


def from_bf16(h: np.ndarray) -> np.ndarray:
    """uint16 array of bfloat16 bits -> float32 array."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _dtype_of(a: np.ndarray) -> int:
    if a.dtype == np.float32:
        return _DTYPES["f32"]
    if a.dtype == np.uint16:
        return _DTYPES["bf16"]
    if a.dtype == np.float16:
        return _DTYPES["f16"]
    raise TypeError("x must be float32, float16 or uint16 (bf16 bits), not %s" % a.dtype)


def _is_torch(a: Any) -> bool:
    return type(a).__module__.startswith("torch")


def _torch_to_numpy(t: Any) -> Tuple[np.ndarray, Any]:
    """A CPU torch tensor's rows as a NumPy array sharing its memory (bf16 as
    uint16 bits); the torch dtype to give the result back in."""
    import torch
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), t.dtype
    if t.dtype in (torch.float32, torch.float16):
        return t.numpy(), t.dtype
    raise TypeError("x must be float32, float16 or bfloat16, not %s" % t.dtype)


def _numpy_to_torch(a: np.ndarray, dtype: Any) -> Any:
    import torch
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


_TORCH_DTYPES = {"torch.float32": _DTYPES["f32"], "torch.bfloat16": _DTYPES["bf16"],
                 "torch.float16": _DTYPES["f16"]}


class Client:
    """A connection to the coordinator; thread safe like libmoe's client.

    Every method raises a subclass of moe.Error on failure (moe.ClosedError
    once the client is closed). Use as a context manager to close it.
    """

    def __init__(self, url: str = "tcp://127.0.0.1:7000", timeout_ms: int = 60000,
                 auth_token: Optional[str] = None, data_path: Optional[str] = None,
                 max_msg: int = 0, tls_ca: Optional[str] = None,
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None):
        """url: the coordinator (tcp://host:port, tls+tcp://host:port,
        ipc:///path). timeout_ms: per call. auth_token: the coordinator's
        --auth-token, if any. data_path: how forward/backward rows travel -
        "auto" (default: straight to the workers, through shared memory on
        the same host, large rows to workers on other hosts over their bulk
        TCP endpoint), "socket", "shm", "bulk", "nccl" (CUDA workers, a CUDA
        build of libmoe: torch CUDA tensors GPU to GPU over NCCL, host arrays
        staged through GPU $MOE_NCCL_DEVICE; not yet run from Python on a
        GPU host) or "coordinator"; None =
        $MOE_DATA_PATH or auto. max_msg: the largest response accepted in
        bytes (0 = 1 GiB). tls_ca: PEM file of the CA that signed the
        server's certificate (required for tls+tcp://; the host name of the
        url is checked against the certificate); tls_cert, tls_key: a client
        certificate and its key (optional)."""
        lib = _need_lib()
        # the nccl path takes CUDA tensors' device pointers as they are
        # (libmoe sends and receives them over NCCL); other paths share them
        # with the workers by CUDA IPC (_cuda_rows)
        self._nccl = (data_path or os.environ.get("MOE_DATA_PATH", "")) == "nccl"
        self._c = _P()
        self._bufs: Dict[int, Tuple[int, np.ndarray]] = {}  # address -> Client.buffer array
        self._cuda: Dict[int, int] = {}  # allocation base -> size of registered CUDA memory
        def enc(v: Optional[str]) -> Optional[bytes]:
            return v.encode() if v else None
        opts = _Opts(timeout_ms, max_msg, enc(auth_token), enc(data_path), enc(tls_ca),
                     enc(tls_cert), enc(tls_key))
        _check(lib.moe_client_open(url.encode(), ctypes.byref(opts), ctypes.byref(self._c)))
        self.url = url

    def _live(self) -> _P:
        if not self._c:
            raise Error.closed()
        return self._c

    @property
    def closed(self) -> bool:
        """True once close() ran."""
        return not self._c

    @property
    def client_id(self) -> int:
        """The random 64-bit id this client sends in every request id ("rid")."""
        return int(_lib.moe_client_id(self._live()))

    def close(self) -> None:
        """Closes the connection; frees the buffers and CUDA registrations. Idempotent."""
        if self._c:
            _lib.moe_client_close(self._c)
            self._c = _P()
            self._bufs.clear()
            self._cuda.clear()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- generic calls ----

    def call(self, method: str, params: Optional[Dict[str, Any]] = None) -> Any:
        """Any coordinator method by name (docs/PROTOCOL.md, "Methods"): params
        as a dict (not "rid", nor "auth" when the client has a token: the
        library adds them); returns the decoded result (dicts, lists, str,
        int, float, bytes)."""
        c = self._live()
        data = _msgpack.packb(params if params is not None else {})
        rep = _Reply()
        err = _lib.moe_call(c, method.encode(), data, len(data), ctypes.byref(rep))
        try:
            if err != 0:
                raise error_from(err, rep.message.decode(errors="replace"))
            raw = ctypes.string_at(rep.buf, rep.len)[rep.result_off:]
            return _msgpack.unpackb(raw)
        finally:
            _lib.moe_reply_free(ctypes.byref(rep))

    def ping(self) -> None:
        """One round trip to the coordinator."""
        _check(_lib.moe_ping(self._live()))

    def version(self) -> str:
        """The coordinator's version string (from ping)."""
        return self.call("ping").get("version", "")

    def status(self) -> Dict[str, Any]:
        """cluster.status: {ready, expected_workers, up_workers, generation,
        draining, workers: [{id, rank, state, rpc_url, ...}]}."""
        return self.call("cluster.status")

    def model_info(self, model: str) -> Dict[str, Any]:
        """model.info: {config: {model.create params}, params, ready, placement}."""
        return self.call("model.info", {"model": model})

    info = model_info

    def stats(self) -> Dict[str, Any]:
        """stats: cumulative service statistics, per model and layer
        (tokens_per_expert, dropped, imbalance), request counts, phase times."""
        return self.call("stats")

    def dataplane_info(self) -> Dict[str, Any]:
        """dataplane.info: {generation, ready, direct, lane, fanout, workers: [{url, bulk_url, host,
        backend}]}."""
        return self.call("dataplane.info")

    def drain(self) -> None:
        """Asks the coordinator to stop taking jobs, finish its queue and exit."""
        self.call("drain")

    # ---- models ----

    def model_create(self, name: str, layers: int, d_model: int, d_ff: int, n_experts: int,
                     top_k: int, activation: str = "swiglu", renormalize: bool = False,
                     capacity_factor: float = 0.0, dtype: str = "f32", seed: int = 0,
                     aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0) -> None:
        """Creates a model of `layers` MoE layers (a no-op if it exists with the
        same config; InvalidArgumentError with another). activation "swiglu"
        or "gelu"; renormalize: the top-k gate weights sum to 1;
        capacity_factor 0 = dropless; dtype "f32" or "bf16"; seed: the
        deterministic weight init; aux_loss_coef, z_loss_coef: the router
        losses whose gradients backward adds."""
        cfg = _ModelCfg(name.encode(), layers, d_model, d_ff, n_experts, top_k,
                        activation.encode(), int(renormalize), capacity_factor, _DTYPES[dtype],
                        seed, aux_loss_coef, z_loss_coef)
        _check(_lib.moe_model_create(self._live(), ctypes.byref(cfg)))

    def model_delete(self, name: str) -> None:
        """Deletes a model everywhere (model.delete); the name may be created
        again. NotFoundError when there is none; FailedPreconditionError
        while requests for it are queued."""
        _check(_lib.moe_model_delete(self._live(), name.encode()))

    def model_create_from_hf(self, name: str, path: str, dtype: Optional[str] = None) -> None:
        """Creates model `name` from a Hugging Face model directory as
        published (config.json + model.safetensors, or shards with
        model.safetensors.index.json; Mixtral, Qwen3-MoE, OLMoE): one moe
        layer per MoE layer of the checkpoint, with its weights and tensor
        names (model_info(name)["hf"]). path is on the coordinator's file
        system, under its checkpoint root. dtype "f32" or "bf16"; None: the
        checkpoint's own."""
        _check(_lib.moe_model_create_from_hf(self._live(), name.encode(), path.encode(),
                                             dtype.encode() if dtype else None))

    def model_grads(self, model: str, layer: int,
                    expert: Optional[int] = None) -> Dict[str, np.ndarray]:
        """model.grads: the weight gradients of one layer accumulated by the
        backwards since the last optimizer_step, {tensor name: float32 array}
        (names as in the model's checkpoint: the router, the experts, and the
        shared expert and its gate where the model has them; with expert,
        only its matrices, the router's and the shared expert's)."""
        params: Dict[str, Any] = {"model": model, "layer": layer}
        if expert is not None:
            params["expert"] = expert
        res = self.call("model.grads", params)
        return {k: np.frombuffer(t["data"], dtype=np.float32).reshape(t["shape"]).copy()
                for k, t in res["tensors"].items()}

    # ---- rows in place ----

    def buffer(self, shape: Union[int, Sequence[int]], dtype: str = "f32") -> np.ndarray:
        """A NumPy array whose rows travel with no copy: shared memory that the
        workers on this host map once (plain memory elsewhere). dtype "f32",
        "f16" or "bf16" (uint16 bits). Valid until free(a) or close()."""
        npdt = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[dtype]
        n = int(np.prod(shape)) * np.dtype(npdt).itemsize
        addr = _lib.moe_buffer_alloc(self._live(), n)
        if not addr:
            raise MemoryError(_last_error())
        a = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr)).view(npdt)
        a = a.reshape(shape)
        self._bufs[addr] = (n, a)
        return a

    def free(self, a: np.ndarray) -> None:
        """Gives back an array from buffer()."""
        addr = a.ctypes.data
        if addr in self._bufs:
            del self._bufs[addr]
            _lib.moe_buffer_free(self._live(), addr)

    def _cuda_rows(self, t: Any) -> int:
        """A CUDA tensor's address, its allocation registered with the workers
        (CUDA IPC: cudaIpcGetMemHandle through torch's storage sharing); on
        the nccl path the address alone (the rows go GPU to GPU over NCCL)."""
        import torch
        if not t.is_contiguous():
            raise ValueError("CUDA tensors must be contiguous")
        if self._nccl:
            torch.cuda.current_stream(t.device).synchronize()  # x written before NCCL reads it
            return t.data_ptr()
        st = t.untyped_storage()
        share = st._share_cuda_()
        handle, size, offset = bytes(share[1]), share[2], share[3]
        # torch's caching allocator prefixes the cudaIpcMemHandle_t (64 bytes)
        # with a version byte and a kind byte ('c': a cudaMalloc block)
        if len(handle) == 66 and handle[1:2] == b"c":
            handle = handle[2:]
        elif len(handle) == 65 and handle[0:1] == b"c":
            handle = handle[1:]
        if len(handle) != 64:
            raise NotImplementedError("this CUDA allocation cannot be shared by CUDA IPC "
                                      "(expandable segments?): pass a CPU tensor")
        base = st.data_ptr() - offset
        if self._cuda.get(base, 0) < offset + size:
            if base in self._cuda:
                _lib.moe_cuda_unregister(self._live(), base)
            _check(_lib.moe_cuda_register(self._live(), base, offset + size, handle))
            self._cuda[base] = offset + size
        torch.cuda.current_stream(t.device).synchronize()  # x written before the workers read it
        return t.data_ptr()

    # ---- forward, backward, step ----

    def _forward(self, fn: Any, model: str, layer: int, x: Tensor,
                 out: Optional[Tensor] = None) -> Tuple[Tensor, Dict[str, Any], int]:
        c = self._live()
        back = None
        if _is_torch(x) and x.is_cuda:  # GPU to GPU: CUDA IPC
            import torch
            x = x.detach().contiguous()
            if x.ndim != 2:
                raise ValueError("x must be 2-D (T, d_model)")
            y = out if out is not None else torch.empty_like(x)
            dt = _TORCH_DTYPES[str(x.dtype)]
            xp, yp = self._cuda_rows(x), self._cuda_rows(y)
            info = _FwdInfo()
            _check(fn(c, model.encode(), layer, dt, xp, x.shape[0], x.shape[1], yp,
                      ctypes.byref(info)))
            return y, self._stats(info), self._handle(info)
        if _is_torch(x):
            x, back = _torch_to_numpy(x)
        x = np.ascontiguousarray(x)
        if x.ndim != 2:
            raise ValueError("x must be 2-D (T, d_model)")
        y = out if out is not None else np.empty_like(x)
        info = _FwdInfo()
        _check(fn(c, model.encode(), layer, _dtype_of(x), x.ctypes.data, x.shape[0],
                  x.shape[1], y.ctypes.data, ctypes.byref(info)))
        if back is not None:
            y = _numpy_to_torch(y, back)
        return y, self._stats(info), self._handle(info)

    @staticmethod
    def _handle(info: _FwdInfo) -> int:
        handle = info.handle
        _lib.moe_fwd_info_free(ctypes.byref(info))
        return handle

    @staticmethod
    def _stats(info: _FwdInfo) -> Dict[str, Any]:
        n = info.n_experts
        stats = {
            "tokens_per_expert": [info.tokens_per_expert[i] for i in range(n)],
            "dropped": [info.dropped[i] for i in range(n)] if info.dropped else [0] * n,
            "imbalance": info.imbalance, "aux_loss": info.aux_loss, "z_loss": info.z_loss,
            "gate_s": info.gate_s, "dispatch_s": info.dispatch_s, "experts_s": info.experts_s,
            "combine_s": info.combine_s, "total_s": info.total_s,
        }
        return stats

    def forward(self, model: str, layer: int, x: Tensor,
                out: Optional[Tensor] = None) -> Tuple[Tensor, Dict[str, Any]]:
        """Inference: y (T, d_model) of x's dtype and kind (NumPy, torch CPU or
        CUDA), and the stats dict (tokens_per_expert, dropped, imbalance,
        aux_loss, z_loss, phase times). x is 2-D (T, d_model). out: where to
        write y (e.g. a Client.buffer array)."""
        y, stats, _ = self._forward(_lib.moe_forward, model, layer, x, out)
        return y, stats

    def forward_train(self, model: str, layer: int, x: Tensor, out: Optional[Tensor] = None,
                      return_stats: bool = False):
        """Training forward: (y, handle), or (y, handle, stats) with
        return_stats. The handle is for one backward() (it expires after the
        service's handle TTL: ExpiredError)."""
        y, stats, handle = self._forward(_lib.moe_forward_train, model, layer, x, out)
        if return_stats:
            return y, handle, stats
        return y, handle

    def backward(self, handle: int, dy: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """dx of dy's dtype and kind, for a forward_train handle (used once).
        The gradients of the expert and router weights (with the aux and z
        losses) accumulate in the service until step()."""
        c = self._live()
        if _is_torch(dy) and dy.is_cuda:
            import torch
            dy = dy.detach().contiguous()
            dx = out if out is not None else torch.empty_like(dy)
            dyp, dxp = self._cuda_rows(dy), self._cuda_rows(dx)
            _check(_lib.moe_backward(c, handle, _TORCH_DTYPES[str(dy.dtype)], dyp, dy.shape[0],
                                     dy.shape[1], dxp))
            return dx
        back = None
        if _is_torch(dy):
            dy, back = _torch_to_numpy(dy)
        dy = np.ascontiguousarray(dy)
        dx = out if out is not None else np.empty_like(dy)
        _check(_lib.moe_backward(c, handle, _dtype_of(dy), dy.ctypes.data, dy.shape[0],
                                 dy.shape[1], dx.ctypes.data))
        return dx if back is None else _numpy_to_torch(dx, back)

    def step(self, model: str, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
             eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
             expect_step: Optional[int] = None) -> Tuple[int, float]:
        """AdamW (bias-corrected, decoupled weight decay) on every parameter of
        model, in the service; zeroes the gradients. max_grad_norm > 0 clips
        the whole model's gradient norm. expect_step: apply only if the model
        is at that step count (a safe retry; else FailedPreconditionError).
        Returns (step count, gradient norm before clipping)."""
        opt = _AdamW(lr, betas[0], betas[1], eps, weight_decay, max_grad_norm,
                     int(expect_step is not None), expect_step or 0)
        step = ctypes.c_int64()
        norm = ctypes.c_double()
        _check(_lib.moe_optimizer_step(self._live(), model.encode(), ctypes.byref(opt),
                                       ctypes.byref(step), ctypes.byref(norm)))
        return step.value, norm.value

    optimizer_step = step

    # ---- checkpoints ----

    def checkpoint_save(self, model: str, path: str) -> None:
        """Writes a checkpoint of model under directory path (safetensors,
        Hugging Face Mixtral names; read it back with moe.read_checkpoint)."""
        _check(_lib.moe_checkpoint_save(self._live(), model.encode(), path.encode()))

    def checkpoint_load(self, model: str, path: str) -> int:
        """Loads the newest complete checkpoint under path (or path itself if it
        holds an index) into model; returns its step count."""
        step = ctypes.c_int64()
        _check(_lib.moe_checkpoint_load(self._live(), model.encode(), path.encode(),
                                        ctypes.byref(step)))
        return step.value


def read_safetensors(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """{name: float32 array} and the metadata of one safetensors file (F32 only)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    meta = head.pop("__metadata__", {})
    out = {}
    for name, t in head.items():
        if t.get("dtype", "F32") != "F32":
            raise ValueError("%s: %s is %s, only F32 is read" % (path, name, t.get("dtype")))
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=np.float32).reshape(t["shape"])
    return out, meta


def read_checkpoint(root: str) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
    """Every tensor of the newest checkpoint under root (checkpoint.save's
    layout: root/LATEST names the directory) and the index's metadata."""
    with open(os.path.join(root, "LATEST")) as f:
        d = os.path.join(root, f.read().strip())
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors: Dict[str, np.ndarray] = {}
    for file in sorted(set(index["weight_map"].values())):
        t, _ = read_safetensors(os.path.join(d, file))
        tensors.update(t)
    return tensors, index["metadata"]
