"""How a proxy process starts: an isolated interpreter, working directory ``/``, an
allowlisted environment, the region's fd and the engine's configuration handed over
through a pipe; and how it ends: signalled through its pidfd and reaped with ``wait4``
(:func:`reap`: asked with SIGTERM by :func:`terminate`, or SIGKILLed by :func:`kill`),
and where no child may be left, through its pid when its pidfd fails (:func:`end`).
:mod:`remote_dspark.supervisor.restarts` decides when; this module says how.

Why a fresh interpreter, never fork or multiprocessing: forking a CUDA-initialised
engine is undefined, and multiprocessing's spawn re-imports the engine's ``__main__``
(torch with it, 3.6 s). The memfd region and the hand-over pipe are the only things the
child inherits (``pass_fds``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from .. import native
from . import handover

log = logging.getLogger("remote_dspark.supervisor")  # spawning and ending proxies is the supervisor's work

# What a proxy inherits of the engine's environment: the contract's variables, what an
# interpreter needs to start, and what an ofl transport needs: where the dynamic loader
# finds libofl.so and its RDMA dependencies (LD_LIBRARY_PATH), the ofl library's own
# settings (OFL_*), and the RDMA stack's: rdma-core's verbs and providers (RDMAV_*,
# IBV_*, MLX5_*), libfabric (FI_*) and UCX (UCX_*), which choose devices, ports and
# queue sizes. Nothing else: no CUDA_*, no LD_PRELOAD of the engine's, no PYTHON* (the
# interpreter is isolated anyway).
_PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ", "XDG_CACHE_HOME", "LD_LIBRARY_PATH")
_PASS_PREFIXES = ("VLLM_DSPARK_", "OFL_", "RDMAV_", "IBV_", "MLX5_", "FI_", "UCX_")


def proxy_environment(environ: Mapping[str, str], hostflag_lib: str) -> dict[str, str]:
    """The proxy's minimal environment. The engine has already located (or built) the
    native library; the proxy is told its path, so it never compiles anything."""
    env = {k: v for k, v in environ.items() if k in _PASS_ENV or k.startswith(_PASS_PREFIXES)}
    env[native.ENV_LIB] = hostflag_lib
    return env


# The proxy's first lines, run by an isolated interpreter (``-I``: neither the working
# directory, PYTHONPATH nor the user site is on sys.path, so a planted ``argparse.py``
# runs nowhere). The root this package was imported from goes after the standard library
# and before any other install, so the proxy runs exactly the engine's code and a file in
# that root can never shadow a standard module (the proxy imports nothing else).
_BOOTSTRAP = """\
import sys
root = sys.argv.pop(1)
at = next((i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))), len(sys.path))
sys.path.insert(at, root)
from remote_dspark.proxy_proc import main
sys.exit(main())
"""
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding remote_dspark/


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> bool:
    """In a child: ask the kernel for ``sig`` when its parent dies (``PR_SET_PDEATHSIG``;
    Linux ties it to the thread that forked the child, so the parent forks from a thread
    that lives as long as it does), and say whether the parent is still ``parent``:
    False when it died before the request took effect, and the child should exit now.
    The proxy process's (SIGTERM: it says BYE) and the benchmarks' answering peers'."""
    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
    return os.getppid() == parent


def spawn_proxy(
    fd: int, *, cfg, engine_id: int, env: Mapping[str, str], vocab_size: int = 0, standby: bool = False
) -> subprocess.Popen:
    """Start the proxy (``remote_dspark.proxy_proc``) in an isolated interpreter, working
    directory ``/``, with the region's fd and the hand-over pipe (:func:`.handover.write`):
    neither the configuration nor the engine id is on its command line or re-parsed from
    its environment. ``standby``: it waits, ready and asleep, for its promotion
    (``remote_dspark.proxy_proc.wait_for_promotion``).

    Raises:
        OSError: the pipe or the process could not be made.
    """
    r = handover.write(cfg, engine_id, vocab_size)
    try:
        return subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-u",
                "-c",
                _BOOTSTRAP,
                PACKAGE_ROOT,
                "--fd",
                str(fd),
                "--handover",
                str(r),
                "--parent",
                str(os.getpid()),
                *(["--standby"] if standby else []),
            ],
            pass_fds=(fd, r),
            env=dict(env),
            cwd="/",
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
    finally:
        os.close(r)


def signal_child(pidfd: int, sig: int) -> None:
    """Send ``sig`` to the child whose pidfd is ``pidfd``: to exactly that process (a
    pidfd never names a recycled pid), and without reaping it, where ``Popen.send_signal``
    polls first and so may reap a child that has just exited, its rusage lost to the
    reaper. A child that has exited (a zombie, or already reaped) is no error."""
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        pass


def reap(proc: subprocess.Popen, pidfd: int, timeout_s: float = 0.0) -> float:
    """Reap ``proc``: wait at most ``timeout_s`` for its exit (its pidfd readable),
    SIGKILL it if it has not exited by then, and collect it with ``wait4``, so no zombie
    is left and its final CPU time is known. Sets ``proc.returncode``, closes ``pidfd``
    (it is this function's from the call on) and returns the child's CPU seconds, user
    plus system; 0.0 when it was reaped elsewhere (SIGCHLD ignored), its status then
    unknown and taken as 0. With ``timeout_s`` 0 the caller has seen it exit.
    """
    try:
        if not select.select([pidfd], [], [], timeout_s)[0]:
            signal_child(pidfd, signal.SIGKILL)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except ChildProcessError:
            if proc.returncode is None:
                proc.returncode = 0
            return 0.0
        proc.returncode = os.waitstatus_to_exitcode(status)
        return usage.ru_utime + usage.ru_stime
    finally:
        os.close(pidfd)


def terminate(proc: subprocess.Popen, pidfd: int, timeout_s: float) -> float:
    """Ask ``proc`` to exit (SIGTERM), then :func:`reap` it: SIGKILL past ``timeout_s``.
    Its CPU seconds."""
    signal_child(pidfd, signal.SIGTERM)
    return reap(proc, pidfd, timeout_s)


def kill(proc: subprocess.Popen, pidfd: int, timeout_s: float) -> float:
    """SIGKILL ``proc`` now, then :func:`reap` it: for a child that could not be asked to
    exit (a stopped process handles no SIGTERM until it is resumed; SIGKILL ends it
    stopped). Its CPU seconds."""
    signal_child(pidfd, signal.SIGKILL)
    return reap(proc, pidfd, timeout_s)


def kill_by_pid(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGKILL ``proc`` through its pid and reap it, waiting at most ``timeout_s``: for a
    child that has no pidfd (``pidfd_open`` failed) or whose pidfd failed. Its pid cannot
    name another process meanwhile: an unreaped child's pid is not reused. A SIGKILLed
    child runs no more code; one the kernel holds past the wait is logged."""
    proc.kill()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.error("proxy pid %d SIGKILLed and not reaped within %.1f s", proc.pid, timeout_s)


def end(proc: subprocess.Popen, pidfd: int, timeout_s: float) -> float:
    """:func:`terminate` ``proc``, whatever that raises: if the ending through its pidfd
    fails (a bad descriptor), it is SIGKILLed through its pid and reaped
    (:func:`kill_by_pid`) and the failure logged. For the paths that must leave no child
    running (close, the way to Spent). Its CPU seconds; 0.0 when the fallback ran
    (Popen's wait keeps no rusage)."""
    try:
        return terminate(proc, pidfd, timeout_s)
    except Exception:
        log.exception("ending proxy pid %d through its pidfd failed; killing it through its pid", proc.pid)
        if proc.poll() is None:
            kill_by_pid(proc, timeout_s)
        return 0.0
