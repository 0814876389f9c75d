"""moe - Python client of the moe service, over the C library (lib/libmoe.so).

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

Errors raise moe.Error with .code (the stable wire code, e.g. "busy").
"""
import ctypes
import os

import numpy as np

_DTYPES = {"f32": 0, "bf16": 1, "f16": 2}


def _load():
    here = os.path.dirname(os.path.abspath(__file__))
    for p in (os.environ.get("MOE_LIB"), os.path.join(here, "..", "lib", "libmoe.so"), "libmoe.so"):
        if p and (os.path.exists(p) or p == "libmoe.so"):
            try:
                return ctypes.CDLL(p)
            except OSError:
                continue
    raise OSError("libmoe.so not found: build it (make) or set MOE_LIB")


_lib = _load()


class _Opts(ctypes.Structure):
    _fields_ = [("timeout_ms", ctypes.c_int), ("max_msg", ctypes.c_size_t),
                ("auth_token", ctypes.c_char_p), ("data_path", ctypes.c_char_p)]


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


_P = ctypes.c_void_p
_lib.moe_client_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Opts), ctypes.POINTER(_P)]
_lib.moe_client_close.argtypes = [_P]
_lib.moe_last_error.restype = ctypes.c_char_p
_lib.moe_err_code.restype = ctypes.c_char_p
_lib.moe_err_code.argtypes = [ctypes.c_int]
_lib.moe_ping.argtypes = [_P]
_lib.moe_model_create.argtypes = [_P, ctypes.POINTER(_ModelCfg)]
_lib.moe_forward.argtypes = [_P, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, _P, ctypes.c_int64,
                             ctypes.c_int64, _P, ctypes.POINTER(_FwdInfo)]
_lib.moe_forward_train.argtypes = _lib.moe_forward.argtypes
_lib.moe_fwd_info_free.argtypes = [ctypes.POINTER(_FwdInfo)]
_lib.moe_backward.argtypes = [_P, ctypes.c_uint64, ctypes.c_int, _P, ctypes.c_int64,
                              ctypes.c_int64, _P]
_lib.moe_optimizer_step.argtypes = [_P, ctypes.c_char_p, ctypes.POINTER(_AdamW),
                                    ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double)]
_lib.moe_buffer_alloc.argtypes = [_P, ctypes.c_size_t]
_lib.moe_buffer_alloc.restype = ctypes.c_void_p
_lib.moe_buffer_free.argtypes = [_P, _P]
_lib.moe_cuda_register.argtypes = [_P, _P, ctypes.c_size_t, ctypes.c_char_p]
_lib.moe_cuda_unregister.argtypes = [_P, _P]
_lib.moe_checkpoint_save.argtypes = [_P, ctypes.c_char_p, ctypes.c_char_p]
_lib.moe_checkpoint_load.argtypes = [_P, ctypes.c_char_p, ctypes.c_char_p,
                                     ctypes.POINTER(ctypes.c_int64)]


class Error(Exception):
    """A failed call: .code is the stable wire code ("busy", "not_found", ...)."""

    def __init__(self, err, message=None):
        self.code = _lib.moe_err_code(err).decode()
        if message is None:
            message = _lib.moe_last_error().decode(errors="replace")
        super().__init__("%s: %s" % (self.code, message))

    @classmethod
    def closed(cls):
        return cls(15, "the client is closed")


def _check(err):
    if err != 0:
        raise Error(err)


def to_bf16(a):
    """float32 array -> uint16 array of bfloat16 bits (round to nearest even)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u >> 16) & 1) + 0x7FFF
    out = ((u + r) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(a, dtype=np.float32))
    out[nan] = 0x7FC0
    return out


def from_bf16(h):
    """uint16 array of bfloat16 bits -> float32 array."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _dtype_of(a):
    if a.dtype == np.float32:
        return _DTYPES["f32"]
    if a.dtype == np.uint16:
        return _DTYPES["bf16"]
    if a.dtype == np.float16:
        return _DTYPES["f16"]
    raise TypeError("x must be float32, float16 or uint16 (bf16 bits), not %s" % a.dtype)


def _is_torch(a):
    return type(a).__module__.startswith("torch")


def _torch_to_numpy(t):
    """A CPU torch tensor's rows as a NumPy array sharing its memory (bf16 as
    uint16 bits); the torch dtype to give the result back in."""
    import torch
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), t.dtype
    if t.dtype in (torch.float32, torch.float16):
        return t.numpy(), t.dtype
    raise TypeError("x must be float32, float16 or bfloat16, not %s" % t.dtype)


def _numpy_to_torch(a, dtype):
    import torch
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


_TORCH_DTYPES = {"torch.float32": _DTYPES["f32"], "torch.bfloat16": _DTYPES["bf16"],
                 "torch.float16": _DTYPES["f16"]}


class Client:
    """A connection to the coordinator; thread safe like libmoe's client."""

    def __init__(self, url="tcp://127.0.0.1:7000", timeout_ms=60000, auth_token=None,
                 data_path=None):
        """data_path: how forward/backward rows travel - "auto" (default:
        straight to the workers, through shared memory on the same host),
        "socket", "shm" or "coordinator"; None = $MOE_DATA_PATH or auto."""
        self._c = _P()
        self._bufs = {}      # address -> (size, array) of Client.buffer arrays
        self._cuda = {}      # allocation base -> size of registered CUDA allocations
        opts = _Opts(timeout_ms, 0, auth_token.encode() if auth_token else None,
                     data_path.encode() if data_path else None)
        _check(_lib.moe_client_open(url.encode(), ctypes.byref(opts), ctypes.byref(self._c)))

    def _live(self):
        if not self._c:
            raise Error.closed()
        return self._c

    def close(self):
        if self._c:
            _lib.moe_client_close(self._c)  # frees the buffers and registrations too
            self._c = _P()
            self._bufs.clear()
            self._cuda.clear()

    def buffer(self, shape, dtype="f32"):
        """A NumPy array whose rows travel with no copy: shared memory that the
        workers on this host map once (plain memory elsewhere). dtype "f32",
        "f16" or "bf16" (uint16 bits). Valid until free(a) or close()."""
        npdt = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[dtype]
        n = int(np.prod(shape)) * np.dtype(npdt).itemsize
        addr = _lib.moe_buffer_alloc(self._live(), n)
        if not addr:
            raise MemoryError(_lib.moe_last_error().decode(errors="replace"))
        a = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr)).view(npdt)
        a = a.reshape(shape)
        self._bufs[addr] = (n, a)
        return a

    def free(self, a):
        """Gives back an array from buffer()."""
        addr = a.ctypes.data
        if addr in self._bufs:
            del self._bufs[addr]
            _lib.moe_buffer_free(self._live(), addr)

    def _cuda_rows(self, t):
        """A CUDA tensor's address, its allocation registered with the workers
        (CUDA IPC: cudaIpcGetMemHandle through torch's storage sharing)."""
        import torch
        if not t.is_contiguous():
            raise ValueError("CUDA tensors must be contiguous")
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def ping(self):
        _check(_lib.moe_ping(self._live()))

    def model_create(self, name, layers, d_model, d_ff, n_experts, top_k, activation="swiglu",
                     renormalize=False, capacity_factor=0.0, dtype="f32", seed=0,
                     aux_loss_coef=0.01, z_loss_coef=0.0):
        cfg = _ModelCfg(name.encode(), layers, d_model, d_ff, n_experts, top_k,
                        activation.encode(), int(renormalize), capacity_factor, _DTYPES[dtype],
                        seed, aux_loss_coef, z_loss_coef)
        _check(_lib.moe_model_create(self._live(), ctypes.byref(cfg)))

    def _forward(self, fn, model, layer, x, out=None):
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
    def _handle(info):
        handle = info.handle
        _lib.moe_fwd_info_free(ctypes.byref(info))
        return handle

    @staticmethod
    def _stats(info):
        n = info.n_experts
        stats = {
            "tokens_per_expert": [info.tokens_per_expert[i] for i in range(n)],
            "dropped": [info.dropped[i] for i in range(n)] if info.dropped else [0] * n,
            "imbalance": info.imbalance, "aux_loss": info.aux_loss, "z_loss": info.z_loss,
            "gate_s": info.gate_s, "dispatch_s": info.dispatch_s, "experts_s": info.experts_s,
            "combine_s": info.combine_s, "total_s": info.total_s,
        }
        return stats

    def forward(self, model, layer, x, out=None):
        """y (T, d_model) of x's dtype and kind (NumPy, torch CPU or CUDA), and the
        stats dict. out: where to write y (e.g. a Client.buffer array)."""
        y, stats, _ = self._forward(_lib.moe_forward, model, layer, x, out)
        return y, stats

    def forward_train(self, model, layer, x, out=None):
        """y and the handle for backward (used once)."""
        y, _, handle = self._forward(_lib.moe_forward_train, model, layer, x, out)
        return y, handle

    def backward(self, handle, dy, out=None):
        """dx of dy's dtype and kind."""
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

    def step(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
             max_grad_norm=0.0, expect_step=None):
        """AdamW on every parameter of model; returns (step, grad_norm)."""
        opt = _AdamW(lr, betas[0], betas[1], eps, weight_decay, max_grad_norm,
                     int(expect_step is not None), expect_step or 0)
        step = ctypes.c_int64()
        norm = ctypes.c_double()
        _check(_lib.moe_optimizer_step(self._live(), model.encode(), ctypes.byref(opt),
                                       ctypes.byref(step), ctypes.byref(norm)))
        return step.value, norm.value

    def checkpoint_save(self, model, path):
        _check(_lib.moe_checkpoint_save(self._live(), model.encode(), path.encode()))

    def checkpoint_load(self, model, path):
        step = ctypes.c_int64()
        _check(_lib.moe_checkpoint_load(self._live(), model.encode(), path.encode(),
                                        ctypes.byref(step)))
        return step.value


def read_safetensors(path):
    """{name: float32 array} and the metadata of one safetensors file (F32 only)."""
    import json
    import struct
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    meta = head.pop("__metadata__", {})
    out = {}
    for name, t in head.items():
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=np.float32).reshape(t["shape"])
    return out, meta


def read_checkpoint(root):
    """Every tensor of the newest checkpoint under root (checkpoint.save's layout)."""
    import json
    with open(os.path.join(root, "LATEST")) as f:
        d = os.path.join(root, f.read().strip())
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        t, _ = read_safetensors(os.path.join(d, file))
        tensors.update(t)
    return tensors, index["metadata"]
