"""``native``: the hand-off primitives of ``hostflag.c``, ``watchdog.c`` and ``tcp_round.c``,
and the worker's round of ``worker_round.c`` (one library, with ``hostflag.h`` between
them), found or built, then loaded.

:mod:`.build` decides where the library comes from (a named file, the ofl directory's
copy, or this package's trusted build) and loads it; :mod:`.binding` binds its functions
and refuses a library whose ABI, structs, shared constants or atomics are not the ones
this package mirrors; :mod:`.structs` holds the ctypes mirrors of its structs. This
package is their one public path (``native.load``, ``native.Native``, ...).
"""

from __future__ import annotations

from .binding import (
    ABI_VERSION,
    CODE_TABLES,
    LOCK_FREE_ALL,
    WIRE_CONSTANTS,
    HostRoundCode,
    Native,
    NativeError,
    Status,
    check,
    deadline_ns,
)
from .build import (
    ENV_LIB,
    OFL_LIB_NAME,
    Origin,
    default_cache_dir,
    load,
    locate,
    origin,
    trusted_cache,
)
from .structs import (
    BatchOut,
    CudaIn,
    HostRoundIn,
    HubConn,
    HubResult,
    HubState,
    LaunchIn,
    LinkState,
    MarkovTable,
    MetaIn,
    ProxyState,
    RingGeom,
    ServeState,
    WindowsView,
)

__all__ = [
    "ABI_VERSION",
    "BatchOut",
    "CODE_TABLES",
    "CudaIn",
    "HostRoundCode",
    "HostRoundIn",
    "HubConn",
    "HubResult",
    "HubState",
    "ENV_LIB",
    "LOCK_FREE_ALL",
    "OFL_LIB_NAME",
    "WIRE_CONSTANTS",
    "LinkState",
    "MarkovTable",
    "LaunchIn",
    "MetaIn",
    "Native",
    "NativeError",
    "Origin",
    "ProxyState",
    "RingGeom",
    "ServeState",
    "Status",
    "WindowsView",
    "check",
    "deadline_ns",
    "default_cache_dir",
    "load",
    "locate",
    "origin",
    "trusted_cache",
]
