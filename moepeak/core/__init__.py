"""moepeak.core: what every schedule stands on. Every moepeak module may import any module
of core (it is the one subpackage whose modules are shared, not private); core imports no
other moepeak subpackage.

  ext              loading moepeak._C, argument checks that name the argument, CUDA
                   stream handles and the build's GPU targets
  transport        the Transport interface (Transport, Handle) and the transport choices
  torch_dist       TorchDistTransport: the interface on torch.distributed
  nccl             NcclTransport: the interface on NCCL called from C (CUDA tensors)
  transport_choice get_transport, shared_nccl_transport: picking one for a group
  process_groups   the registry that lets custom ops take a process group as a string key
  host_memory      MemAvailable checks before large host allocations
  options          resolve_options: the one resolve rule of the schedules' options dataclasses
  autograd         scale_grad: identity forward, scaled gradient
  abi              the C ABI of moepeak._C: dtype codes and row layouts (mirror of csrc/mp_abi.h)

Public face (exported here, for users and tests that drive the multi-rank schedules with
their own transport): get_transport (also moepeak.get_transport), Transport, Handle,
TorchDistTransport, TRANSPORTS.
"""
from .torch_dist import TorchDistTransport
from .transport import TRANSPORTS, Handle, Transport
from .transport_choice import get_transport

__all__ = ["get_transport", "Transport", "Handle", "TorchDistTransport", "TRANSPORTS"]
