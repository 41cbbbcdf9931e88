"""Test-only workarounds for running on a CPU-only machine.

* Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, set before triton is imported).
* mamba_ssm's own Triton wrappers enter ``torch.cuda.device(x.device.index)``; on CPU tensors the
  index is None, which a CPU build of torch rejects, so we let ``device(None)`` be a no-op.
* The *oracle* (mamba_ssm's unmodified model run token by token through ``Mamba2.step``) uses
  mamba_ssm's own plain-PyTorch references for its Triton ops (``selective_state_update_ref``,
  ``rms_norm_ref``) so that model-level tests finish in seconds rather than minutes.
"""
import contextlib
import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # the tests' tensors are tiny: a second thread only adds synchronisation (seen 100x slower
    # when the other core is busy)
    torch.set_num_threads(1)

import pytest  # noqa: E402

# tests/vllm need vLLM, which lives in an environment of its own (scripts/venv-vllm): elsewhere
# they are not collected at all rather than reported as skipped
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm"]

_cuda_device = torch.cuda.device


class _DeviceOrNoop:
    def __new__(cls, device):
        if device is None or (isinstance(device, int) and device < 0):
            return contextlib.nullcontext()
        return _cuda_device(device)


if not torch.cuda.is_available():
    torch.cuda.device = _DeviceOrNoop

from stree._mamba import mamba_ssm  # noqa: E402,F401
from mamba_ssm.modules import block as _block  # noqa: E402
from mamba_ssm.modules import mamba2 as _mamba2  # noqa: E402
from mamba_ssm.models import mixer_seq_simple as _mixer  # noqa: E402
from mamba_ssm.ops.triton import layer_norm as _ln  # noqa: E402
from mamba_ssm.ops.triton import layernorm_gated as _lng  # noqa: E402
from mamba_ssm.ops.triton.selective_state_update import selective_state_update_ref  # noqa: E402


def _layer_norm_fn_ref(x, weight, bias, residual=None, eps=1e-6, prenorm=False,
                       residual_in_fp32=False, is_rms_norm=False, **_):
    ref = _ln.rms_norm_ref if is_rms_norm else _ln.layer_norm_ref
    x_in = x if residual is None else x
    out, res = ref(x_in, weight, bias, residual=residual, eps=eps, prenorm=True, upcast=True)
    out = out.to(x.dtype)
    if residual_in_fp32:
        res = res.float()
    return (out, res) if prenorm else out


def _rmsnorm_forward_ref(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    return _layer_norm_fn_ref(x, self.weight, self.bias, residual=residual, eps=self.eps,
                              prenorm=prenorm, residual_in_fp32=residual_in_fp32, is_rms_norm=True)


def _gated_rmsnorm_forward_ref(self, x, z=None):
    return _lng.rms_norm_ref(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                             norm_before_gate=self.norm_before_gate, upcast=True)


def _single_config_autotune():
    """The interpreter cannot benchmark autotune candidates; keep each autotuner's first config."""
    import importlib
    import pkgutil

    from triton.runtime.autotuner import Autotuner

    import mamba_ssm.ops.triton as pkg
    for info in pkgutil.iter_modules(pkg.__path__):
        try:
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        except Exception:  # Mamba3 / tilelang modules that cannot import on CPU
            continue
        for obj in vars(mod).values():
            if isinstance(obj, Autotuner) and len(obj.configs) > 1:
                obj.configs = obj.configs[:1]


if not torch.cuda.is_available():
    _single_config_autotune()
    _mamba2.selective_state_update = selective_state_update_ref
    _ln.RMSNorm.forward = _rmsnorm_forward_ref
    _lng.RMSNorm.forward = _gated_rmsnorm_forward_ref
    _block.layer_norm_fn = _layer_norm_fn_ref
    _mixer.layer_norm_fn = _layer_norm_fn_ref


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on CPU")


def pytest_collection_modifyitems(config, items):
    needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs a CUDA device (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(needs_gpu)
